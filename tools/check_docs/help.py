#!/usr/bin/env python3
"""Every flag of every subcommand has help text: parse `<sub> --help` (clap's long form, where
each flag is a line of its own followed by its indented help, defaults and possible values)."""
import re, subprocess, sys
BIN = sys.argv[1] if len(sys.argv) > 1 else "target/release/infomem-engine"
SUBS = [[], ["generate"], ["score"], ["bench"], ["rollout"], ["eval"], ["train"], ["merge"], ["reward"],
        ["data"], ["data", "synth"], ["data", "inspect"], ["data", "convert"], ["grpo-grad"], ["device"],
        ["import-gguf"]]
FLAG = re.compile(r"^ {2,6}(-\w, )?(--[\w-]+)")
HEADER = re.compile(r"^\S")  # "Options:", "Commands:", "Usage:" ...
META = re.compile(r"^(\[default: [^]]*\]\s*|\[possible values: [^]]*\]\s*)+$|^(Possible values:|- [\w-]+(: .*)?)$")
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
