#!/usr/bin/env bash
# Download, on a machine with pip access, the wheels that the GPU machine lacks into ./.whl
# (an ignored folder), for Python 3.12 on x86-64. tests/gpu/run.sh installs them from there
# (carry .whl with the device call). Extra package names may be given as arguments.
#   bash tests/gpu/fetch_wheels.sh [PKG...]
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
download() {  # pip download one binary wheel for CPython 3.12 on manylinux x86-64
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl "$@"
}
# FlashInfer (the FLASHINFER backend) and its FFI runtime.
download flashinfer-python==0.7.0.post1
download apache-tvm-ffi==0.1.15.post2
# What kvloom needs beyond the GPU image (fastapi 0.13x imports opentelemetry-api) (which has torch, triton, transformers, tokenizers,
# safetensors, numpy, pluggy, prometheus-client, pytest, httpx and tqdm).
# httptools: uvicorn's C HTTP parser and writer, which it uses instead of h11 when present (what vLLM's
# uvicorn[standard] brings): less front-end CPU per streamed event (issue 35; the image has uvloop already).
for pkg in pydantic pydantic-core annotated-types typing-inspection gguf fastapi starlette \
           annotated-doc uvicorn h11 httptools pyzmq msgspec opentelemetry-api importlib-metadata zipp xgrammar "$@"; do
  download "$pkg"
done
du -sh .whl  # keep it well under the 64 MiB a device call may carry
