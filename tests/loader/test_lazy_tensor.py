"""The lazy checkpoint tensor contract (``kvloom.loader.lazy_tensor``).

* ``narrow`` on either dimension (negative too), chained and on both dimensions, reads
  exactly what ``torch.narrow`` of the whole tensor gives, and only that region;
* a range outside the tensor is a ``ValueError`` naming the tensor, the argument and the
  allowed range;
* the parallel layers' weight loaders (merged q/k/v and gate/up, row-parallel, vocab
  rows) load from handles what they load from whole tensors, and read only their part;
* who gets handles: a model or module declares it in the class that defines its loader;
  a subclass that overrides the loader gets whole tensors; ``.bin`` files give tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from kvloom.distributed import parallel_state
from kvloom.layers.linear import Linear, MergedLinear, QKVLinear
from kvloom.layers.vocab_embedding import VocabEmbedding
from kvloom.loader.lazy_tensor import LazyTensor, accepts_lazy_weights, materialize
from kvloom.loader.model_loader import model_weights
from kvloom.loader.weight_utils import hf_dir_weights
from kvloom.models.llama import LlamaForCausalLM
from kvloom.models.weights import load_checkpoint_weights
from kvloom.testing.models import tiny_model_dir
from tests.helpers.model_fixtures import make_test_engine_config


def _handles(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, LazyTensor]:
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path))
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return {name: LazyTensor(name, f.get_slice(name), str(path)) for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)


@pytest.fixture
def matrix(tmp_path: Path) -> tuple[torch.Tensor, LazyTensor]:
    whole = torch.randn(12, 10, generator=torch.Generator().manual_seed(0))
    return whole, _handles(tmp_path, {"w": whole})["w"]


def test_narrow_reads_what_torch_narrow_gives(matrix: tuple[torch.Tensor, LazyTensor]) -> None:
    whole, handle = matrix
    assert handle.shape == whole.shape and handle.dim() == 2 and handle.numel() == 120
    assert torch.equal(materialize(handle), whole)
    assert torch.equal(handle.narrow(0, 3, 4).materialize(), whole.narrow(0, 3, 4))
    assert torch.equal(handle.narrow(1, 5, 5).materialize(), whole.narrow(1, 5, 5))
    assert torch.equal(handle.narrow(-1, 2, 3).materialize(), whole.narrow(-1, 2, 3))
    # Chained on one dimension, then on the other: offsets add up.
    both = handle.narrow(0, 2, 8).narrow(0, 1, 3).narrow(1, 4, 6)
    assert both.region == ((3, 6), (4, 10)) and both.shape == torch.Size([3, 6])
    assert torch.equal(both.materialize(), whole[3:6, 4:10])
    assert handle.narrow(0, 12, 0).materialize().shape == (0, 10)  # an empty tail, as torch allows
    assert handle.region == ((0, 12), (0, 10))  # narrowing never changes the handle itself


def test_scalar_and_identity(tmp_path: Path) -> None:
    handles = _handles(tmp_path, {"s": torch.tensor(2.5), "v": torch.arange(4.0)})
    assert handles["s"].shape == () and materialize(handles["s"]).item() == 2.5
    t = torch.ones(3)
    assert materialize(t) is t  # a tensor passes through
    with pytest.raises(ValueError, match=r"^s: a 0-dim checkpoint tensor cannot be narrowed"):
        handles["s"].narrow(0, 0, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, 0, 1), r"^w: narrow dim 2 is outside \[-2, 1\] \(shape \(12, 10\)\)"),
        ((-3, 0, 1), r"^w: narrow dim -3 is outside \[-2, 1\]"),
        ((0, -1, 2), r"^w: narrow start -1 along dim 0 is outside \[0, 12\]"),
        ((1, 11, 1), r"^w: narrow start 11 along dim 1 is outside \[0, 10\]"),
        ((0, 8, 5), r"^w: narrow length 5 from 8 along dim 0 is outside \[0, 4\]"),
        ((1, 0, -1), r"^w: narrow length -1 from 0 along dim 1 is outside \[0, 10\]"),
    ],
)
def test_bad_ranges_name_the_tensor_and_the_allowed_range(
    matrix: tuple[torch.Tensor, LazyTensor], args: tuple[int, int, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        matrix[1].narrow(*args)


def test_a_read_that_fails_names_the_tensor_and_file(matrix: tuple[torch.Tensor, LazyTensor]) -> None:
    class Broken:
        def get_shape(self) -> list[int]:
            return [2, 2]

        def __getitem__(self, index: object) -> torch.Tensor:
            raise OSError("device not ready")

    with pytest.raises(ValueError, match=r"weights: cannot read x in /f.safetensors .*device not ready"):
        LazyTensor("x", Broken(), "/f.safetensors").materialize()


# ---------------------------------------------------------------------- the parallel layers


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    """Every region materialised from a handle, in order."""
    seen: list[tuple[str, tuple[tuple[int, int], ...]]] = []
    original = LazyTensor.materialize

    def spy(self: LazyTensor) -> torch.Tensor:
        seen.append((self.name, self.region))
        return original(self)

    monkeypatch.setattr(LazyTensor, "materialize", spy)
    return seen


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, tp: int) -> None:
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state._ParallelState(rank=rank, world_size=tp, tp_size=tp))


class _Block(nn.Module):
    """Every kind of parallel projection, with HF-named checkpoint tensors."""

    stacked_params = (("qkv", "q", "q"), ("qkv", "k", "k"), ("qkv", "v", "v"), ("gate_up", "gate", "0"),
                      ("gate_up", "up", "1"))  # fmt: skip

    def __init__(self, num_kv_heads: int) -> None:
        super().__init__()
        self.qkv = QKVLinear(8, 2, 4, num_kv_heads, bias=True, prefix="qkv", parallel=True)
        self.o = Linear(8, 8, bias=True, prefix="o", parallel="row")
        self.gate_up = MergedLinear(8, [6, 6], prefix="gate_up", parallel="column")
        self.embed = VocabEmbedding(11, 8, prefix="embed", parallel=True)


def _checkpoint(num_kv_heads: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    shapes = {"q.weight": (8, 8), "q.bias": (8,), "k.weight": (2 * num_kv_heads, 8), "k.bias": (2 * num_kv_heads,),
              "v.weight": (2 * num_kv_heads, 8), "v.bias": (2 * num_kv_heads,), "o.weight": (8, 8), "o.bias": (8,),
              "gate.weight": (6, 8), "up.weight": (6, 8), "embed.weight": (11, 8)}  # fmt: skip
    return {name: torch.randn(*shape, generator=gen) for name, shape in shapes.items()}


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
@pytest.mark.parametrize("rank", [0, 1])
def test_parallel_layers_load_the_same_from_handles_reading_only_their_part(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: list, rank: int, num_kv_heads: int
) -> None:
    ckpt = _checkpoint(num_kv_heads)
    _as_rank(monkeypatch, rank, 2)
    from_tensors, from_handles = _Block(num_kv_heads), _Block(num_kv_heads)
    load_checkpoint_weights(from_tensors, ckpt.items(), _Block.stacked_params)
    assert reads == []  # whole tensors: nothing to materialise
    load_checkpoint_weights(from_handles, _handles(tmp_path, ckpt).items(), _Block.stacked_params)
    for (name, a), b in zip(from_tensors.state_dict().items(), from_handles.state_dict().values()):
        assert torch.equal(a, b), name
    half = (rank * 4, rank * 4 + 4)  # of 8 query rows, 8 input columns
    kv = (rank * 2, rank * 2 + 2) if num_kv_heads == 2 else (0, 2)  # one KV head: both ranks read it whole
    vocab = (0, 6) if rank == 0 else (6, 11)  # ceil(11 / 2) rows per rank, the last one short
    assert dict(reads) == {
        "q.weight": (half, (0, 8)), "q.bias": (half,),
        "k.weight": (kv, (0, 8)), "k.bias": (kv,), "v.weight": (kv, (0, 8)), "v.bias": (kv,),
        "o.weight": ((0, 8), half), "o.bias": ((0, 8),),  # row-parallel: columns; the bias whole
        "gate.weight": ((rank * 3, rank * 3 + 3), (0, 8)), "up.weight": ((rank * 3, rank * 3 + 3), (0, 8)),
        "embed.weight": (vocab, (0, 8)),
    }  # fmt: skip
    assert len(reads) == len(ckpt)  # each read once


def test_wrong_checkpoint_shape_is_refused_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: list
) -> None:
    _as_rank(monkeypatch, 1, 2)
    block = _Block(2)
    bad = _handles(tmp_path, {"w": torch.zeros(8, 6)})["w"]
    with pytest.raises(ValueError, match=r"^o: checkpoint tensor has shape \(8, 6\), expected 8 input columns"):
        block.o.weight_loader(block.o.weight, bad)
    with pytest.raises(ValueError, match=r"^gate_up: checkpoint tensor has 8 output rows, expected 6"):
        block.gate_up.weight_loader(block.gate_up.weight, bad, "0")
    assert reads == []


# ---------------------------------------------------------------------- who gets handles


class _WholeLoaderLinear(Linear):
    """An out-of-tree subclass whose own weight_loader does tensor arithmetic."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | None = None) -> None:
        assert isinstance(loaded, torch.Tensor)
        param.data.copy_(loaded * 2)


class _OwnLoaderLlama(LlamaForCausalLM):
    """An out-of-tree subclass with its own load_weights: it gets whole tensors."""

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        return super().load_weights(weights)


def test_only_declared_loaders_get_handles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _WholeLoaderLinear(2, 2)
    assert not accepts_lazy_weights(layer, "weight_loader")
    assert accepts_lazy_weights(Linear(2, 2), "weight_loader")
    assert accepts_lazy_weights(VocabEmbedding(4, 2), "weight_loader")

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = layer

    load_checkpoint_weights(Holder(), _handles(tmp_path, {"p.weight": torch.ones(2, 2)}).items(), ())
    assert torch.equal(layer.weight, torch.full((2, 2), 2.0))

    config = make_test_engine_config(tiny_model_dir("llama"))
    with torch.device("cpu"):
        llama, own = LlamaForCausalLM(config), _OwnLoaderLlama(config)
    assert all(isinstance(t, LazyTensor) for _, t in model_weights(config, llama))
    assert all(isinstance(t, torch.Tensor) for _, t in model_weights(config, own))


def test_bin_files_give_whole_tensors(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(2, 3)}, tmp_path / "pytorch_model.bin")
    assert [(n, type(t)) for n, t in hf_dir_weights(tmp_path, "auto", lazy=True)] == [("a", torch.Tensor)]
