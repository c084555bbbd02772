"""``--speculative-config`` / ``LLM(speculative_config=...)`` as a user meets it: a bad
config is an error naming the field, vLLM's ``spec_decode_*`` metrics count the drafts, and a
third-party proposer (``kvloom.spec_decode_proposers``) runs under the same contract."""

from __future__ import annotations

from typing import ClassVar

import pytest

from kvloom import LLM, SamplingParams
from kvloom.interfaces import HostProposer, ProposalRequest, Proposals, SpeculativeConfig
from kvloom.metrics.reader import Counter
from kvloom.testing.engine import run_cli
from kvloom.testing.models import tiny_model_dir
from kvloom.testing.plugins import installed_proposer
from kvloom.testing.spec_decode import check_proposer, in_process_engines

LOOP = [5, 6, 7, 8, 9, 10] * 4


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens:"),
        ({"method": "ngram", "num_speculative_tokens": "many"}, "speculative_config.num_speculative_tokens:"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_min (4) must be <= prompt_lookup_max (2)",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model is required"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key 'lookahead' (allowed: method"),
        ({"num_speculative_tokens": 2}, "speculative_config.method is required (allowed: ngram"),
        ([1, 2], "speculative_config must be a JSON object"),
    ],
)
def test_bad_config_names_the_field(config: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.from_user(config)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_bad_config_through_llm_and_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="method"):
        LLM(model, speculative_config={"method": "medusa2", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative_config.model"):
        LLM(model, speculative_config={"method": "draft_model", "model": "/nonexistent/draft",
                                       "num_speculative_tokens": 2})  # fmt: skip
    with pytest.raises(SystemExit):
        run_cli(["serve", model, "--speculative-config", "{not json"])
    assert "--speculative-config" in capsys.readouterr().err


def _metric(metrics: list, name: str) -> float:
    values = [m.value for m in metrics if m.name == name and isinstance(m, Counter)]
    assert values, f"no metric {name}: {sorted({m.name for m in metrics})}"
    return sum(values)


def test_spec_decode_metrics_count_drafts_as_vllm_names_them() -> None:
    with in_process_engines():
        llm = LLM(str(tiny_model_dir("llama")), dtype="float32", kv_cache_memory="32MiB",
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})  # fmt: skip
        llm.generate([{"prompt_token_ids": LOOP}], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                     use_tqdm=False)  # fmt: skip
        metrics = llm.get_metrics()
    drafts = _metric(metrics, "kvloom:spec_decode_num_drafts")
    drafted = _metric(metrics, "kvloom:spec_decode_num_draft_tokens")
    accepted = _metric(metrics, "kvloom:spec_decode_num_accepted_tokens")
    per_pos = _metric(metrics, "kvloom:spec_decode_num_accepted_tokens_per_pos")
    assert 0 < drafts <= drafted <= 3 * drafts
    assert 0 < accepted <= drafted and per_pos == accepted


class RepeatLastProposer(HostProposer):
    """A deliberately poor third-party proposer: drafts the last token again, ``num_drafts`` times."""

    NAME: ClassVar[str] = "repeat_last"
    max_num_speculative_tokens: ClassVar[int | None] = 4

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        return Proposals([[int(r.token_ids[-1])] * r.num_drafts for r in requests])


def test_a_plugin_proposer_keeps_greedy_output_and_its_limits_are_checked() -> None:
    with installed_proposer(RepeatLastProposer):
        check_proposer(tiny_model_dir("llama"), {"method": "repeat_last", "num_speculative_tokens": 2}, [LOOP[:9]])
        with pytest.raises(ValueError, match="num_speculative_tokens 8 is more than it drafts"):
            LLM(str(tiny_model_dir("llama")), speculative_config={"method": "repeat_last", "num_speculative_tokens": 8})
