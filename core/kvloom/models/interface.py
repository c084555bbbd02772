"""The optional capabilities of a model class, and how the engine reads them.

Every model implements the model contract (``kvloom.interfaces.models``: ``forward``,
``compute_logits``, ``load_weights``). Beyond it, a model declares what else it can do with
class attributes; each capability is a ``Protocol`` here, so that a model author reads in
one place what to declare and a type checker can hold a model class to it:

- ``SupportsPP``: pipeline parallelism (``supports_pipeline_parallel = True``);
- ``SupportsTP``: tensor parallelism (``supports_tensor_parallel = True``);
- ``SupportsLoRA``: LoRA on merged projections (``packed_modules_mapping``);
- ``HasStackedParams``: merged projections loaded from HF's separate ones (``stacked_params``);
- ``SupportsLazyWeights``: ``load_weights`` takes lazy safetensors handles
  (``accepts_lazy_weights = True`` in the class that defines ``load_weights``);
- ``HasAttentionSinks``: the attention has learned sinks (``has_attention_sinks = True``,
  gpt-oss), which the attention backend must support.
- ``SupportsHiddenStateTaps``: copies chosen hidden states of each forward aside for a
  speculative draft model (EAGLE-3, MTP) to read (``hidden_state_taps`` on its inner model).

The engine never reads these attributes itself: it asks the helpers below
(``supports_pp(model_cls)``, ...), which take a model class or instance and give the
answer for a model that declares nothing (no capability, nothing merged). A model need not
subclass the protocols: declaring the attributes is enough (Llama, and every model built on
it, declares them all).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

from kvloom.loader.lazy_tensor import accepts_lazy_weights

if TYPE_CHECKING:
    import torch

    from kvloom.distributed.pipeline import IntermediateTensors
    from kvloom.loader.lazy_tensor import CheckpointTensor


class SupportsPP(Protocol):
    """A model that can be split into pipeline stages (``--pipeline-parallel-size`` > 1).

    On stage ``p`` of ``P`` it builds only its share of the decoder layers
    (``kvloom.distributed.pipeline.stage_layer_range``), the embedding on the first stage and
    the final norm and LM head on the last, and loads only their checkpoint tensors."""

    supports_pipeline_parallel: ClassVar[Literal[True]]
    """Declares the capability; the engine refuses ``pipeline_parallel_size`` > 1 without it."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """The stage's forward: ``intermediate_tensors`` is the previous stage's output (None
        on the first stage); every stage but the last returns ``IntermediateTensors``."""
        ...

    def checkpoint_tensor_elsewhere(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to another stage only (never read here)."""
        ...


class SupportsTP(Protocol):
    """A model whose layers split over tensor-parallel ranks (``--tensor-parallel-size`` > 1):
    heads, MLP columns and vocabulary, through kvloom's parallel ``Linear`` layers."""

    supports_tensor_parallel: ClassVar[Literal[True]]
    """Declares the capability; the engine refuses ``tensor_parallel_size`` > 1 without it."""


class SupportsLoRA(Protocol):
    """A model with merged projections that LoRA adapters (trained on HF's separate ones) can
    adapt slice by slice. A model without merged projections needs no declaration."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]]
    """Merged module -> the HF modules it holds, in shard order (``{"qkv_proj": ["q_proj",
    "k_proj", "v_proj"], ...}``; ``kvloom.interfaces.models.packed_modules_mapping`` builds it
    from ``stacked_params``)."""


class HasStackedParams(Protocol):
    """A model whose merged projections load from HF's separate checkpoint tensors."""

    stacked_params: ClassVar[tuple[tuple[str, str, str], ...]]
    """``(merged module, HF module, shard)`` triples (``LLAMA_STACKED_PARAMS``): the loader
    expands them to the HF names it expects and to count what was loaded."""


class SupportsLazyWeights(Protocol):
    """A model whose ``load_weights`` takes safetensors tensors as ``LazyTensor`` handles, so
    that each tensor-parallel rank reads only its slices (``kvloom.loader.lazy_tensor``)."""

    accepts_lazy_weights: ClassVar[Literal[True]]
    """Declares the capability, in the class body that defines ``load_weights`` (a subclass
    that overrides ``load_weights`` gets whole tensors unless it declares it again)."""

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Load HF-named tensors or handles (``materialize`` reads a handle); the names loaded."""
        ...


class HasAttentionSinks(Protocol):
    """A model whose attention layers have learned sinks (gpt-oss): one logit per query head
    in every softmax's denominator (``kvloom.attention.backend``). Selection then keeps only
    backends that declare ``supports_sinks``."""

    has_attention_sinks: ClassVar[Literal[True]]
    """Declares the capability; the attention backend must support sinks."""


def has_attention_sinks(model: object) -> bool:
    """Whether ``model`` (a model class or instance) declares ``HasAttentionSinks``."""
    return bool(getattr(model, "has_attention_sinks", False))


class HiddenStateTaps:
    """Copies of chosen hidden states of a model's forward, by HF's ``output_hidden_states``
    index (``i`` < num_hidden_layers: the residual stream entering layer ``i``, 0 the
    embeddings; ``num_hidden_layers``: the final normed output), written into one
    persistent buffer (``[max_num_tokens, len(indices), hidden_size]``) so that a CUDA graph
    replay writes them too. ``read(n)`` gives the last forward's first ``n`` tokens."""

    def __init__(self, indices: tuple[int, ...], max_num_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        import torch

        self.indices = indices
        self.slots = {index: slot for slot, index in enumerate(indices)}
        self.buffer = torch.zeros(max_num_tokens, len(indices), hidden_size, dtype=dtype, device=device)

    def record(self, index: int, hidden_states: torch.Tensor, residual: torch.Tensor | None) -> None:
        """The hidden state at ``index`` (``hidden_states + residual``: the stream as HF has it)."""
        slot = self.slots.get(index)
        if slot is not None:
            value = hidden_states if residual is None else hidden_states + residual
            self.buffer[: value.shape[0], slot].copy_(value)

    def read(self, num_tokens: int) -> torch.Tensor:
        """``[num_tokens, len(indices) * hidden_size]``: the taps of each token, concatenated."""
        return self.buffer[:num_tokens].flatten(1)


class SupportsHiddenStateTaps(Protocol):
    """A model whose inner model (``self.model``) records chosen hidden states of each forward
    into its ``hidden_taps`` (a ``HiddenStateTaps``, None until a draft model asks)."""

    supports_hidden_state_taps: ClassVar[Literal[True]]
    """Declares the capability; EAGLE-3 and MTP drafts need it of the target."""


def supports_hidden_state_taps(model: object) -> bool:
    """Whether ``model`` (a model class or instance) declares ``SupportsHiddenStateTaps``."""
    return bool(getattr(model, "supports_hidden_state_taps", False))


def enable_hidden_state_taps(model: object, indices: tuple[int, ...], max_num_tokens: int) -> HiddenStateTaps:
    """Make ``model`` (a loaded model instance) record the hidden states ``indices`` of every
    forward from now on; the ``HiddenStateTaps`` to read them from."""
    inner = getattr(model, "model", None)
    if not supports_hidden_state_taps(model) or inner is None or not hasattr(inner, "hidden_taps"):
        raise ValueError(f"model {type(model).__name__} does not expose its hidden states "
                         "(supports_hidden_state_taps); a draft model that reads them cannot run on it")  # fmt: skip
    num_layers = len(inner.layers)
    if any(not 0 <= i <= num_layers for i in indices):
        raise ValueError(f"hidden-state indices {indices} out of range for {num_layers} layers (0..{num_layers})")
    weight = next(p for p in model.parameters() if p.is_floating_point())  # type: ignore[attr-defined]
    hidden_size = model.config.model.hidden_size  # type: ignore[attr-defined]
    inner.hidden_taps = HiddenStateTaps(indices, max_num_tokens, hidden_size, weight.dtype, weight.device)
    return inner.hidden_taps


def supports_pp(model: object) -> bool:
    """Whether ``model`` (a model class or instance) declares ``SupportsPP``."""
    return bool(getattr(model, "supports_pipeline_parallel", False))


def supports_tp(model: object) -> bool:
    """Whether ``model`` (a model class or instance) declares ``SupportsTP``."""
    return bool(getattr(model, "supports_tensor_parallel", False))


def supports_lazy_weights(model: object) -> bool:
    """Whether ``model``'s ``load_weights`` takes ``LazyTensor`` handles (``SupportsLazyWeights``,
    declared by the class that defines ``load_weights``)."""
    return accepts_lazy_weights(model, "load_weights")


def get_packed_modules_mapping(model: object) -> dict[str, list[str]]:
    """``model``'s ``SupportsLoRA.packed_modules_mapping`` (a copy), or ``{}`` (nothing merged)."""
    return dict(getattr(model, "packed_modules_mapping", {}) or {})


def get_stacked_params(model: object) -> Sequence[tuple[str, str, str]]:
    """``model``'s ``HasStackedParams.stacked_params``, or ``()`` (nothing merged)."""
    return getattr(model, "stacked_params", ())


def get_checkpoint_tensor_filter(model: object) -> Callable[[str], bool] | None:
    """``model``'s ``SupportsPP.checkpoint_tensor_elsewhere`` (the checkpoint tensors its
    pipeline stage skips), or None: it reads every tensor."""
    return getattr(model, "checkpoint_tensor_elsewhere", None)
