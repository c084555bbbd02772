"""Weight loading sharded per rank: under tensor parallelism each rank reads only its
slices of the safetensors checkpoint.

Each rank of TP=2 is built in this process (``parallel_state`` set to that rank; loading
runs no collective) with the engine's ``get_model``; every region materialised from the
checkpoint is recorded (``LazyTensor.materialize``). Every checkpoint tensor is read once
per rank; a rank reads half of every split matrix (the right half: rows of the column-
parallel projections, the embedding and the LM head, columns of the row-parallel ones,
per expert the intermediate range of gate/up rows and down columns), the two ranks'
halves tile it, and the norms and the MoE router are read whole.
``--load-format dummy`` reads nothing and makes only the rank's shards.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open

from kvloom.distributed import parallel_state
from kvloom.loader import weight_utils
from kvloom.loader.lazy_tensor import LazyTensor
from kvloom.loader.model_loader import get_model
from kvloom.testing import resolve_engine_config
from kvloom.testing.models import tiny_model_dir

#: Read whole by every rank: RMSNorm weights (input/post-attention, final, q/k norms) and
#: the MoE router (``mlp.gate``, replicated so every rank routes alike).
REPLICATED = re.compile(r"(norm\.weight|\.mlp\.gate\.weight)$")
#: Row-parallel: the rank's input columns (o_proj, the dense and the experts' down_proj).
ROW_PARALLEL = re.compile(r"(o_proj|down_proj)\.weight$")

Region = tuple[tuple[int, int], ...]


def _rank_reads(model: str, rank: int, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, list[Region]], int]:
    """``{checkpoint name: regions rank read}`` and the bytes it materialised, for TP rank
    ``rank`` of 2 loading the tiny ``model``."""
    config = resolve_engine_config(model=str(tiny_model_dir(model)), dtype="float32", tensor_parallel_size=2)
    reads: dict[str, list[Region]] = {}
    nbytes = 0
    original = LazyTensor.materialize

    def spy(self: LazyTensor) -> torch.Tensor:
        nonlocal nbytes
        tensor = original(self)
        reads.setdefault(self.name, []).append(self.region)
        nbytes += tensor.numel() * tensor.element_size()
        return tensor

    with monkeypatch.context() as m:
        m.setattr(LazyTensor, "materialize", spy)
        m.setattr(parallel_state, "_STATE", parallel_state._ParallelState(rank=rank, world_size=2, tp_size=2))
        get_model(config, "cpu")
    return reads, nbytes


def _checkpoint_shapes(model: str) -> tuple[dict[str, tuple[int, ...]], int]:
    (path,) = weight_utils.find_weight_files(tiny_model_dir(model))[1]
    with safe_open(str(path), framework="pt", device="cpu") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    return shapes, sum(4 * torch.Size(s).numel() for s in shapes.values())  # fp32 checkpoints


def _expected_region(name: str, shape: tuple[int, ...], rank: int) -> Region:
    whole = tuple((0, n) for n in shape)
    if REPLICATED.search(name):
        return whole
    dim = 1 if ROW_PARALLEL.search(name) else 0
    half = shape[dim] // 2
    return tuple((rank * half, (rank + 1) * half) if d == dim else whole[d] for d in range(len(shape)))


@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_each_rank_reads_only_its_slices(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    shapes, file_bytes = _checkpoint_shapes(model)
    if model == "qwen3_moe":  # the experts and the router are in the checkpoint and checked below
        assert any(".mlp.experts.7.down_proj." in n for n in shapes) and any(".mlp.gate.weight" in n for n in shapes)
    replicated_bytes = sum(4 * torch.Size(s).numel() for n, s in shapes.items() if REPLICATED.search(n))
    regions: dict[str, list[Region]] = {}
    for rank in range(2):
        reads, nbytes = _rank_reads(model, rank, monkeypatch)
        assert reads.keys() == shapes.keys()  # every tensor, each once (nothing read whole and narrowed)
        for name, shape in shapes.items():
            assert reads[name] == [_expected_region(name, shape, rank)], name
            regions.setdefault(name, []).extend(reads[name])
        # Half of every split tensor, all of the replicated ones.
        assert nbytes == replicated_bytes + (file_bytes - replicated_bytes) // 2
        assert nbytes < 0.55 * file_bytes
    for name, shape in shapes.items():
        if REPLICATED.search(name):
            continue
        dim = 1 if ROW_PARALLEL.search(name) else 0
        halves = sorted(r[dim] for r in regions[name])
        assert halves == [(0, shape[dim] // 2), (shape[dim] // 2, shape[dim])], name  # the ranks tile it


def test_dummy_weights_make_only_the_local_shards(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("dummy weights must not read the checkpoint")

    monkeypatch.setattr("kvloom.loader.model_loader.hf_dir_weights", no_reading)
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state._ParallelState(rank=1, world_size=2, tp_size=2))
    config = resolve_engine_config(model=str(tiny_model_dir("qwen3_moe")), dtype="float32", tensor_parallel_size=2,
                                   load_format="dummy")  # fmt: skip
    net = get_model(config, "cpu")
    hf = config.model.hf_config
    layer = net.model.layers[0]
    assert tuple(layer.self_attn.qkv_proj.weight.shape) == ((4 + 2 + 2) * 16 // 2, 64)
    assert tuple(layer.self_attn.o_proj.weight.shape) == (64, 4 * 16 // 2)
    assert tuple(layer.mlp.experts.w13_weight.shape) == (hf.num_experts, 2 * hf.moe_intermediate_size // 2, 64)
    assert tuple(net.model.embed_tokens.weight.shape) == (hf.vocab_size // 2, 64)
    assert layer.mlp.experts.w2_weight.abs().max() > 0  # filled
