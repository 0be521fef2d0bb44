#!/usr/bin/env python3
"""docs/DESIGN.md §2.2's import graph is the code's: the `crate::…`/`super::…` edges between the
library's top-level modules (src/lib.rs's `pub mod`s), outside `#[cfg(test)]` code, are exactly
the edges the section lists — an import it does not list fails, and so does a listed edge no code
makes — and the listed graph has no circle.

    layers.py [ROOT]          # check ROOT (default .)
    layers.py --selftest      # plant violations in a copy of the tree and require that they fail

Why a parser and not grep: `use crate::{a::X, b::Y}` names two modules, `super::super::x` climbs
out of a module, and test modules (`#[cfg(test)] mod tests { … }` or `mod tests;` in a file of its
own) are not part of the layering the section states."""
import os, re, shutil, subprocess, sys, tempfile

SECTION = "### §2.2 "


RAW = re.compile(r'b?r(#*)"')
CHAR = re.compile(r"'(\\.|\\u\{[0-9a-fA-F]+\}|[^\\'])'")


def strip_code(src):
    """Comments and string/char literals blanked (newlines kept), so only code remains."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif src.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    out.append("\n" if src[i] == "\n" else "")
                    i += 1
        elif c in "br" and (m := RAW.match(src, i)) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            end = '"' + m.group(1)
            j = src.find(end, m.end())
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * src.count("\n", i, j))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append('""' + "\n" * src.count("\n", i, j))
            i = j + 1
        elif c == "'" and (m := CHAR.match(src, i)):
            out.append("' '")  # a char literal ('{' would unbalance the braces); lifetimes stay
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


TEST_ATTR = re.compile(r"#\[cfg\((?:all\()?test\b[^\]]*\)\]")


def skip_item(code, i):
    """Index just past the item starting at code[i] (after its attributes)."""
    n = len(code)
    while True:  # further attributes of the same item
        m = re.compile(r"\s*#\[").match(code, i)
        if not m:
            break
        depth, j = 1, m.end()
        while j < n and depth:
            depth += {"[": 1, "]": -1}.get(code[j], 0)
            j += 1
        i = j
    m = re.compile(r"\s*(?:pub(?:\([^)]*\))?\s+)?use\b").match(code, i)
    if m:
        return code.index(";", m.end()) + 1
    depth, j = 0, i
    while j < n:
        c = code[j]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == ";" and depth == 0:
            return j + 1
        elif c == "{" and depth == 0:
            d = 0
            while j < n:
                d += {"{": 1, "}": -1}.get(code[j], 0)
                j += 1
                if d == 0:
                    return j
        j += 1
    return n


def module_files(root):
    """{file: module path} for the library, following `mod` declarations from src/lib.rs, and the
    set of files that only `#[cfg(test)]` declarations reach."""
    files, test_only = {}, set()

    def visit(path, modpath, is_test):
        if not os.path.exists(path):
            return
        if is_test:
            test_only.add(path)
        else:
            files[path] = modpath
        code = strip_code(open(path, encoding="utf-8").read())
        base = os.path.dirname(path) if os.path.basename(path) in ("mod.rs", "lib.rs") \
            else os.path.splitext(path)[0]
        for m in re.finditer(r"((?:#\[[^\]]*\]\s*)*)(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", code):
            name, test = m.group(2), is_test or bool(TEST_ATTR.search(m.group(1)))
            for cand in (os.path.join(base, name + ".rs"), os.path.join(base, name, "mod.rs")):
                if os.path.exists(cand):
                    visit(cand, modpath + [name], test)
                    break

    visit(os.path.join(root, "src", "lib.rs"), [], False)
    return files, test_only


def strip_tests(code):
    """`code` with every item under a `#[cfg(test)]` attribute blanked (newlines kept)."""
    out, pos = [], 0
    for m in TEST_ATTR.finditer(code):
        if m.start() < pos:
            continue
        end = skip_item(code, m.end())
        out.append(code[pos:m.start()])
        out.append("\n" * code.count("\n", m.start(), end))
        pos = end
    out.append(code[pos:])
    return "".join(out)


PATH = re.compile(r"(?<![\w:])\$?((?:crate|(?:super::)*super)::)")


def group_heads(code, i):
    """First path segment of each element of the use group whose `{` is at code[i]."""
    heads, depth, start, j = [], 0, i + 1, i
    while j < len(code):
        c = code[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        if (c == "," and depth == 1) or depth == 0:
            m = re.match(r"\s*(\w+)", code[start:j])
            if m:
                heads.append(m.group(1))
            start = j + 1
            if depth == 0:
                break
        j += 1
    return heads


INLINE_MOD = re.compile(r"\bmod\s+(\w+)\s*\{")


def inline_mods(code):
    """[(start, end, name)] of the `mod name { … }` blocks in `code` (a `super::` inside one
    climbs out of it first)."""
    spans = []
    for m in INLINE_MOD.finditer(code):
        spans.append((m.end() - 1, skip_item(code, m.end() - 1), m.group(1)))
    return spans


def edges_in(code, file_modpath, tops):
    """{(from, to, line)} for the paths in `code` (a file of module `file_modpath`) that reach
    another top-level module."""
    found = set()
    spans = inline_mods(code)
    for m in PATH.finditer(code):
        line = code.count("\n", 0, m.start()) + 1
        modpath = file_modpath + [name for s, e, name in spans if s < m.start() < e]
        prefix = m.group(1)
        base = [] if prefix == "crate::" else modpath[:len(modpath) - prefix.count("super")]
        if len(modpath) - prefix.count("super") < 0:
            continue  # climbs past the crate root: rustc refuses it
        rest = code[m.end():]
        if base:
            targets = [base[0]]
        elif rest.lstrip().startswith("{"):
            targets = group_heads(code, m.end() + len(rest) - len(rest.lstrip()))
        else:
            targets = [re.match(r"\s*(\w*)", rest).group(1)]
        for t in targets:
            if t in tops and t != modpath[0]:
                found.add((modpath[0], t, line))
    return found


def code_edges(root):
    files, _ = module_files(root)
    tops = {p[0] for p in files.values() if p}
    edges = {}
    for f, modpath in sorted(files.items()):
        if not modpath:
            continue  # lib.rs declares the modules
        code = strip_tests(strip_code(open(f, encoding="utf-8").read()))
        for a, b, ln in edges_in(code, modpath, tops):
            edges.setdefault((a, b), []).append(f"{os.path.relpath(f, root)}:{ln}")
    return tops, edges


def split_top(s):
    """Split on commas outside parentheses; drop parenthesized notes."""
    parts, depth, cur = [], 0, ""
    for c in s:
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif depth == 0:
            if c == ",":
                parts.append(cur)
                cur = ""
            else:
                cur += c
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def listed_edges(root):
    """{module: [modules it imports]} from the indented block of DESIGN.md §2.2."""
    text = open(os.path.join(root, "docs", "DESIGN.md"), encoding="utf-8").read()
    start = text.find("\n" + SECTION)
    if start < 0:
        sys.exit(f"layers: no '{SECTION.strip()}' heading in docs/DESIGN.md")
    end = text.find("\n### ", start + 1)
    rows, cur = {}, None
    for line in text[start:end].splitlines():
        if not line.startswith("    "):
            cur = None if line.strip() else cur
            continue
        if "→" in line:
            name, rhs = line.split("→", 1)
            cur = name.strip()
            if cur in rows:
                sys.exit(f"layers: DESIGN.md §2.2 lists `{cur}` twice")
            rows[cur] = rhs
        elif cur:
            rows[cur] += " " + line.strip()
    if not rows:
        sys.exit("layers: DESIGN.md §2.2 has no `module → modules` block")
    return {k: split_top(v) for k, v in rows.items()}


def cycle(graph):
    """One circle of `graph` as a list of modules, or None."""
    state, stack = {}, []

    def dfs(v):
        state[v] = 1
        stack.append(v)
        for w in graph.get(v, []):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if not state.get(w) and (c := dfs(w)):
                return c
        state[v] = 2
        stack.pop()
        return None

    for v in sorted(graph):
        if not state.get(v) and (c := dfs(v)):
            return c
    return None


def check(root):
    tops, edges = code_edges(root)
    listed = listed_edges(root)
    errors = []
    for m in sorted(set(listed) - tops):
        errors.append(f"DESIGN.md §2.2 lists `{m}`, which is not a module of src/lib.rs")
    for m in sorted(tops - set(listed)):
        errors.append(f"module `{m}` has no row in DESIGN.md §2.2")
    allowed = {(a, b) for a, bs in listed.items() for b in bs}
    for (a, b), where in sorted(edges.items()):
        if (a, b) not in allowed:
            errors.append(f"import {a} → {b} is not in DESIGN.md §2.2: {', '.join(where[:3])}"
                          + (f" (+{len(where) - 3} more)" if len(where) > 3 else ""))
    for a, b in sorted(allowed - set(edges)):
        errors.append(f"DESIGN.md §2.2 lists {a} → {b}, but no non-test code of `{a}` imports `{b}`")
    if c := cycle(listed):
        errors.append(f"DESIGN.md §2.2's graph has a circle: {' → '.join(c)}")
    print(f"layers: {len(tops)} modules, {len(edges)} import edges in the code, {len(allowed)} listed; "
          f"{len(errors)} mismatches")
    for e in errors:
        print("  " + e)
    return errors


def selftest():
    """Each planted change must make the check fail, naming it; the unchanged tree must pass."""
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    failures = []

    def run(name, plant, expect):
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(os.path.join(repo, "src"), os.path.join(tmp, "src"))
            os.makedirs(os.path.join(tmp, "docs"))
            shutil.copy(os.path.join(repo, "docs", "DESIGN.md"), os.path.join(tmp, "docs"))
            plant(tmp)
            r = subprocess.run([sys.executable, __file__, tmp], capture_output=True, text=True)
            ok = (r.returncode == 0) if expect is None else (r.returncode == 1 and expect in r.stdout)
            print(f"  {'ok  ' if ok else 'FAIL'} {name}")
            if not ok:
                failures.append(name)
                print("    " + (r.stdout + r.stderr).replace("\n", "\n    "))

    def append(rel, text):
        return lambda tmp: open(os.path.join(tmp, rel), "a", encoding="utf-8").write(text)

    def edit_design(old, new):
        def plant(tmp):
            p = os.path.join(tmp, "docs", "DESIGN.md")
            t = open(p, encoding="utf-8").read()
            assert old in t, old
            open(p, "w", encoding="utf-8").write(t.replace(old, new, 1))
        return plant

    print("layers selftest:")
    run("the tree as it is passes", lambda tmp: None, None)
    run("a planted `use crate::rl` in reward fails",
        append("src/reward/mod.rs", "\n#[allow(unused_imports)]\nuse crate::rl::grpo;\n"),
        "import reward → rl is not in DESIGN.md §2.2: src/reward/mod.rs:")
    run("a planted grouped import `use crate::{util::rng, runtime::X}` in model fails",
        append("src/model/mod.rs", "\n#[allow(unused_imports)]\nuse crate::{util::rng, runtime::Model};\n"),
        "import model → runtime is not in DESIGN.md §2.2")
    run("a planted `super::super::eval` path in util/rng.rs fails",
        append("src/util/rng.rs", "\nfn _planted() { let _ = super::super::eval::Report::default; }\n"),
        "import util → eval is not in DESIGN.md §2.2: src/util/rng.rs:")
    run("a planted `super::super::rl` inside an inline `mod` of reward fails",
        append("src/reward/mod.rs", "\nmod planted {\n    #[allow(unused_imports)]\n    use super::super::rl::grpo;\n}\n"),
        "import reward → rl is not in DESIGN.md §2.2: src/reward/mod.rs:")
    run("the same import under #[cfg(test)] passes",
        append("src/reward/mod.rs", "\n#[cfg(test)]\nmod planted {\n    use crate::rl::grpo;\n}\n"),
        None)
    run("a listed edge no code makes fails",
        edit_design("    reward   → (nothing)", "    reward   → util"),
        "DESIGN.md §2.2 lists reward → util, but no non-test code")
    run("a listed circle fails",
        edit_design("    util     → (nothing)", "    util     → model"),
        "DESIGN.md §2.2's graph has a circle: model → util → model")
    print(f"layers selftest: {len(failures)} failed")
    return failures


if __name__ == "__main__":
    if "--selftest" in sys.argv:
        sys.exit(1 if selftest() else 0)
    sys.exit(1 if check(next((a for a in sys.argv[1:] if not a.startswith("-")), ".")) else 0)
