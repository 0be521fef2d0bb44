#!/usr/bin/env python3
"""Every `DESIGN.md §N[.M]` reference (and the `§` numbers that follow it in the same phrase,
e.g. `§1.4 and §1.5`, `§4.2–§4.3`) names a heading of docs/DESIGN.md."""
import os, re, sys
os.chdir(sys.argv[1] if len(sys.argv) > 1 else ".")
heads = set(re.findall(r"^#{2,3} §(\d+(?:\.\d+)?) ", open("docs/DESIGN.md").read(), re.M))
files = ["README.md"] + [os.path.join(dp, f) for d in ["src", "tests", "tools", "kernels", "benches", "examples", "docs"]
                         for dp, _, fn in os.walk(d) for f in fn if f.endswith((".rs", ".cu", ".cuh", ".sh", ".py", ".md", ".toml"))]
refs, bad = 0, []
for f in files:
    for ln, line in enumerate(open(f, encoding="utf-8", errors="replace"), 1):
        for m in re.finditer(r"DESIGN\.md(?:\]\([^)]*\))?((?:[ ,;:]*(?:and|or|to)?[ ]*§\d+(?:\.\d+)?(?:[–-]§?\d+(?:\.\d+)?)?)+)", line):
            for n in re.findall(r"\d+(?:\.\d+)?", m.group(1)):
                refs += 1
                if n not in heads:
                    bad.append(f"{f}:{ln}: §{n}: {line.strip()[:120]}")
        # a bare `§N` in docs/DESIGN.md itself points inside the file
        if f == "docs/DESIGN.md":
            for n in re.findall(r"(?<!#)§(\d+(?:\.\d+)?)", line):
                refs += 1
                if n not in heads:
                    bad.append(f"{f}:{ln}: §{n}: {line.strip()[:120]}")
print(f"headings: {' '.join(sorted(heads, key=lambda s: [int(x) for x in s.split('.')]))}")
print(f"{refs} § references checked, {len(bad)} dangling")
print("\n".join(bad))
sys.exit(1 if bad else 0)
