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

The split module calls each piece's runnable and each splitting submodule's ``forward``
as plain functions (``call_function`` nodes), not through ``nn.Module.__call__``: that
code runs on the host between two pieces on every layer of every step, where the
module-call machinery (hooks, ``GraphModule``'s call wrapper) is pure overhead. An
attention submodule (one ``kvloom::unified_attention`` call) becomes a direct call of the
op's Python implementation. The submodules stay attributes of the split module
(``SplitGraph.pieces``/``splitting`` name them) for inspection.

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

from kvloom.compilation.attention_op import UNIFIED_ATTENTION, unified_attention

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
    ``pieces`` names its compiled submodules, ``splitting`` those holding one splitting op,
    ``order`` all of them in the order ``module`` calls them."""

    module: fx.GraphModule
    pieces: list[str]
    splitting: list[str]
    order: list[str]


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
    pieces, splitting, order = [], [], []
    for node in split.graph.nodes:
        if node.op == "call_module":
            index = int(node.target.removeprefix("submod_"))
            (splitting if index in splitting_ids else pieces).append(node.target)
            order.append(node.target)
    return SplitGraph(split, pieces, splitting, order)


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
        _call_submodules_directly(split.module)
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

        from kvloom.compilation.inductor_passes import inductor_config_patches

        return compile_fx(piece, list(args), config_patches=inductor_config_patches())


def _as_function(runnable: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A plain function calling ``runnable`` (a module's ``forward``, bypassing
    ``nn.Module.__call__``): FX names a ``call_function`` target by its module and name,
    which a generated ``forward`` or a compiled piece does not have in importable form."""
    fn = runnable.forward if isinstance(runnable, nn.Module) else runnable

    def call(*args: Any) -> Any:
        return fn(*args)

    call.__name__ = call.__qualname__ = name  # the name in the generated code
    return call


def _direct_attention(sub: fx.GraphModule, name: str) -> Callable[..., Any] | None:
    """For a splitting submodule that is one ``kvloom::unified_attention`` call and returns
    nothing, a function calling the op's Python implementation with the submodule's
    arguments, skipping the torch dispatcher (~2 us a layer on the CPU; the op exists for
    Dynamo and the split, the eager call needs none of its dispatch). None otherwise."""
    calls = [n for n in sub.graph.nodes if n.op not in ("placeholder", "output")]
    (output,) = [n for n in sub.graph.nodes if n.op == "output"]
    if len(calls) != 1 or op_name(calls[0].target) != UNIFIED_ATTENTION or calls[0].kwargs or output.args != ((),):
        return None
    position = {n: i for i, n in enumerate(n for n in sub.graph.nodes if n.op == "placeholder")}
    *tensors, layer_name = calls[0].args
    if not isinstance(layer_name, str) or not all(t in position for t in tensors):
        return None
    q, k, v, out = (position[t] for t in tensors)

    def call(*args: Any) -> tuple[()]:
        unified_attention(args[q], args[k], args[v], args[out], layer_name)
        return ()

    call.__name__ = call.__qualname__ = name
    return call


def _call_submodules_directly(module: fx.GraphModule) -> None:
    """Turn every ``call_module`` node of the split module into a ``call_function`` of the
    piece's runnable (``_Piece``), the attention op's implementation (``_direct_attention``)
    or the submodule's ``forward`` (see the module docstring)."""
    graph = module.graph
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        sub = module.get_submodule(node.target)
        if isinstance(sub, _Piece):
            target = _as_function(sub.runnable, node.target)
        else:
            target = _direct_attention(sub, node.target) or _as_function(sub, node.target)
        with graph.inserting_before(node):
            call = graph.call_function(target, node.args, node.kwargs)
        call.meta = node.meta
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    module.recompile()


def compile_forward(
    forward: Callable[..., Any], backend: Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]
) -> Callable[..., Any]:
    """``torch.compile`` a model's ``forward`` through ``backend`` (a ``PiecewiseBackend``)
    as the model runner does: one compile serves every token count (``_keep_guards``)."""
    return torch.compile(forward, backend=backend, fullgraph=True, options={"guard_filter_fn": _keep_guards})


def _keep_guards(entries: Sequence[Any]) -> list[bool]:
    """Which of Dynamo's guards stay checked before each call of the compiled forward.

    Dropped: the guards on module attributes (5,458 for a 32-layer Llama: hooks, parameter
    identities and metadata; a kvloom model's modules do not change once loaded, weights
    are updated in place, and one compiled forward serves one model, as Dynamo keys its
    cache entries by backend and every model runner has its own) -- on the CPU this cuts
    Dynamo's entry from ~180 to ~35 us per forward (``benchmarks/bench_piecewise_cpu.py``);
    and the symbolic-size guard (``SHAPE_ENV``). Dynamo specialises sizes 0 and 1, so the
    graph compiled at the profile run's 16,384 tokens guards ``2 <= num_tokens`` and the
    first 1-token step compiled the whole model again (11.2 s of an H200's start-up).
    The graph holds no operation whose meaning changes at one token (no broadcasting over
    the token dimension), and the piecewise backend picks its pieces by size itself; vLLM
    drops every guard for the same reason. The guards on the inputs' dtypes, devices and
    ranks stay."""
    return [not (e.orig_guard.source.is_unspecialized_nn_module() or e.guard_type == "SHAPE_ENV") for e in entries]


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
