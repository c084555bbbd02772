"""Smaller inconsistencies a vLLM user trips on (issue 18, item 8): ``priority`` under
fcfs, chunked prefill off with a small ``--max-num-batched-tokens``, ``kvloom generate
--lora``, ``LLM.reset_prefix_cache()`` and ``LLM.get_metrics()`` (also with the engine
core in its own process)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from tests.helpers.lora_fixtures import hf_greedy, make_adapter
from tests.helpers.model_fixtures import tiny_model_dir

from kvloom import LLM, SamplingParams
from kvloom.engine.arg_utils import EngineArgs
from kvloom.metrics.reader import Counter, Gauge, Histogram
from kvloom.testing import resolve_engine_config, run_cli

PROMPT = list(range(3, 3 + 40))  # over two blocks of 16: the prefix cache keeps two
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_priority_under_fcfs_is_refused_as_the_server_refuses_it(monkeypatch):
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(tiny_model_dir("llama")), max_num_seqs=2, max_model_len=64, disable_log_stats=True)
    with pytest.raises(ValueError, match=r"priority: 3 needs the engine to run with --scheduling-policy priority "
                                         r"\(it uses fcfs; allowed value: 0\)"):  # fmt: skip
        llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False, priority=[3])
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False, priority=[0])) == 1


def test_chunked_prefill_off_does_not_silently_override_max_num_batched_tokens():
    model = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match=r"max_num_batched_tokens: 32 is smaller than max_model_len \(64\); with "
                                         r"chunked prefill off .* --max-num-batched-tokens >= 64"):  # fmt: skip
        resolve_engine_config(model=model, max_model_len=64, max_num_seqs=4, enable_chunked_prefill=False,
                              max_num_batched_tokens=32)
    # Unset, it is raised to what a whole prompt needs, as before.
    config = resolve_engine_config(model=model, max_model_len=64, max_num_seqs=4, enable_chunked_prefill=False)
    assert config.scheduler.max_num_batched_tokens == 64


def test_generate_picks_a_lora_adapter(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    base = tiny_model_dir("llama")
    adapter = make_adapter(base, tmp_path / "adapter", seed=3, r=8)
    argv = ["generate", "--model", str(base), "--prompt", "hello world", "--raw", "--json", "--max-tokens", "6",
            "--max-model-len", "64", "--max-num-seqs", "2", "--disable-log-stats"]  # fmt: skip
    assert run_cli([*argv, "--lora-modules", f"ad={adapter}", "--lora", "ad"]) == 0
    with_lora = json.loads(capsys.readouterr().out)[0]
    assert run_cli(argv) == 0
    without = json.loads(capsys.readouterr().out)[0]
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(str(base))("hello world")["input_ids"]
    assert with_lora["num_prompt_tokens"] == len(prompt_ids)
    n = len(with_lora["token_ids"])  # eos may end it early
    assert n >= 1 and with_lora["token_ids"] == hf_greedy(base, adapter, prompt_ids, 6)[:n]
    assert with_lora["token_ids"] != without["token_ids"]
    assert run_cli([*argv, "--lora-modules", f"ad={adapter}", "--lora", "other"]) == 1
    assert "--lora: no adapter named 'other' in --lora-modules (given: ad)" in capsys.readouterr().err


def _metric(metrics, name: str) -> float:
    values = [m.value for m in metrics if m.name == name and isinstance(m, (Counter, Gauge))]
    assert values, f"no metric {name}: {sorted({m.name for m in metrics})}"
    return sum(values)


@pytest.mark.parametrize("multiprocessing", ["1", "0"], ids=["core-process", "in-process"])
def test_reset_prefix_cache_and_get_metrics(multiprocessing, monkeypatch):
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", multiprocessing)
    llm = LLM(str(tiny_model_dir("llama")), max_num_seqs=2, max_model_len=64, block_size=16)
    try:
        llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)
        metrics = llm.get_metrics()
        assert _metric(metrics, "kvloom:prompt_tokens") == len(PROMPT)
        assert _metric(metrics, "kvloom:generation_tokens") == 4
        assert any(isinstance(m, Histogram) and m.name == "kvloom:e2e_request_latency_seconds" and m.count == 1
                   for m in metrics)  # fmt: skip
        hits = _metric(metrics, "kvloom:prefix_cache_hits")

        llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)  # two cached blocks
        cached = _metric(llm.get_metrics(), "kvloom:prefix_cache_hits")
        assert cached == hits + 32

        assert llm.reset_prefix_cache() is True
        llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)  # nothing cached any more
        assert _metric(llm.get_metrics(), "kvloom:prefix_cache_hits") == cached
    finally:
        llm.llm_engine.shutdown()


def test_get_metrics_needs_stats(monkeypatch):
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(str(tiny_model_dir("llama")), max_num_seqs=2, max_model_len=64, disable_log_stats=True)
    with pytest.raises(ValueError, match="get_metrics: engine stats are off"):
        llm.get_metrics()


@pytest.mark.parametrize("kwargs,message", [
    # A vLLM option kvloom has not built: why (from the table of vLLM's options), in Python names.
    ({"kv_events_config": {}}, "kv_events_config is not supported by kvloom yet"),
    ({"task": "generate"}, "task is not supported by kvloom yet (use runner)"),
    ({"max_num_seq": 8}, "unknown option max_num_seq (did you mean max_num_seqs?)"),
    ({"max_num_seqs": 0}, "max_num_seqs: Input should be greater than or equal to 1 (allowed range: 1 <= max_num_seqs "
                          "<= 65536)"),
    ({"dtype": "int8"}, "dtype: Input should be 'auto', 'float32', 'float', 'float16', 'half' or 'bfloat16'"),
])  # fmt: skip
def test_python_api_errors_are_in_kvloom_words(kwargs: dict, message: str) -> None:
    for make in (lambda: LLM("/models/m", **kwargs), lambda: EngineArgs(**kwargs)):
        with pytest.raises(ValueError) as info:
            make()
        assert str(info.value) == message and not isinstance(info.value, ValidationError)
    args = EngineArgs()
    with pytest.raises(ValueError, match=r"^max_model_len: Input should be greater than or equal to 1"):
        args.max_model_len = 0


def test_python_api_drops_an_ignored_vllm_option_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        assert EngineArgs(swap_space=4) == EngineArgs()
    assert "swap_space is ignored by kvloom (vLLM V1 does not swap either" in caplog.text
