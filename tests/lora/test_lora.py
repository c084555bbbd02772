"""LoRA: adapters match HF transformers + peft, several adapters (and the base model) in one
batch; a platform's lora_delta op in place of the torch code; adapter validation errors; the
manager's slots and LRU; the scheduler's max_loras cap; the adapter id in the prefix-cache
hash; the grouped gather-matmul against float64."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kvloom import LLM, SamplingParams
from kvloom.kv_cache.hashing import get_hash_function, update_block_hashes
from kvloom.lora.adapter import LoRAAdapterError, load_adapter, validate_adapter_config
from kvloom.lora.ops import lora_delta_grouped
from kvloom.lora.request import LoRARequest
from kvloom.request import Request
from kvloom.scheduler.scheduler import Scheduler
from kvloom.testing import lora_delta_reference
from tests.helpers.fake_model import make_configs, step
from tests.helpers.lora_fixtures import edit_adapter_config, hf_greedy, make_adapter
from tests.helpers.model_fixtures import tiny_model_dir

MAX_NEW = 8
# The last prompt spans several KV blocks, so a second run gets prefix-cache hits.
PROMPTS = [[5, 17, 33, 48, 90, 11], [7, 8, 9, 10], [(7 * i + 100) % 500 for i in range(40)]]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two random adapters on the tiny Llama: every projection at rank 8 (safetensors),
    and q/v/down at rank 4 with rsLoRA (a .bin file)."""
    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a1": make_adapter(base, root / "a1", seed=1, r=8),
        "a2": make_adapter(base, root / "a2", seed=2, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj", "down_proj"], safetensors=False, use_rslora=True),
    }


@pytest.fixture(scope="module")
def hf_reference(adapters: dict[str, Path]) -> dict[tuple[str | None, int], list[int]]:
    base = tiny_model_dir("llama")
    return {
        (name, i): hf_greedy(base, adapters[name] if name else None, prompt, MAX_NEW)
        for name in (None, "a1", "a2")
        for i, prompt in enumerate(PROMPTS)
    }


def _run_batch(llm: LLM, adapters: dict[str, Path]) -> dict[tuple[str | None, int], list[int]]:
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    keys = [(name, i) for i in range(len(PROMPTS)) for name in (None, "a1", "a2")]
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[i]} for _, i in keys],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
        lora_request=[requests[name] if name else None for name, _ in keys],
        use_tqdm=False,
    )
    return {key: list(out.outputs[0].token_ids) for key, out in zip(keys, outs)}


def test_two_adapters_and_base_in_one_batch_match_hf_peft(adapters, hf_reference) -> None:
    # The adapters really change the output (otherwise this test could not fail).
    for i in range(len(PROMPTS)):
        assert hf_reference[("a1", i)] != hf_reference[(None, i)]
        assert hf_reference[("a2", i)] != hf_reference[(None, i)]
    llm = LLM(str(tiny_model_dir("llama")), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
              block_size=16)  # fmt: skip
    assert _run_batch(llm, adapters) == hf_reference
    # Again, now with the prompts' blocks cached: each adapter may only reuse its own KV
    # (the adapter id is in the block hash), so the results stay the same.
    assert llm.config.cache.enable_prefix_caching
    assert _run_batch(llm, adapters) == hf_reference
    # Both adapters stayed loaded; removing one frees it.
    assert llm.llm_engine.list_loras() == {1, 2}
    assert llm.llm_engine.remove_lora(2) is True
    assert llm.llm_engine.list_loras() == {1}


def test_the_platforms_lora_delta_op_replaces_the_torch_code(adapters, hf_reference, monkeypatch) -> None:
    """A platform's ``lora_delta`` custom op (the CUDA platform's Triton kernel) is what
    the LoRA layers call; here a spy that computes the torch code's result."""
    from kvloom import plugins
    from kvloom.layers import custom_ops
    from kvloom.lora.ops import LoRAMapping

    calls = []

    def lora_delta(x, y, lora_a, lora_b, mapping):
        assert isinstance(mapping, LoRAMapping) and mapping.active
        calls.append(x.shape[0])
        return lora_delta_grouped(x, y, lora_a, lora_b, mapping.groups)

    plugins.load_plugins()
    platform = plugins.current_platform()
    monkeypatch.setattr(platform, "custom_ops", classmethod(lambda cls, config: {"lora_delta": lora_delta}))
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the patched platform lives in this process
    try:
        llm = LLM(str(tiny_model_dir("llama")), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
                  block_size=16)  # fmt: skip
        assert _run_batch(llm, adapters) == hf_reference
    finally:
        custom_ops.set_custom_ops({})
    assert calls


def test_one_slot_and_one_cached_adapter_still_match(adapters, hf_reference) -> None:
    """max_loras=1: the scheduler runs one adapter at a time (base requests alongside);
    max_cpu_loras=1: adapters are evicted and reloaded from disk as they alternate."""
    llm = LLM(str(tiny_model_dir("llama")), enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8,
              dtype="float32", enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8)  # fmt: skip
    assert _run_batch(llm, adapters) == hf_reference


def test_lora_request_needs_enable_lora(adapters) -> None:
    llm = LLM(str(tiny_model_dir("llama")), dtype="float32")
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.generate("hello", lora_request=LoRARequest("a1", 1, str(adapters["a1"])), use_tqdm=False)


# ----------------------------------------------------------------- validation


def test_an_adapter_that_cannot_be_loaded_fails_its_requests_alone(adapters, hf_reference, tmp_path: Path) -> None:
    """An adapter whose files are gone when its requests run fails them with finish reason
    "error" before the step; the base model's and a1's requests in the same batch are
    exact, and the engine serves on (its blocks are not reused as cached KV)."""
    gone = _copy(adapters["a2"], tmp_path)
    shutil.rmtree(gone)
    llm = LLM(str(tiny_model_dir("llama")), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
              block_size=16)  # fmt: skip
    requests = {"a1": LoRARequest("a1", 1, str(adapters["a1"])), "gone": LoRARequest("gone", 7, str(gone))}
    keys = [(name, i) for i in range(len(PROMPTS)) for name in (None, "a1", "gone")]
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[i]} for _, i in keys],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
        lora_request=[requests[name] if name else None for name, _ in keys],
        use_tqdm=False,
    )
    for (name, i), out in zip(keys, outs):
        if name == "gone":
            assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
        else:
            assert list(out.outputs[0].token_ids) == hf_reference[(name, i)]
    assert _run_batch(llm, {"a1": adapters["a1"], "a2": adapters["a2"]}) == hf_reference


def _copy(adapter: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(adapter, tmp_path / adapter.name))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"peft_type": "PREFIX_TUNING"}, "peft_type is 'PREFIX_TUNING'; only 'LORA' is supported"),
        ({"r": 32}, "LoRA rank 32 exceeds max_lora_rank 16"),
        ({"target_modules": ["q_proj", "lm_head"]}, r"target_modules \['lm_head'\] are not supported"),
        ({"use_dora": True}, "use_dora is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern is not supported"),
    ],
)
def test_invalid_adapter_configs_are_refused(adapters, tmp_path: Path, changes: dict, message: str) -> None:
    adapter = _copy(adapters["a1"], tmp_path)
    edit_adapter_config(adapter, **changes)
    with pytest.raises(LoRAAdapterError, match=message):
        load_adapter(1, "bad", adapter, max_lora_rank=16)


def test_missing_files_are_refused(adapters, tmp_path: Path) -> None:
    with pytest.raises(LoRAAdapterError, match="is not a directory"):
        load_adapter(1, "x", tmp_path / "nope", 16)
    adapter = _copy(adapters["a1"], tmp_path)
    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match="has no weights"):
        load_adapter(1, "x", adapter, 16)
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(LoRAAdapterError, match="adapter_config.json does not exist"):
        load_adapter(1, "x", adapter, 16)


def test_base_model_mismatch_is_refused(adapters) -> None:
    with pytest.raises(LoRAAdapterError, match="base_model_name_or_path is .* but this server runs 'other-model'"):
        load_adapter(1, "a1", adapters["a1"], 16, base_model_name="other-model")
    # The adapter's recorded base model is the tiny model's directory: accepted.
    load_adapter(1, "a1", adapters["a1"], 16, base_model_name=str(tiny_model_dir("llama")))


@pytest.mark.parametrize(
    "recorded, names, accepted",
    [
        ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B", True),  # the same name
        ("meta-llama/Llama-3.2-1B", "Llama-3.2-1B", True),  # a served name defaults to the directory's name
        ("meta-llama/Llama-3.2-1B", "/srv/models/Llama-3.2-1B/", True),  # the model path: same final component
        ("/data/ckpt/Llama-3.2-1B", ["my-alias", "/srv/models/Llama-3.2-1B"], True),  # any of several names
        ("meta-llama/Llama-3.2-1B", "Llama-3.2-1B-Instruct", False),
        ("meta-llama/Llama-3.2-1B", "my-alias", False),
        ("meta-llama/Llama-3.2-1B", "llama-3.2-1b", False),  # case counts
        ("", "Llama-3.2-1B", False),
    ],
)
def test_base_model_names_match_by_name_path_or_final_component(recorded, names, accepted) -> None:
    config = {"peft_type": "LORA", "r": 4, "base_model_name_or_path": recorded}
    if accepted:
        validate_adapter_config(config, base_model_name=names, name="a")
    else:
        with pytest.raises(LoRAAdapterError, match="base_model_name_or_path is"):
            validate_adapter_config(config, base_model_name=names, name="a")


def test_base_model_is_not_checked_without_a_name() -> None:
    validate_adapter_config({"peft_type": "LORA", "r": 4, "base_model_name_or_path": "another/model"}, name="a")
    validate_adapter_config({"peft_type": "LORA", "r": 4}, base_model_name="Llama-3.2-1B", name="a")  # none recorded


def test_lora_adapter_error_is_public_and_a_value_error() -> None:
    from kvloom import interfaces

    assert interfaces.LoRAAdapterError is LoRAAdapterError and issubclass(LoRAAdapterError, ValueError)
    with pytest.raises(interfaces.LoRAAdapterError, match="peft_type is 'IA3'"):
        interfaces.validate_adapter_config({"peft_type": "IA3"}, name="a")


def test_adapter_for_another_shape_is_refused_by_the_engine(tmp_path: Path) -> None:
    """An adapter trained for a model with more layers names modules this model lacks."""
    from tests.helpers.model_fixtures import make_tiny_model

    bigger = make_tiny_model("llama", tmp_path / "bigger", num_hidden_layers=3)
    adapter = make_adapter(bigger, tmp_path / "deep", seed=3, r=4)
    llm = LLM(str(tiny_model_dir("llama")), enable_lora=True, max_lora_rank=8, dtype="float32")
    with pytest.raises(LoRAAdapterError, match="model.layers.2.* which this model does not have"):
        llm.llm_engine.add_lora(LoRARequest("deep", 1, str(adapter)))


# ----------------------------------------------------------------- scheduler and prefix cache


def test_scheduler_admits_at_most_max_loras_adapters() -> None:
    sc, cc = make_configs(max_num_seqs=8, max_num_batched_tokens=64)
    scheduler = Scheduler(sc, cc, num_blocks=64, max_loras=1)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    l1, l2 = LoRARequest("one", 1, "/x"), LoRARequest("two", 2, "/y")
    scheduler.add_request(Request("r1", [1, 2, 3], params, lora_request=l1))
    scheduler.add_request(Request("r2", [1, 2, 3], params, lora_request=l2))
    scheduler.add_request(Request("r3", [4, 5], params))
    scheduler.add_request(Request("r4", [6, 7], params, lora_request=l1))
    so, _ = step(scheduler)
    # r2 waits (a second adapter); the base request and r4 (same adapter) go past it.
    assert set(so.num_scheduled_tokens) == {"r1", "r3", "r4"}
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    while "r2" not in so.num_scheduled_tokens:
        so, _ = step(scheduler)
    assert not {"r1", "r4"} & set(so.num_scheduled_tokens)  # never together with the other adapter
    assert scheduler.requests.keys() == {"r2"}  # it ran once the first adapter's requests finished


def test_adapter_id_is_in_the_prefix_cache_hash() -> None:
    hash_fn = get_hash_function("sha256")
    tokens = list(range(8))
    params = SamplingParams(max_tokens=1)

    def hashes(lora: LoRARequest | None) -> list:
        return update_block_hashes(Request("r", tokens, params, lora_request=lora), 4, hash_fn)

    base, one, one_again, two = hashes(None), hashes(LoRARequest("a", 1, "/a")), hashes(LoRARequest("a", 1, "/a")), \
        hashes(LoRARequest("b", 2, "/b"))  # fmt: skip
    assert one == one_again
    assert len({base[0], one[0], two[0]}) == 3 and len({base[1], one[1], two[1]}) == 3


# ----------------------------------------------------------------- the gather-matmul


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_grouped_lora_delta_matches_float64(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    n, k, out, rank, slots = 37, 48, 80, 24, 4
    x = torch.randn(n, k).to(dtype)
    y = torch.randn(n, out).to(dtype)
    a = torch.randn(slots, rank, k).to(dtype)
    b = torch.randn(slots, out, rank).to(dtype)
    a[0] = 0
    b[0] = 0
    token_slots = torch.randint(0, slots, (n,), dtype=torch.int32)
    groups = [(s, torch.nonzero(token_slots == s).flatten()) for s in range(1, slots) if (token_slots == s).any()]
    expected = lora_delta_reference(x, y, a, b, token_slots)
    actual = lora_delta_grouped(x, y, a, b, groups).double()
    scale = expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= tol * scale
    # Tokens without an adapter are untouched.
    base_rows = token_slots == 0
    assert torch.equal(lora_delta_grouped(x, y, a, b, groups)[base_rows], y[base_rows])
