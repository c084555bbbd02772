#!/usr/bin/env bash
# On the GPU machine, from the repository root, once per device call that carries pieces of .vllm/ (made by
# fetch.sh): stashes them in /tmp and, once all are there, installs vLLM into /tmp/vsite and checks that its offline
# LLM and its OpenAI server import (benchmarks/peers/pieces.sh stash). Run vLLM with PYTHONPATH=/tmp/vsite alone
# (kvloom's /tmp/site holds other versions of shared modules).
cd "$(dirname "$0")/../../.." || exit 1
exec bash benchmarks/peers/pieces.sh stash vllm "${VSITE:-/tmp/vsite}" \
  "import vllm, vllm.entrypoints.openai.api_server; from vllm import LLM; print('vllm stash: installed vllm', vllm.__version__)"
