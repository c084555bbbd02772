"""MLA cases of the conformance suite: an MLA backend's kernels
(``kvloom.attention.mla_backend.MLAAttentionImpl``) against a float64 reference on fresh random
data, with DeepSeek-V2/V3's dims (16 heads, ``kv_lora_rank`` 512, rope 64, nope 128,
v 128; MLA kernels are often built for exactly these).

Scenarios (each at every declared dtype; the decode ones at every declared block size):

- ``mla_decode``: the step's latent rows are written through ``write_latent`` (with
  ``-1`` padding rows that must not be written; the whole cache is compared exactly
  afterwards), then ``forward_decode`` attends each request's absorbed query over its
  paged latent rows (shuffled physical blocks, contexts of many blocks ending anywhere,
  block-table entries past the last block holding other valid ids, unwritten slots
  holding large random values).
- ``mla_long_decode``: decodes over contexts of thousands of tokens (split-KV paths).
- ``mla_prefill``: causal varlen attention of prompts without context.
- ``mla_chunked_prefill``: chunks over a cached prefix (``seq_len > query_len``:
  bottom-right causal), with a softmax scale that is not ``1/sqrt(head_size)``.

Backends that declare only one phase run only that phase's scenarios.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch

from kvloom.attention.backend import (
    AttentionBackend,
    AttentionLayerSpec,
    AttentionSelectorConfig,
    AttentionType,
    CommonAttentionMetadata,
    dtype_name,
)
from kvloom.attention.mla_backend import MLA_DECODE, MLA_PREFILL, MLADims
from kvloom.testing.conformance.outcome import Outcome
from kvloom.testing.reference import attend, relative_error
from kvloom.utils import cdiv

#: scenario -> (phase, what it exercises)
MLA_SCENARIOS: dict[str, tuple[str, str]] = {
    "mla_decode": (MLA_DECODE, "latent-cache write (with -1 padding) and absorbed decode over paged latent rows"),
    "mla_long_decode": (MLA_DECODE, "decode over contexts of thousands of tokens (split-KV paths)"),
    "mla_prefill": (MLA_PREFILL, "causal varlen prefill, qk head 192, v head 128"),
    "mla_chunked_prefill": (MLA_PREFILL, "prefill chunks over a cached prefix (bottom-right causal)"),
}

#: DeepSeek-V2/V3's MLA dims.
DEEPSEEK_DIMS = MLADims(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


@dataclass(frozen=True)
class MLAConformanceCase:
    """One MLA scenario at one dtype and block size."""

    scenario: str
    dtype: torch.dtype
    block_size: int
    dims: MLADims = DEEPSEEK_DIMS
    #: Softmax scale as a multiple of 1/sqrt(qk_nope + qk_rope) (DeepSeek's base scale).
    scale_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scenario not in MLA_SCENARIOS:
            raise ValueError(f"scenario {self.scenario!r} unknown (known: {', '.join(MLA_SCENARIOS)})")

    @property
    def phase(self) -> str:
        return MLA_SCENARIOS[self.scenario][0]

    @property
    def scale(self) -> float:
        return self.scale_factor / math.sqrt(self.dims.qk_head_dim)

    @property
    def head_size(self) -> int:
        """The phase's head size as selection sees it."""
        return self.dims.latent_size if self.phase == MLA_DECODE else self.dims.qk_head_dim

    @property
    def name(self) -> str:
        d = self.dims
        return (
            f"{self.scenario}[{dtype_name(self.dtype)},h{d.num_heads},L{d.kv_lora_rank}+R{d.qk_rope_head_dim},"
            f"bs{self.block_size}]"
        )

    @property
    def params(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "dtype": dtype_name(self.dtype), "block_size": self.block_size,
                "scale": self.scale, **self.dims.to_extra(), "num_heads": self.dims.num_heads}  # fmt: skip

    def selector_config(self, device_type: str, capability: Any) -> AttentionSelectorConfig:
        decode = self.phase == MLA_DECODE
        return AttentionSelectorConfig(
            head_size=self.head_size, dtype=self.dtype, kv_cache_dtype="auto",
            block_size=self.block_size if decode else None, use_mla=True, mla_phase=self.phase,
            v_head_dim=None if decode else self.dims.v_head_dim, attn_type=AttentionType.DECODER,
            device_type=device_type, device_capability=capability, num_heads=self.dims.num_heads,
            num_kv_heads=1 if decode else self.dims.num_heads,
        )  # fmt: skip

    def __str__(self) -> str:
        return self.name


def mla_conformance_cases(
    backend: type[AttentionBackend], block_sizes: list[int], quick: bool = False
) -> list[MLAConformanceCase]:
    """Every phase the backend declares: each scenario at every dtype; the decode
    scenario also at every one of ``block_sizes`` (what ``conformance_cases`` derives from
    the declarations). Quick: the first dtype, the preferred block size and the largest."""
    phases = getattr(backend, "mla_phases", (MLA_DECODE, MLA_PREFILL))
    dtypes = list(backend.supported_dtypes)[:1] if quick else list(backend.supported_dtypes)
    base = backend.preferred_block_size()
    blocks = list(block_sizes)
    if quick:
        blocks = list(dict.fromkeys([base, max(blocks)]))
    cases: list[MLAConformanceCase] = []
    for dtype in dtypes:
        for scenario, (phase, _) in MLA_SCENARIOS.items():
            if phase not in phases:
                continue
            factor = 1.3 if scenario == "mla_chunked_prefill" else 1.0
            cases.append(MLAConformanceCase(scenario, dtype, base, scale_factor=factor))
        if MLA_DECODE in phases:
            cases += [MLAConformanceCase("mla_decode", dtype, b) for b in blocks if b != base]
    return list(dict.fromkeys(cases))


# ---------------------------------------------------------------------- running a case


def _common(
    query_lens: list[int], seq_lens: list[int], block_table: torch.Tensor, slot_mapping: torch.Tensor,
    device: torch.device,
) -> CommonAttentionMetadata:  # fmt: skip
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=qsl.to(device), seq_lens=sl.to(device), block_table=block_table.to(device),
        slot_mapping=slot_mapping.to(device), num_reqs=len(query_lens), num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=sl,
    )  # fmt: skip


def _spec(case: MLAConformanceCase, max_num_seqs: int, max_model_len: int) -> AttentionLayerSpec:
    d = case.dims
    decode = case.phase == MLA_DECODE
    return AttentionLayerSpec(
        num_heads=d.num_heads, num_kv_heads=1 if decode else d.num_heads, head_size=case.head_size,
        dtype=case.dtype, kv_cache_dtype=case.dtype, block_size=case.block_size, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len, scale=case.scale, extra={**d.to_extra(), "mla_phase": case.phase},
    )  # fmt: skip


def _run_decode(backend: type[AttentionBackend], case: MLAConformanceCase, device: torch.device,
                rng: random.Random, gen: torch.Generator) -> Outcome:  # fmt: skip
    d, bs = case.dims, case.block_size
    width = d.latent_size
    if case.scenario == "mla_long_decode":
        seq_lens = [rng.randint(1500, 2500), rng.randint(3000, 4500), rng.randint(2, 40)]
    else:
        unit = max(bs, 16)
        seq_lens = [rng.randint(2, 6 * unit) for _ in range(10)] + [1, bs * rng.randint(1, 3)]
        rng.shuffle(seq_lens)
    needed = [cdiv(s, bs) for s in seq_lens]
    num_blocks = sum(needed) + 3
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    max_blocks = max(needed) + 1
    block_table = torch.empty(len(seq_lens), max_blocks, dtype=torch.int32)
    owned: list[list[int]] = []
    for i, n in enumerate(needed):
        blocks, physical = physical[:n], physical[n:]
        owned.append(blocks)
        # Past the last block: other valid block ids (a backend must not read them).
        block_table[i] = torch.tensor(blocks + [rng.randrange(num_blocks) for _ in range(max_blocks - n)])
    slots = [owned[i][(s - 1) // bs] * bs + (s - 1) % bs for i, s in enumerate(seq_lens)]

    shape = backend.get_kv_cache_shape(num_blocks, bs, 1, width)
    # Unwritten slots hold large values, so a read past a sequence shows.
    cache_cpu = (torch.randn(shape, generator=gen) * 100).to(case.dtype)
    flat = cache_cpu.view(-1, width)
    for i, s in enumerate(seq_lens):  # the context, as earlier steps left it
        for pos in range(s - 1):
            flat[owned[i][pos // bs] * bs + pos % bs] = torch.randn(width, generator=gen).to(case.dtype)
    cache = cache_cpu.to(device)

    b, padding = len(seq_lens), 3
    kv_c = torch.randn(b + padding, d.kv_lora_rank, generator=gen).to(case.dtype)
    k_pe = torch.randn(b + padding, d.qk_rope_head_dim, generator=gen).to(case.dtype)
    slot_mapping = torch.tensor(slots + [-1] * padding, dtype=torch.int64)
    expected = cache_cpu.clone()
    expected.view(-1, width)[torch.tensor(slots)] = torch.cat([kv_c[:b], k_pe[:b]], dim=-1)

    impl = backend.get_impl_cls()(d, case.scale, "auto")  # type: ignore[call-arg]
    builder = backend.get_builder_cls()(_spec(case, b, max(seq_lens)), device, max_blocks)
    outcome = Outcome()
    impl.write_latent(kv_c.to(device), k_pe.to(device), cache, slot_mapping.to(device))
    written = cache.cpu()
    if not torch.equal(written, expected):
        wrong = (written != expected).view(-1, width).any(-1).nonzero().flatten().tolist()
        outcome.problems.append(f"latent cache differs from the expected write at slots {wrong[:8]}")
    common = _common([1] * b, seq_lens, block_table, slot_mapping[:b], device)
    md = builder.build(common)
    q = torch.randn(b, d.num_heads, width, generator=gen).to(case.dtype)
    out = torch.full((b, d.num_heads, d.kv_lora_rank), float("nan"), dtype=case.dtype, device=device)
    impl.forward_decode(q.to(device), cache, md, out)
    out_cpu = out.cpu()
    rows = expected.view(-1, width)
    for i, s in enumerate(seq_lens):
        pos = torch.arange(s)
        keys = rows[torch.tensor(owned[i])[pos // bs] * bs + pos % bs].unsqueeze(1)  # [S, 1, L + R]
        ref = attend(q[i : i + 1], keys, keys[..., : d.kv_lora_rank], case.scale)[0]
        err = relative_error(out_cpu[i], ref)
        if not err <= outcome.worst:
            outcome.worst, outcome.worst_where = err, f"request {i} (seq_len {s})"
    return outcome


def _run_prefill(backend: type[AttentionBackend], case: MLAConformanceCase, device: torch.device,
                 rng: random.Random, gen: torch.Generator) -> Outcome:  # fmt: skip
    d = case.dims
    if case.scenario == "mla_chunked_prefill":
        shapes = [(rng.randint(16, 200), rng.randint(2, 64)) for _ in range(4)] + [(rng.randint(1, 8), 1)]
    else:
        shapes = [(0, rng.randint(2, 200)) for _ in range(4)] + [(0, 1)]
    rng.shuffle(shapes)
    query_lens = [q for _, q in shapes]
    seq_lens = [c + q for c, q in shapes]
    nq, nk = sum(query_lens), sum(seq_lens)
    q = torch.randn(nq, d.num_heads, d.qk_head_dim, generator=gen).to(case.dtype)
    k = torch.randn(nk, d.num_heads, d.qk_head_dim, generator=gen).to(case.dtype)
    v = torch.randn(nk, d.num_heads, d.v_head_dim, generator=gen).to(case.dtype)
    bs = case.block_size
    max_blocks = cdiv(max(seq_lens), bs)
    block_table = torch.arange(len(shapes) * max_blocks, dtype=torch.int32).view(len(shapes), max_blocks)
    common = _common(query_lens, seq_lens, block_table, torch.full((nq,), -1, dtype=torch.int64), device)
    builder = backend.get_builder_cls()(_spec(case, len(shapes), max(seq_lens)), device, max_blocks)
    impl = backend.get_impl_cls()(d, case.scale, "auto")  # type: ignore[call-arg]
    out = torch.full((nq, d.num_heads, d.v_head_dim), float("nan"), dtype=case.dtype, device=device)
    impl.forward_prefill(q.to(device), k.to(device), v.to(device), builder.build(common), out)
    out_cpu = out.cpu()
    outcome = Outcome()
    q0 = k0 = 0
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        ref = attend(q[q0 : q0 + ql], k[k0 : k0 + sl], v[k0 : k0 + sl], case.scale)
        err = relative_error(out_cpu[q0 : q0 + ql], ref)
        if not err <= outcome.worst:
            outcome.worst, outcome.worst_where = err, f"request {i} (context {sl - ql}, query {ql})"
        q0, k0 = q0 + ql, k0 + sl
    return outcome


def run_mla_case(backend: type[AttentionBackend], case: MLAConformanceCase, device: torch.device, seed: int) -> Outcome:
    """Run one MLA case with data drawn from ``seed``; backend errors propagate."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    if case.phase == MLA_DECODE:
        return _run_decode(backend, case, device, rng, gen)
    return _run_prefill(backend, case, device, rng, gen)
