"""llama.cpp through llama-cpp-python's low-level API, for the CPU benchmarks of GGUF files.

The high-level ``llama_cpp.Llama`` decodes one sequence; this drives ``llama_decode`` with a
``llama_batch`` of many sequences (``n_seq_max`` of them, each its own KV cells), greedy,
so batch 16 and the 64-prompt workload run as llama.cpp runs them in its own batched tools.

``llama-cpp-python`` is a source package (it builds llama.cpp with cmake and a compiler):
``pip install llama-cpp-python`` outside CI; nothing here is imported by kvloom.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp  # an ImportError here tells the benchmarks llama.cpp is not installed
import numpy as np


@llama_cpp.llama_log_callback
def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's load and context logs, dropped (the benchmarks print their own lines)."""


class LlamaCppBatched:
    """One llama.cpp model and context holding up to ``n_seq_max`` sequences of ``seq_len``
    tokens each."""

    def __init__(self, path: str, threads: int, n_seq_max: int, seq_len: int, n_batch: int = 2048) -> None:
        self.lib: Any = llama_cpp
        llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_seq_max = n_seq_max
        params.n_ctx = n_seq_max * seq_len
        params.n_batch = params.n_ubatch = n_batch
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False  # each sequence its own cells, as kvloom's requests are
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context")
        self.n_batch = n_batch
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def _logits(self, index: int) -> np.ndarray:
        pointer = self.lib.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """Decode (token, position, sequence, wants logits) entries, ``n_batch`` at a time;
        the argmax of each entry that wants logits, in order."""
        argmaxes: list[int] = []
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start : start + self.n_batch]
            batch = self.batch
            batch.n_tokens = len(chunk)
            for i, (token, pos, seq, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, logits
            if self.lib.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (KV cells full?)")
            argmaxes += [int(np.argmax(self._logits(i))) for i, entry in enumerate(chunk) if entry[3]]
        return argmaxes

    def generate(self, prompts: list[list[int]], output_len: int) -> list[list[int]]:
        """Greedy: ``output_len`` new tokens for every prompt (EOS ignored)."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        prefill = [(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, t in enumerate(p)]
        outputs = [[token] for token in self._decode(prefill)]
        for step in range(1, output_len):
            entries = [(out[-1], len(p) + step - 1, seq, True) for seq, (p, out) in enumerate(zip(prompts, outputs))]
            for out, token in zip(outputs, self._decode(entries)):
                out.append(token)
        return outputs

    def top1_along(self, tokens: list[int]) -> list[int]:
        """Teacher-forced greedy choices: the argmax after each prefix ``tokens[:i + 1]``."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        return self._decode([(t, pos, 0, True) for pos, t in enumerate(tokens)])
