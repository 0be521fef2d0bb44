#!/usr/bin/env bash
# The repository explains itself, checked (CI runs this after the release build):
#   1. every repository path named in comments, the README and docs/ exists (tools/check_docs/paths.py);
#   2. every `docs/DESIGN.md §N` reference names a heading of docs/DESIGN.md (tools/check_docs/sections.py);
#   3. docs/DESIGN.md §2.2's import graph is exactly the imports between src/'s top-level modules
#      (tools/check_docs/layers.py), and that check fails on planted violations (its --selftest);
#   4. every flag of every subcommand has help text, from the release binary's --help
#      (tools/check_docs/help.py; skipped with a line when the binary is not built).
#
#   tools/check-docs.sh [BIN]      # BIN defaults to target/release/infomem-engine
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN="${1:-target/release/infomem-engine}"
status=0
python3 tools/check_docs/paths.py . || status=1
python3 tools/check_docs/sections.py . || status=1
python3 tools/check_docs/layers.py . || status=1
python3 tools/check_docs/layers.py --selftest || status=1
if [ -x "$BIN" ]; then
  python3 tools/check_docs/help.py "$BIN" || status=1
else
  echo "check-docs: $BIN is not built: the --help check is skipped"
fi
exit "$status"
