"""The core's MLA layer (``kvloom.attention.mla_layer.MLAAttention``) against a float64
reference of DeepSeek's attention written the plain way (every head's K and V
decompressed, no absorption), over two steps of a paged latent cache: fresh prefills,
then a shuffled mixed batch (a new prompt, a decode, a chunk over a cached prefix), so
the decode/prefill split, the absorbed weights, the prefix read back from the latent
cache and the row scatter are all checked."""

from __future__ import annotations

import math

import pytest
import torch

from kvloom.attention.backend import AttentionLayerSpec, CommonAttentionMetadata
from kvloom.attention.mla_backend import MLADims
from kvloom.attention.mla_layer import MLAAttention
from kvloom.attention.mla_metadata import MLAMetadataBuilder
from kvloom.forward_context import set_forward_context
from kvloom.layers.rotary import RotaryEmbedding, deepseek_softmax_scale

CPUMLABackend = pytest.importorskip("kvloom_backend_cpu.mla").CPUMLABackend

DIMS = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
HIDDEN, BLOCK = 48, 4


def _layer(q_lora_rank: int | None) -> MLAAttention:
    torch.manual_seed(0)
    layer = MLAAttention(
        hidden_size=HIDDEN, dims=DIMS, q_lora_rank=q_lora_rank, scale=0.7 / math.sqrt(DIMS.qk_head_dim),
        rms_norm_eps=1e-6, decode_backend=CPUMLABackend, prefill_backend=CPUMLABackend, rope_interleaved=True,
    )  # fmt: skip
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.copy_(1 + 0.1 * torch.randn_like(p))
    return layer


def _reference(layer: MLAAttention, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """float64 causal attention of one whole sequence ``hidden [S, HIDDEN]`` -> ``[S, HIDDEN]``."""
    d, s = DIMS, hidden.shape[0]
    w = {n: p.detach().double() for n, p in layer.named_parameters()}
    x = hidden.double()

    def rms(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    if layer.q_lora_rank is None:
        q = x @ w["q_proj.weight"].T
    else:
        q = rms(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"]) @ w["q_b_proj.weight"].T
    q = q.view(s, d.num_heads, d.qk_head_dim)
    latent = x @ w["kv_a_proj_with_mqa.weight"].T
    c, k_pe = rms(latent[:, : d.kv_lora_rank], w["kv_a_layernorm.weight"]), latent[:, d.kv_lora_rank :]

    def rope(t: torch.Tensor) -> torch.Tensor:  # interleaved pairs (x0, x1), rotated per pair
        a, b = t[..., 0::2], t[..., 1::2]
        cc, ss = cos.double().view(s, *([1] * (t.dim() - 2)), -1), sin.double().view(s, *([1] * (t.dim() - 2)), -1)
        return torch.cat([a * cc - b * ss, b * cc + a * ss], dim=-1)

    q = torch.cat([q[..., : d.qk_nope_head_dim], rope(q[..., d.qk_nope_head_dim :])], dim=-1)
    k_pe = rope(k_pe)
    kv = (c @ w["kv_b_proj.weight"].T).view(s, d.num_heads, d.qk_nope_head_dim + d.v_head_dim)
    k = torch.cat([kv[..., : d.qk_nope_head_dim], k_pe[:, None, :].expand(s, d.num_heads, -1)], dim=-1)
    v = kv[..., d.qk_nope_head_dim :]
    scores = torch.einsum("qhd,khd->hqk", q, k) * layer.scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, -1)
    return out @ w["o_proj.weight"].T


def _common(reqs: list[tuple[int, int, list[int]]]) -> CommonAttentionMetadata:
    """``reqs``: (context, query_len, blocks) per request, in batch order."""
    qlens = [q for _, q, _ in reqs]
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor([c + q for c, q, _ in reqs], dtype=torch.int32)
    width = max(len(b) for _, _, b in reqs)
    table = torch.tensor([b + [0] * (width - len(b)) for _, _, b in reqs], dtype=torch.int32)
    slots = [blocks[p // BLOCK] * BLOCK + p % BLOCK for c, q, blocks in reqs for p in range(c, c + q)]
    return CommonAttentionMetadata(
        query_start_loc=qsl, seq_lens=seq, block_table=table, slot_mapping=torch.tensor(slots),
        num_reqs=len(reqs), num_actual_tokens=sum(qlens), max_query_len=max(qlens), max_seq_len=int(seq.max()),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq,
    )  # fmt: skip


@pytest.mark.parametrize("q_lora_rank", [None, 20], ids=["q_proj", "q_lora"])
def test_mixed_steps_match_the_float64_reference(q_lora_rank: int | None) -> None:
    layer = _layer(q_lora_rank)
    rope = RotaryEmbedding(DIMS.qk_rope_head_dim, 64, {"rope_type": "default", "rope_theta": 10000.0}, 64)
    layer.kv_cache = torch.zeros(CPUMLABackend.get_kv_cache_shape(24, BLOCK, 1, DIMS.latent_size))
    spec = AttentionLayerSpec(
        num_heads=DIMS.num_heads, num_kv_heads=1, head_size=DIMS.latent_size, dtype=torch.float32,
        kv_cache_dtype=torch.float32, block_size=BLOCK, max_num_seqs=8, max_model_len=64, scale=layer.scale,
        extra=DIMS.to_extra(),
    )  # fmt: skip
    builder = MLAMetadataBuilder(spec, torch.device("cpu"), 8, CPUMLABackend, CPUMLABackend)
    g = torch.Generator().manual_seed(1)
    seqs = {name: torch.randn(n, HIDDEN, generator=g) for name, n in (("A", 11), ("B", 13), ("C", 6))}
    blocks = {"A": [5, 2, 9], "B": [7, 0, 3, 11], "C": [14, 1]}

    def step(reqs: list[tuple[str, int, int]]) -> dict[str, torch.Tensor]:
        common = _common([(c, q, blocks[n]) for n, c, q in reqs])
        hidden = torch.cat([seqs[n][c : c + q] for n, c, q in reqs])
        positions = torch.cat([torch.arange(c, c + q) for _, c, q in reqs])
        with torch.no_grad(), set_forward_context(builder.build(common)):
            out = layer(hidden, rope.cos_sin(positions))
        rows = torch.tensor([0, *[q for _, _, q in reqs]]).cumsum(0)
        return {n: out[rows[i] : rows[i + 1]] for i, (n, _, _) in enumerate(reqs)}

    def expect(name: str, upto: int, q: int) -> torch.Tensor:
        cos, sin = rope.cos_sin(torch.arange(upto))
        return _reference(layer, seqs[name][:upto], cos, sin)[upto - q :]

    first = step([("B", 0, 7), ("A", 0, 10)])  # fresh prefills
    torch.testing.assert_close(first["B"].double(), expect("B", 7, 7), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(first["A"].double(), expect("A", 10, 10), rtol=1e-4, atol=1e-5)
    # Mixed and shuffled: a new prompt, a decode (absorbed path), a chunk over B's cached prefix.
    second = step([("C", 0, 6), ("A", 10, 1), ("B", 7, 6)])
    torch.testing.assert_close(second["C"].double(), expect("C", 6, 6), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(second["A"].double(), expect("A", 11, 1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(second["B"].double(), expect("B", 13, 6), rtol=1e-4, atol=1e-5)


def test_an_mla_layer_refuses_a_backend_without_the_phase() -> None:
    decode_only = type("DECODE_ONLY", (CPUMLABackend,), {"NAME": "DECODE_ONLY", "mla_phases": ("decode",)})
    with pytest.raises(ValueError, match="the MLA prefill backend DECODE_ONLY does not implement MLA prefill"):
        MLAAttention(
            hidden_size=HIDDEN, dims=DIMS, q_lora_rank=None, scale=0.1, rms_norm_eps=1e-6,
            decode_backend=decode_only, prefill_backend=decode_only, rope_interleaved=False, prefix="layers.0",
        )  # fmt: skip


def test_mla_dims_are_checked() -> None:
    with pytest.raises(ValueError, match="MLADims.kv_lora_rank must be a positive int"):
        MLADims(num_heads=4, kv_lora_rank=0, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MLADims(num_heads=4, kv_lora_rank=8, qk_nope_head_dim=16, qk_rope_head_dim=7, v_head_dim=12)


@pytest.mark.parametrize("factor, mscale_all_dim", [(40.0, 1.0), (4.0, 0.707), (1.0, 1.0)])
def test_deepseek_softmax_scale_matches_hf(factor: float, mscale_all_dim: float) -> None:
    hf = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    params = {"rope_type": "yarn", "factor": factor, "mscale_all_dim": mscale_all_dim, "rope_theta": 10000.0}
    assert deepseek_softmax_scale(params, 192) == pytest.approx(hf.yarn_apply_mscale(params, 192**-0.5), rel=1e-12)
    assert deepseek_softmax_scale({"rope_type": "default"}, 192) == 192**-0.5
