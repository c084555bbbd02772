#!/usr/bin/env bash
# Run on the CPU machine (pip access), from anywhere: downloads vLLM (VLLM_VERSION, default 0.26.0) and everything it
# requires that the GPU image lacks (benchmarks/peers/fetch_closure.py: its wheel's Requires-Dist, followed
# transitively, less torch and its CUDA libraries, triton, transformers, ...) into the ignored .vllm/wheels, then packs
# them into pieces .vllm/p0 ... .vllm/pN that each fit one device call's carry (benchmarks/peers/pieces.sh).
#   bash benchmarks/peers/vllm/fetch.sh
# Why 0.26.0: the newest vLLM on the GPU image's torch 2.11 (0.27 and later pin torch 2.13;
# ../shared/reviews/anchors-2026-11-28.md, section 1); its model runner V2 is the default. `.vllm/closure.json` lists
# every wheel, its size and who required it.
set -euo pipefail
VLLM_VERSION=${VLLM_VERSION:-0.26.0}
cd "$(dirname "$0")/../../.."
grep -qx '/.vllm/' .gitignore || { echo "fetch.sh: /.vllm/ must be in .gitignore" >&2; exit 1; }
rm -rf .vllm && mkdir -p .vllm/wheels
# llguidance >= 1.7 (the `guidance` structured-output backend) is not on every index yet: VLLM_WITHOUT="llguidance"
# leaves it out where pip finds none, and the stash puts vllm/standins/llguidance in its place (vLLM's server module
# does not import without it; the benchmarks never use it).
python3 benchmarks/peers/fetch_closure.py --out .vllm/wheels ${VLLM_WITHOUT:+--without $VLLM_WITHOUT} \
  "vllm==$VLLM_VERSION"
bash benchmarks/peers/pieces.sh pack vllm "$VLLM_VERSION"
