#!/usr/bin/env bash
# Run on the CPU machine (pip access), from anywhere: downloads vLLM 0.24.0 and the modules it needs that the GPU
# image lacks (the image has torch 2.11.0+cu130, triton, transformers, tokenizers, numpy, ...) into the ignored
# folder .vllm/ of the repository, packed as one tar split into pieces .vllm/p0 ... .vllm/pN of at most
# PIECE_MIB MiB (default 58) each, so that one piece and the ~3 MiB working tree travel in one device call's
# 64 MiB carry. Each piece also holds `manifest` (the number of pieces and the tar's sha256), which
# stash_install.sh checks before it installs.
#   bash benchmarks/peers/vllm/fetch.sh
# Why 0.24.0: it is the last vLLM that pins torch==2.11.0, the GPU image's torch (its kernels link
# libcudart.so.13 like the image's cu130 torch); installing another torch would not fit a call.
# Why these modules: vLLM's imports on that image (found by running it there, ../shared/gpu/vllm-peer/):
# the OpenAI server (fastapi, uvicorn, openai and its httpx2/httpcore2), the engine's IPC (pyzmq, msgspec, cbor2),
# structured output (xgrammar, llguidance), and FlashInfer 0.6.12 (vLLM's model runner imports it for its
# sampler check). Versions pinned where the unpinned latest does not import with vLLM 0.24.0.
set -euo pipefail
VLLM_VERSION=0.24.0
PIECE_MIB=${PIECE_MIB:-58}
cd "$(dirname "$0")/../../.."
grep -qx '/.vllm/' .gitignore || { echo "fetch.sh: /.vllm/ must be in .gitignore" >&2; exit 1; }
rm -rf .vllm && mkdir -p .vllm/wheels
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
python3 -m pip download -q --no-deps "${plat[@]}" -d .vllm/wheels "vllm==$VLLM_VERSION"
for pkg in aiohappyeyeballs aiohttp aiosignal annotated-doc annotated-types apache-tvm-ffi==0.1.15.post2 attrs \
    cachetools cbor2 cloudpickle einops fastapi==0.136.3 frozenlist jmespath llguidance \
    model-hosting-container-standards msgspec multidict openai openai-harmony opentelemetry-api importlib_metadata \
    zipp partial-json-parser psutil py-cpuinfo pybase64 pydantic==2.14.3 pydantic_core==2.50.4 propcache pyzmq \
    starlette==1.10.0 typing-inspection uvicorn watchfiles xgrammar yarl h11 anyio sniffio jiter distro httpx2 \
    httpcore2 truststore flashinfer-python==0.6.12 tabulate prometheus-fastapi-instrumentator; do
  python3 -m pip download -q --no-deps "${plat[@]}" -d .vllm/wheels "$pkg"
done
cd .vllm
tar cf vllm.tar wheels  # wheels are zip files already: no compression
sha=$(sha256sum vllm.tar | cut -c1-64)
split -b "${PIECE_MIB}M" -d -a 2 vllm.tar part.
parts=(part.*)
for i in "${!parts[@]}"; do
  mkdir -p "p$i" && mv "${parts[$i]}" "p$i/part"
  printf 'pieces %d\nsha256 %s\nvllm %s\n' "${#parts[@]}" "$sha" "$VLLM_VERSION" > "p$i/manifest"
done
rm -rf wheels vllm.tar
du -sh p*
