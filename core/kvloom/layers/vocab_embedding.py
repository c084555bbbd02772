"""Token embedding and LM head (which may share the embedding's weight).

Vocab-parallel (``parallel=True`` at a tensor-parallel size above 1): each rank keeps
``ceil(vocab / tp)`` rows, the vocabulary ids ``[vocab_start, vocab_end)`` (the last rank's
tail is zero padding). The embedding looks up the ids it holds, zeroes the others and sums
over the ranks (one all-reduce); the LM head computes its slice of the logits and
all-gathers them (every rank gets the whole ``[M, vocab]``: every rank's sampler then
draws the same tokens, and the driver's are the ones returned). At world size 1 both are
the plain lookup and GEMM.

Quantization: built while the model loader quantizes the model, each asks the method for
its ``EmbeddingQuantMethod`` (kinds ``embedding`` and ``lm_head``; ``quant_method``, None
when unquantized), which creates the table's parameters and computes the lookup and the
logits. A head tied to a quantized embedding shares all of its parameters and its method.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvloom.distributed import parallel_state
from kvloom.loader.lazy_tensor import CheckpointTensor, materialize
from kvloom.quantization.context import layer_quant_method
from kvloom.quantization.layer_methods import EmbeddingQuantMethod, Span, load_region
from kvloom.quantization.method import LayerKind
from kvloom.utils import cdiv


class VocabEmbedding(nn.Module):
    """``input_ids [N] -> [N, embedding_dim]``; weight ``[num_embeddings, embedding_dim]``
    (``[ceil(num_embeddings / tp), embedding_dim]`` on each rank when vocab-parallel)."""

    accepts_lazy_weights = True
    """``weight_loader`` takes ``LazyTensor`` handles and reads only this rank's rows."""

    layer_kind = LayerKind.EMBEDDING
    """The kind a quantization method sees this layer as."""

    def __init__(self, num_embeddings: int, embedding_dim: int, prefix: str = "", parallel: bool = False) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.tp_size = parallel_state.tp_world_size() if parallel else 1
        self.tp_rank = parallel_state.tp_rank() if parallel else 0
        self.rows = cdiv(num_embeddings, self.tp_size)
        self.vocab_start = self.tp_rank * self.rows
        self.vocab_end = min(num_embeddings, self.vocab_start + self.rows)
        self.params_dtype = torch.get_default_dtype()
        self.quant_method: EmbeddingQuantMethod | None = layer_quant_method(  # type: ignore[assignment]
            self.layer_kind, prefix, input_size=embedding_dim, output_sizes=(num_embeddings,), tp_size=self.tp_size
        )
        if self.quant_method is None:
            self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim), requires_grad=False)
        else:
            self.quant_method.create_weights(self)

    def load_by_layout(self, name: str, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None) -> None:
        """Copy this rank's vocabulary rows of a checkpoint tensor into the quantized
        parameter ``name`` by its ``ParamLayout`` (the last rank's padding rows zeroed)."""
        layout = self.quant_layouts[name]
        what = f"{self.prefix}.{name}"
        if layout.output_dim is None or self.tp_size == 1:
            load_region(param.data, loaded, layout, None, None, what)
            return
        count = self.vocab_end - self.vocab_start
        param.data.zero_()
        load_region(param.data, loaded, layout, Span(self.vocab_start, count, 0), None, what)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard: str | None = None) -> None:
        """Copy this rank's rows of a checkpoint tensor into ``param`` (the checkpoint's
        shape must be ``[num_embeddings, embedding_dim]``; ``shard`` is unused); of a lazy
        handle only those rows are read. A quantized table's parameters go to its method
        (``EmbeddingQuantMethod.load_weight``)."""
        if self.quant_method is not None:
            name = next(n for n, p in self._parameters.items() if p is param)
            self.quant_method.load_weight(self, name, param, loaded, shard)
            return
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"{self.prefix}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                f"expected {(self.num_embeddings, self.embedding_dim)}"
            )
        if self.tp_size == 1:
            param.data.copy_(materialize(loaded))
            return
        count = self.vocab_end - self.vocab_start
        param.data[:count].copy_(materialize(loaded.narrow(0, self.vocab_start, count)))
        param.data[count:].zero_()

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is None:
            return F.embedding(ids, self.weight)
        return self.quant_method.embedding(self, ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        held = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(held, input_ids - self.vocab_start, torch.zeros_like(input_ids))
        out = self._lookup(local_ids)
        out = out * held.unsqueeze(-1).to(out.dtype)
        return parallel_state.all_reduce(out)

    def extra_repr(self) -> str:
        tp = "" if self.tp_size == 1 else f", vocab [{self.vocab_start}, {self.vocab_end}) of rank {self.tp_rank}"
        return f"{self.num_embeddings}, {self.embedding_dim}{tp}"


class LMHead(VocabEmbedding):
    """Projects hidden states to vocabulary logits.

    ``tie_to(embedding)`` makes this head use the embedding's weight (the same
    Parameter, so it is loaded once and moved once); a quantized embedding's parameters
    and method, all of them (``tied_to`` then names the embedding).
    """

    layer_kind = LayerKind.LM_HEAD
    """The kind a quantization method sees this layer as."""

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Use ``embedding``'s weight (the same Parameter) as this head's; of a quantized
        embedding, every parameter and its method (called again after the embedding's
        parameters are processed: ``kvloom.quantization.context.process_weights_after_loading``)."""
        if (embedding.num_embeddings, embedding.embedding_dim, embedding.tp_size) != (
            self.num_embeddings, self.embedding_dim, self.tp_size,
        ):  # fmt: skip
            raise ValueError(f"{self.prefix}: cannot tie to an embedding of another shape")
        for name in list(self._parameters):
            del self._parameters[name]
        for name, param in embedding._parameters.items():
            self.register_parameter(name, param)
        self.quant_method = embedding.quant_method
        if embedding.quant_method is not None:
            self.__dict__["quant_layouts"] = embedding.quant_layouts
            self.__dict__["tied_to"] = embedding  # not a submodule: the embedding belongs to the model

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``[M, embedding_dim] -> [M, num_embeddings]`` in the model dtype, as HF's
        ``lm_head`` gives them. No float32 copy here: the sampler computes in float32
        where it needs to, and its fast paths (argmax, ``random_sample``) read the logits
        as they are; at batch 256 and a 152k vocabulary the copy is a ~0.1 ms pass per step.
        """
        if self.quant_method is None:
            logits = F.linear(hidden_states, self.weight)
        else:
            logits = self.quant_method.apply(self, hidden_states)
        if self.tp_size == 1:
            return logits
        return parallel_state.all_gather(logits, dim=-1)[:, : self.num_embeddings]
