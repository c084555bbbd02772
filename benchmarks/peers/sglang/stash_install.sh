#!/usr/bin/env bash
# On the GPU machine, from the repository root, once per device call that carries pieces of .sglang/ (made by
# fetch.sh): stashes them in /tmp and, once all are there, installs SGLang into /tmp/sgsite and checks that its
# offline Engine and its server import (benchmarks/peers/pieces.sh stash). Run SGLang with PYTHONPATH=/tmp/sgsite
# alone.
cd "$(dirname "$0")/../../.." || exit 1
exec bash benchmarks/peers/pieces.sh stash sglang "${SGSITE:-/tmp/sgsite}" \
  "import sglang, sglang.launch_server; from sglang import Engine; print('sglang stash: installed sglang', sglang.__version__)"
