#!/usr/bin/env bash
# On the GPU machine, from the repository root, once per device call that carries pieces of .vllm/ (made by
# fetch.sh): copies each carried piece into /tmp/vstash (carried folders do not outlive the call; /tmp does, on a
# warm machine); once every piece named in the manifest is there, joins them, checks the sha256, and installs
# vLLM and its modules into /tmp/vsite. Idempotent: a second run after the install only says so.
# Run vLLM with PYTHONPATH=/tmp/vsite alone (kvloom's /tmp/site holds other versions of shared modules).
# Exit status: 0 when installed or still waiting for pieces; 1 on a broken piece or a failed install.
set -uo pipefail
STASH=/tmp/vstash VSITE=${VSITE:-/tmp/vsite}
mkdir -p $STASH
for d in .vllm/p*/; do
  [ -f "$d/part" ] && [ -f "$d/manifest" ] || continue
  i=${d#.vllm/p}; i=${i%/}
  cp "$d/part" "$STASH/part.$i" && cp "$d/manifest" "$STASH/manifest" && echo "vllm stash: piece $i stashed"
done
[ -f $STASH/manifest ] || { echo "vllm stash: no piece carried yet (carry .vllm/pN, made by fetch.sh)"; exit 0; }
pieces=$(awk '/^pieces/{print $2}' $STASH/manifest) sha=$(awk '/^sha256/{print $2}' $STASH/manifest)
if [ -f $VSITE/.installed ] && [ "$(cat $VSITE/.installed)" = "$sha" ]; then
  echo "vllm stash: already installed in $VSITE ($(awk '/^vllm/{print $2}' $STASH/manifest))"; exit 0; fi
missing=()
for ((i = 0; i < pieces; i++)); do [ -f $STASH/part.$i ] || missing+=("p$i"); done
if [ ${#missing[@]} -gt 0 ]; then echo "vllm stash: waiting for ${missing[*]} (of $pieces)"; exit 0; fi
tarball=/tmp/vllm-pieces.tar
for ((i = 0; i < pieces; i++)); do cat $STASH/part.$i; done > $tarball
[ "$(sha256sum $tarball | cut -c1-64)" = "$sha" ] || { echo "vllm stash: sha256 mismatch: a piece is from another fetch"; rm -f $tarball; exit 1; }
rm -rf /tmp/vwheels && mkdir -p /tmp/vwheels && tar xf $tarball -C /tmp/vwheels && rm -f $tarball
rm -rf $VSITE
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $VSITE /tmp/vwheels/wheels/*.whl \
  || { echo "vllm stash: pip install into $VSITE failed"; exit 1; }
PYTHONPATH=$VSITE python3 -c "import vllm; print('vllm stash: installed vllm', vllm.__version__)" \
  || { echo "vllm stash: vllm does not import from $VSITE"; exit 1; }
echo "$sha" > $VSITE/.installed
rm -rf /tmp/vwheels $STASH/part.*
