#!/usr/bin/env bash
# Run on the CPU machine (pip access), from anywhere: downloads SGLang (SGLANG_VERSION, default 0.5.15.post1) and
# everything it requires that the GPU image lacks (benchmarks/peers/fetch_closure.py: its Requires-Dist, followed
# transitively, less torch and its CUDA libraries, triton, transformers, ...; among them sglang-kernel 0.4.4,
# flashinfer-python 0.6.12, flash-attn-4 4.0.0b15, sgl-deep-gemm, nvidia-cutlass-dsl, tilelang), plus
# flashinfer-cubin (FlashInfer's precompiled kernels: without them it JIT-compiles at start), into the ignored
# .sglang/wheels, then packs them into pieces .sglang/p0 ... .sglang/pN that each fit one device call's carry
# (benchmarks/peers/pieces.sh).
#   bash benchmarks/peers/sglang/fetch.sh
# Why 0.5.15.post1: the newest SGLang confirmed on torch 2.11 (../shared/reviews/anchors-2026-11-28.md, section 5;
# 0.5.20 and later pin torch 2.13 or 2.14). `.sglang/closure.json` lists every wheel, its size and who required it.
set -euo pipefail
SGLANG_VERSION=${SGLANG_VERSION:-0.5.15.post1}
FLASHINFER_VERSION=${FLASHINFER_VERSION:-0.6.12}
cd "$(dirname "$0")/../../.."
grep -qx '/.sglang/' .gitignore || { echo "fetch.sh: /.sglang/ must be in .gitignore" >&2; exit 1; }
rm -rf .sglang && mkdir -p .sglang/wheels
python3 benchmarks/peers/fetch_closure.py --out .sglang/wheels ${SGLANG_WITHOUT:+--without $SGLANG_WITHOUT} \
  "sglang==$SGLANG_VERSION" "flashinfer-cubin==$FLASHINFER_VERSION"
bash benchmarks/peers/pieces.sh pack sglang "$SGLANG_VERSION"
