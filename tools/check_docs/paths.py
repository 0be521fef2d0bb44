#!/usr/bin/env python3
"""Every repository path named in the sources' comments, the README and docs/ exists.

Scans src/ tests/ tools/ kernels/ benches/ examples/ docs/ build.rs README.md .ci/ (text files;
the recorded GPU-check logs under tools/gpu-check-selftest/*/ are data and skipped) for tokens
that start with src/, tests/, tools/, kernels/, docs/, examples/ or benches/, and checks each
against the working tree. `{a,b}` is expanded, `<name>` and `*` match any file name part, `…`
or a trailing `/` names a directory."""
import glob, itertools, os, re, sys
ROOT = next((a for a in sys.argv[1:] if not a.startswith("-")), ".")
os.chdir(ROOT)
TOP = r"(?:src|tests|tools|kernels|docs|examples|benches)"
PAT = re.compile(r"(?<![\w./$-])(" + TOP + r"/[A-Za-z0-9_.<>{}*,/-]*[A-Za-z0-9_>}*/])")
SCAN = ["src", "tests", "tools", "kernels", "benches", "examples", "docs", ".ci"]
files = ["README.md", "build.rs"]
for d in SCAN:
    for dp, dn, fn in os.walk(d):
        if dp.startswith("tools/gpu-check-selftest/") and dp.count("/") >= 2:
            continue  # recorded runs (data)
        for f in fn:
            p = os.path.join(dp, f)
            if f.endswith((".png", ".safetensors")) or "fixtures/tiny" in p:
                continue
            files.append(p)

def expand(tok):
    m = re.search(r"\{([^{}]*,[^{}]*)\}", tok)  # {a,b}: alternatives; {name}: a placeholder
    if not m:
        return [tok]
    return list(itertools.chain.from_iterable(expand(tok[:m.start()] + alt + tok[m.end():]) for alt in m.group(1).split(",")))

def exists(p):
    g = re.sub(r"<[^>]*>|\{[^{},]*\}", "*", p)
    if "*" in g:
        return bool(glob.glob(g.rstrip("/")))
    return os.path.exists(p)

seen, missing = {}, []
for f in sorted(files):
    try:
        text = open(f, encoding="utf-8").read()
    except (UnicodeDecodeError, OSError):
        continue
    for ln, line in enumerate(text.splitlines(), 1):
        for m in PAT.finditer(line):
            tok = m.group(1).rstrip(".,:;")
            for p in expand(tok):
                p = p.rstrip(".,")
                seen.setdefault(p, []).append(f"{f}:{ln}")
                if not exists(p):
                    missing.append((p, f, ln, line.strip()))
# bare file names (`attention.cu`, `gpu-check.sh`): some file of that name exists
BASENAMES = set()
for dp, dn, fn in os.walk("."):
    dn[:] = [d for d in dn if d not in (".git", "target", "gpu-bundle", "runs")]
    BASENAMES.update(fn)
# files of other projects named in comments (not ours to have)
EXTERNAL = {"convert_hf_to_gguf.py": "llama.cpp's converter"}
BARE = re.compile(r"(?<![\w./{}<>$-])([A-Za-z0-9_-]+\.(?:cu|cuh|rs|sh|py))\b(?![/(])")
for f in sorted(files):
    if not f.endswith((".md", ".rs", ".cu", ".cuh", ".sh", ".py", ".toml")) and f != ".ci/run":
        continue
    for ln, line in enumerate(open(f, encoding="utf-8").read().splitlines(), 1):
        for m in BARE.finditer(line):
            name = m.group(1)
            seen.setdefault("(name) " + name, []).append(f"{f}:{ln}")
            if name not in BASENAMES and name not in EXTERNAL:
                missing.append(("(file name) " + name, f, ln, line.strip()))

print(f"{len(files)} files scanned, {len(seen)} distinct paths named, {sum(map(len, seen.values()))} mentions")
if "-v" in sys.argv:
    for p in sorted(seen):
        print(f"  {p}  ({len(seen[p])}×, e.g. {seen[p][0]})")
print(f"{len(missing)} missing")
for p, f, ln, line in missing:
    print(f"  {p}  ← {f}:{ln}: {line[:140]}")
sys.exit(1 if missing else 0)
