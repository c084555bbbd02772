"""The example logits processor (plugins/examples/logits_processor), pip-installed: the
requests of a batch that ask for it (``extra_args``) start with their forced tokens and then
continue as the model would after them, the others are left alone, with synchronous and
async scheduling; a bad value is refused naming the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvloom.testing.install import install_distribution, plugin_env
from kvloom.testing.models import tiny_model_dir

SOURCE = Path(__file__).resolve().parents[1]

GENERATE = """
import json, sys
from kvloom import LLM, SamplingParams
prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}, {"prompt_token_ids": [5, 6, 7, 40, 41]}]
forced = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, extra_args={"forced_tokens": [40, 41]})
plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
for scheduling in ("sync", "async"):
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory="16MiB", async_scheduling=scheduling == "async")
    outs = llm.generate(prompts, [forced, plain, plain], use_tqdm=False)
    print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
    llm.llm_engine.shutdown()
try:
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory="16MiB")
    llm.generate("Hi", SamplingParams(extra_args={"forced_tokens": ["x"]}), use_tqdm=False)
except ValueError as exc:
    print(json.dumps(str(exc).splitlines()))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_distribution(SOURCE, tmp_path_factory.mktemp("example-logits-processor"))


def test_forced_tokens_in_a_batch(site: Path) -> None:
    """Synchronous, then async scheduling (the engine core in the script's process)."""
    done = subprocess.run([sys.executable, "-c", GENERATE, str(tiny_model_dir("llama"))],
                          env=plugin_env([site], KVLOOM_ENABLE_MULTIPROCESSING="0"), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    *runs, error = [json.loads(line) for line in done.stdout.strip().splitlines()[-3:]]
    assert runs[0] == runs[1]  # async scheduling changes nothing
    forced, plain, continued = runs[0]
    assert forced[:2] == [40, 41]
    # After the forced tokens the model goes on as it would after a prompt ending in them.
    assert forced[2:] == continued[:4]
    assert plain != forced[: len(plain)]
    assert any("extra_args.forced_tokens: 'x' is not a token id (allowed: integers >= 0)" in line for line in error)
