#!/usr/bin/env bash
# Pieces of a peer engine's wheels, small enough for one device call's carry each.
#   bash benchmarks/peers/pieces.sh pack NAME VERSION   (CPU machine, repository root): .NAME/wheels -> one tar
#        split into .NAME/p0 ... .NAME/pN of at most PIECE_MIB MiB (default 56: a piece and the ~6 MiB working tree fit
#        one call's 64 MiB; 58 no longer did on 2026-11-29), each with `manifest` (pieces, the tar's sha256, the version); prints the sizes.
#   bash benchmarks/peers/pieces.sh stash NAME SITE CHECK  (GPU machine, repository root, once per call that carries
#        pieces): copies each carried .NAME/pN into /tmp/NAME-stash (carried folders do not outlive the call; /tmp
#        does, on a warm machine); once every piece is there and the sha256 matches, installs every wheel into SITE and
#        adds the stand-ins of benchmarks/peers/NAME/standins/ for modules the fetch left out (a module the site
#        already has is never replaced), and runs CHECK (a Python snippet) with PYTHONPATH=SITE alone. Idempotent. Exit status 0 when installed or still
#        waiting for pieces, 1 on a broken piece, a failed install or a failed CHECK.
set -uo pipefail
cmd=$1 name=$2
case $cmd in
  pack)
    version=$3 piece_mib=${PIECE_MIB:-56}
    grep -qx "/.$name/" .gitignore || { echo "pieces: /.$name/ must be in .gitignore" >&2; exit 1; }
    cd ".$name" || exit 1
    rm -rf p[0-9]*
    tar cf all.tar wheels  # wheels are zip files already: no compression
    sha=$(sha256sum all.tar | cut -c1-64)
    split -b "${piece_mib}M" -d -a 2 all.tar part.
    parts=(part.*)
    for i in "${!parts[@]}"; do
      mkdir -p "p$i" && mv "${parts[$i]}" "p$i/part"
      printf 'pieces %d\nsha256 %s\nversion %s\n' "${#parts[@]}" "$sha" "$version" > "p$i/manifest"
    done
    echo "$name $version: $(du -sh wheels | cut -f1) of wheels in ${#parts[@]} pieces of at most ${piece_mib} MiB"
    rm -f all.tar ;;
  stash)
    site=$3 check=$4 stash=/tmp/$name-stash
    mkdir -p "$stash"
    for d in ".$name"/p*/; do
      [ -f "$d/part" ] && [ -f "$d/manifest" ] || continue
      i=${d#.$name/p}; i=${i%/}
      cp "$d/part" "$stash/part.$i" && cp "$d/manifest" "$stash/manifest" && echo "$name stash: piece $i stashed"
    done
    [ -f "$stash/manifest" ] || { echo "$name stash: no piece carried yet (carry .$name/pN)"; exit 0; }
    pieces=$(awk '/^pieces/{print $2}' "$stash/manifest") sha=$(awk '/^sha256/{print $2}' "$stash/manifest")
    if [ -f "$site/.installed" ] && [ "$(cat "$site/.installed")" = "$sha" ]; then
      echo "$name stash: already installed in $site ($(awk '/^version/{print $2}' "$stash/manifest"))"; exit 0; fi
    missing=()
    for ((i = 0; i < pieces; i++)); do [ -f "$stash/part.$i" ] || missing+=("p$i"); done
    if [ ${#missing[@]} -gt 0 ]; then echo "$name stash: waiting for ${missing[*]} (of $pieces)"; exit 0; fi
    tarball=/tmp/$name-pieces.tar wheels=/tmp/$name-wheels
    for ((i = 0; i < pieces; i++)); do cat "$stash/part.$i"; done > "$tarball"
    [ "$(sha256sum "$tarball" | cut -c1-64)" = "$sha" ] \
      || { echo "$name stash: sha256 mismatch: a piece is from another fetch"; rm -f "$tarball"; exit 1; }
    rm -rf "$wheels" && mkdir -p "$wheels" && tar xf "$tarball" -C "$wheels" && rm -f "$tarball"
    rm -rf "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/wheels/*.whl \
      || { echo "$name stash: pip install into $site failed"; exit 1; }
    for standin in benchmarks/peers/"$name"/standins/*/; do
      [ -d "$standin" ] || continue
      module=$(basename "$standin")
      [ -e "$site/$module" ] || { cp -r "$standin" "$site/" && echo "$name stash: stand-in for $module (not fetched)"; }
    done
    PYTHONPATH=$site python3 -c "$check" || { echo "$name stash: the check failed with PYTHONPATH=$site"; exit 1; }
    echo "$sha" > "$site/.installed"
    rm -rf "$wheels" "$stash"/part.* ;;
  *) echo "usage: pieces.sh pack NAME VERSION | stash NAME SITE CHECK" >&2; exit 2 ;;
esac
