"""The compilation backend kvloom passes to ``torch.compile`` (``backend=``).

Dynamo hands it the FX graph of the model's forward (input ids and positions dynamic on
the token dimension, so one graph serves every batch size). The backend

1. splits the graph at every call of a *splitting op* (``CompilationConfig.splitting_ops``:
   ``kvloom::unified_attention`` plus the ops the attention backend declares graph-unsafe),
   each such call alone in its own piece, which runs eagerly;
2. compiles every piece in between with Inductor (``use_inductor``), or leaves it as a
   plain FX module (``-O1``-style debugging without Inductor);
3. wraps each compiled piece with ``wrap_piece`` (the model runner passes the piecewise
   ``CUDAGraphWrapper`` on CUDA), and returns the split module, which runs the pieces in
   order.

Compiling a piece needs example inputs of the piece's own shapes (symbolic in the token
count): the split module is interpreted once under Dynamo's fake-tensor mode, and each
piece is compiled with the fake tensors that reach it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch._guards import detect_fake_mode
from torch.fx.passes.split_module import split_module

logger = logging.getLogger(__name__)

#: ``wrap_piece(runnable, index, num_pieces) -> runnable``: e.g. a CUDA-graph wrapper.
PieceWrapper = Callable[[Callable[..., Any], int, int], Callable[..., Any]]


def op_name(target: Any) -> str | None:
    """``namespace::name`` of a custom-op call target (an op overload or its packet)."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


@dataclass
class SplitGraph:
    """A graph split at its splitting ops: ``module`` runs the pieces in order;
    ``pieces`` names its compiled submodules, ``splitting`` those holding one splitting op."""

    module: fx.GraphModule
    pieces: list[str]
    splitting: list[str]


def split_graph(gm: fx.GraphModule, splitting_ops: Sequence[str]) -> SplitGraph:
    """Split ``gm`` so each call of an op in ``splitting_ops`` is a piece of its own."""
    ops = set(splitting_ops)
    partition_of: dict[fx.Node, int] = {}
    splitting_ids: set[int] = set()
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and op_name(node.target) in ops:
            current += 1
            partition_of[node] = current
            splitting_ids.add(current)
            current += 1
        else:
            partition_of[node] = current
    split = split_module(gm, None, lambda node: partition_of[node], keep_original_order=True)
    pieces, splitting = [], []
    for node in split.graph.nodes:
        if node.op == "call_module":
            index = int(node.target.removeprefix("submod_"))
            (splitting if index in splitting_ids else pieces).append(node.target)
    return SplitGraph(split, pieces, splitting)


class _Piece(nn.Module):
    """A compiled piece in the split module's place of its FX submodule (``source``)."""

    def __init__(self, runnable: Callable[..., Any], source: fx.GraphModule) -> None:
        super().__init__()
        self.runnable = runnable
        self.source = source

    def forward(self, *args: Any) -> Any:
        return self.runnable(*args)


@dataclass
class CompileStats:
    """What the backend did: graphs compiled (one per Dynamo compile; a recompile is
    another), pieces compiled, and seconds spent in the backend."""

    graphs: int = 0
    pieces: int = 0
    seconds: float = 0.0
    piece_counts: list[int] = field(default_factory=list)


class PiecewiseBackend:
    """The callable passed as ``torch.compile(..., backend=)`` (see the module docstring)."""

    def __init__(
        self, splitting_ops: Sequence[str], use_inductor: bool, wrap_piece: PieceWrapper | None = None
    ) -> None:
        self.splitting_ops = list(splitting_ops)
        self.use_inductor = use_inductor
        self.wrap_piece = wrap_piece
        self.stats = CompileStats()
        #: The split module of the latest compile (tests look at its pieces).
        self.last_split: SplitGraph | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        split = split_graph(gm, self.splitting_ops)
        compiled: dict[str, Callable[..., Any]] = {}
        fake_mode = detect_fake_mode()  # Dynamo's, whose fake inputs carry the symbolic sizes
        if fake_mode is None:
            raise RuntimeError("kvloom's compilation backend must be called by torch.compile (no fake mode active)")
        fake_inputs = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        with fake_mode:
            _CompilePieces(split.module, set(split.pieces), self._compile_piece, compiled).run(*fake_inputs)
        for i, name in enumerate(split.pieces):
            runnable = compiled[name]
            if self.wrap_piece is not None:
                runnable = self.wrap_piece(runnable, i, len(split.pieces))
            setattr(split.module, name, _Piece(runnable, split.module.get_submodule(name)))
        elapsed = time.perf_counter() - start
        self.stats.graphs += 1
        self.stats.pieces += len(split.pieces)
        self.stats.seconds += elapsed
        self.stats.piece_counts.append(len(split.pieces))
        self.last_split = split
        logger.info(
            "Compiled graph %d: %d pieces around %d splitting-op calls (%s) in %.1f s",
            self.stats.graphs,
            len(split.pieces),
            len(split.splitting),
            "Inductor" if self.use_inductor else "FX, no Inductor",
            elapsed,
        )
        return split.module

    def _compile_piece(self, piece: fx.GraphModule, args: Sequence[Any]) -> Callable[..., Any]:
        if not self.use_inductor:
            return piece
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(piece, list(args))


class _CompilePieces(fx.Interpreter):
    """Runs the split module on fake inputs; compiles each piece with the inputs it gets."""

    def __init__(
        self,
        module: fx.GraphModule,
        pieces: set[str],
        compile_piece: Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]],
        out: dict[str, Callable[..., Any]],
    ) -> None:
        super().__init__(module)
        self.pieces = pieces
        self.compile_piece = compile_piece
        self.out = out

    def call_module(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = super().call_module(target, args, kwargs)
        if target in self.pieces:
            assert not kwargs
            self.out[target] = self.compile_piece(self.fetch_attr(target), args)
        return result
