"""Checkpoint tensors that are read only when, and as far as, a weight loader asks.

Under tensor parallelism a rank keeps a slice of most weights (rows of a column-parallel
projection, columns of a row-parallel one, rows of the vocabulary, the intermediate range
of every expert). The safetensors loader therefore hands models ``LazyTensor`` handles
instead of tensors: a handle knows its checkpoint shape, ``narrow`` returns a smaller
handle without reading anything, and ``materialize`` reads the bytes of the narrowed
region only (safetensors' ``get_slice``).

The contract of a weight loader that accepts handles (``accepts_lazy_weights = True`` in
the body of the class that defines the module's ``weight_loader``, or the model's
``load_weights``; see ``accepts_lazy_weights``): the object it receives is a
``torch.Tensor`` *or* a ``LazyTensor`` (``CheckpointTensor``); it may read ``shape`` and
``dim()``, call ``narrow(dim, start, length)`` (both types have it, with torch's
semantics; a handle refuses a negative ``start``, which a loader has no use for), and
calls ``materialize(x)`` on what it finally copies (the identity for a tensor). Anything else (arithmetic, ``permute``, indexing) needs ``materialize`` first.
"""

from __future__ import annotations

from typing import Protocol

import torch


class SliceSource(Protocol):
    """What a ``LazyTensor`` reads from: safetensors' ``PySafeSlice`` (``get_slice``)."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


class LazyTensor:
    """A (narrowed) region of one checkpoint tensor, not read yet: ``shape``, ``dim()``,
    ``narrow(dim, start, length)`` as a tensor has them, and ``materialize()`` to read it.
    The safetensors loader makes them (``kvloom.loader.weight_utils``)."""

    name: str
    """The checkpoint name of the tensor (for errors)."""
    origin: str
    """The file it is read from (for errors; may be empty)."""
    shape: torch.Size
    """The shape of this region (the checkpoint tensor's until narrowed)."""

    def __init__(
        self,
        name: str,
        source: SliceSource,
        origin: str = "",
        _region: tuple[tuple[int, ...], torch.Size] | None = None,
    ) -> None:
        self.name = name
        self.origin = origin
        self._source = source
        if _region is None:
            self.shape = torch.Size(source.get_shape())
            self._offsets: tuple[int, ...] = (0,) * len(self.shape)
        else:
            self._offsets, self.shape = _region

    @property
    def region(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` per dimension: the part of the checkpoint tensor this handle reads."""
        return tuple((o, o + n) for o, n in zip(self._offsets, self.shape))

    def dim(self) -> int:
        """The number of dimensions, as ``torch.Tensor.dim``."""
        return len(self.shape)

    @property
    def ndim(self) -> int:
        """The number of dimensions, as ``torch.Tensor.ndim``."""
        return len(self.shape)

    def numel(self) -> int:
        """The number of elements of this region (what ``materialize`` reads)."""
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        """The handle of ``length`` entries from ``start`` along ``dim`` (a negative ``dim``
        counts from the end, as in torch; ``start`` is in ``[0, size]``); nothing is read. A
        range outside the tensor is a ``ValueError`` naming the tensor, the argument and its
        allowed range."""
        ndim = len(self.shape)
        if ndim == 0:
            raise ValueError(f"{self.name}: a 0-dim checkpoint tensor cannot be narrowed")
        if not -ndim <= dim < ndim:
            raise ValueError(
                f"{self.name}: narrow dim {dim} is outside [{-ndim}, {ndim - 1}] (shape {tuple(self.shape)})"
            )
        dim %= ndim
        size = self.shape[dim]
        if not 0 <= start <= size:
            raise ValueError(f"{self.name}: narrow start {start} along dim {dim} is outside [0, {size}] "
                             f"(shape {tuple(self.shape)})")  # fmt: skip
        if not 0 <= length <= size - start:
            raise ValueError(f"{self.name}: narrow length {length} from {start} along dim {dim} is outside "
                             f"[0, {size - start}] (shape {tuple(self.shape)})")  # fmt: skip
        offsets = list(self._offsets)
        offsets[dim] += start
        shape = list(self.shape)
        shape[dim] = length
        return LazyTensor(self.name, self._source, self.origin, (tuple(offsets), torch.Size(shape)))

    def materialize(self) -> torch.Tensor:
        """Read this region from the checkpoint: a CPU tensor of ``shape`` in the
        checkpoint's dtype (it may be a view of the memory-mapped file: copy it into the
        parameter, do not keep it)."""
        index = tuple(slice(start, stop) for start, stop in self.region)
        try:
            tensor = self._source[index] if index else self._source[...]  # type: ignore[index]
        except Exception as exc:  # the source's own error type (SafetensorError, OSError)
            where = f" in {self.origin}" if self.origin else ""
            raise ValueError(f"weights: cannot read {self.name}{where} {list(index)}: {exc}") from exc
        if tensor.shape != self.shape:
            raise ValueError(f"weights: reading {self.name} gave shape {tuple(tensor.shape)}, expected "
                             f"{tuple(self.shape)}")  # fmt: skip
        return tensor

    def __repr__(self) -> str:
        region = ", ".join(f"{start}:{stop}" for start, stop in self.region)
        return f"LazyTensor({self.name!r}, [{region}])"


CheckpointTensor = torch.Tensor | LazyTensor
"""What a weight loader that accepts lazy weights receives: a tensor or a ``LazyTensor``."""


def materialize(x: CheckpointTensor) -> torch.Tensor:
    """``x`` read (a ``LazyTensor``) or itself (a tensor)."""
    return x.materialize() if isinstance(x, LazyTensor) else x


def accepts_lazy_weights(obj: object, method: str) -> bool:
    """Whether ``obj``'s ``method`` (``"weight_loader"`` of a module, ``"load_weights"`` of a
    model; ``obj`` an instance or its class) takes ``LazyTensor`` handles: the class that defines the method in effect sets
    ``accepts_lazy_weights = True`` in its own body. A subclass that overrides the method
    (an out-of-tree model deriving from ``LlamaForCausalLM`` with its own ``load_weights``)
    thus gets whole tensors unless it declares the attribute itself."""
    for cls in (obj if isinstance(obj, type) else type(obj)).__mro__:
        if method in vars(cls):
            return vars(cls).get("accepts_lazy_weights", False) is True
    return False
