#!/usr/bin/env python3
"""Every flag of every subcommand has help text: parse `<sub> --help` (clap's long form, where
each flag is a line of its own followed by its indented help, defaults and possible values)."""
import re, subprocess, sys
BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/infomem-engine"
CMD = re.compile(r"^ {2}([a-z][\w-]*)(\s|$)")  # a line of a "Commands:" block


def subcommands(sub):
    """`sub` and every subcommand under it, from the "Commands:" blocks of their --help (so a new
    subcommand is checked without editing this list; clap's own `help` entry is skipped)."""
    out = subprocess.run([BIN, *sub, "--help"], capture_output=True, text=True, check=True).stdout
    found, block = [sub], False
    for line in out.splitlines():
        if HEADER.match(line):
            block = line.startswith("Commands:")
        elif block and (m := CMD.match(line)) and m.group(1) != "help":
            found += subcommands([*sub, m.group(1)])
    return found


FLAG = re.compile(r"^ {2,6}(-\w, )?(--[\w-]+)")
HEADER = re.compile(r"^\S")  # "Options:", "Commands:", "Usage:" ...
META = re.compile(r"^(\[default: [^]]*\]\s*|\[possible values: [^]]*\]\s*)+$|^(Possible values:|- [\w-]+(: .*)?)$")
SUBS = subcommands([])
missing, total = [], 0
for sub in SUBS:
    out = subprocess.run([BIN, *sub, "--help"], capture_output=True, text=True, check=True).stdout
    flag, text = None, []
    def close():
        global total
        if flag is None:
            return
        total += 1
        if not any(t and not META.match(t) for t in text) and flag not in ("--help", "--version"):
            missing.append(f"{' '.join(sub) or '(top level)'} {flag}")
    for line in out.splitlines() + ["END"]:
        m = FLAG.match(line)
        if m or HEADER.match(line):
            close()
            flag, text = (m.group(2), [p.strip() for p in re.split(r"\s{2,}", line.strip())[1:]]) if m else (None, [])
        elif flag is not None:
            text.append(line.strip())
print(f"{total} flag entries checked over {len(SUBS)} help pages ({BIN})")
print(f"{len(missing)} without help text")
for x in missing:
    print("  ", x)
sys.exit(1 if missing else 0)
