#!/usr/bin/env bash
# Build the API reference of kvloom's plugin interfaces from their docstrings with pdoc (a
# dev requirement): kvloom.interfaces (and kvloom.interfaces.models) and kvloom.testing.
# Usage: bash scripts/build-api-docs.sh [OUT_DIR]   (default docs/api/, git-ignored;
# open OUT_DIR/index.html). PYTHON picks the interpreter (default .venv/bin/python if
# present, else python).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/api}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
rm -rf "$OUT"
"$PYTHON" -m pdoc --docformat restructuredtext --no-show-source --footer-text "kvloom plugin API" \
    -o "$OUT" kvloom.interfaces kvloom.interfaces.models \
    kvloom.testing kvloom.testing.conformance kvloom.testing.reference kvloom.testing.custom_ops kvloom.testing.host_sync \
    kvloom.testing.models kvloom.testing.lora kvloom.testing.install
echo "API reference: $OUT/index.html"
