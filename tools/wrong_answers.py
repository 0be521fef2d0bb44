#!/usr/bin/env python3
"""What the wrong answers of an `eval` were, on `multikey` data with decoys (tools/make-long-data.sh).

    python3 tools/wrong_answers.py EVAL_DIR DATA.jsonl [EVAL_DIR DATA.jsonl ...]

EVAL_DIR holds `predictions.jsonl` (or `predictions.jsonl.xz`, as tools/study_results.py keeps
it); DATA is the set it was run on (its `meta` names each planted fact and its role). Per
directory, one line: right; wrong with the gold in the final memory (of which: the gold cut short, as a reply that
runs out of answer tokens gives it, and a decoy's code); wrong answering a decoy's
code (the answer is the code of another person planted in the document); wrong otherwise; and
of all questions, those whose final memory was degenerate (a word or number repeated 5+ times
in a row, the failure greedy decoding falls into over many rewrites).
"""
import json
import lzma
import re
import sys
from pathlib import Path


def load_predictions(d: Path):
    for name, opener in (("predictions.jsonl", open), ("predictions.jsonl.xz", lzma.open)):
        f = d / name
        if f.exists():
            with opener(f, "rt") as fh:
                return [json.loads(l) for l in fh if l.strip()]
    sys.exit(f"{d}: no predictions.jsonl(.xz)")


def decoys(data: Path):
    """id -> the codes of the facts planted about someone else (role != needle)."""
    out = {}
    with open(data) as fh:
        for line in fh:
            r = json.loads(line)
            meta = r.get("meta") or {}
            if isinstance(meta, dict):
                facts = [(f.get("role", ""), f.get("text", "")) for f in meta.get("facts", [])]
            else:
                # a Python-style dict repr: each fact's role and text (quoted either way)
                facts = [(m[0], m[2]) for m in re.findall(r"'role': '(\w+)', 'text': (['\"])(.*?)\2, ", meta)]
            codes = set()
            for role, text in facts:
                if role != "needle":
                    codes.update(re.findall(r"\d{3,}", text))
            out[r["id"]] = codes
    return out


REPEAT = re.compile(r"(\b\w+\b)(?:\W+\1\b){4,}|(\d)\2{7,}")


def main(argv):
    if len(argv) < 2 or len(argv) % 2:
        sys.exit(__doc__)
    print("| eval | n | right | wrong, gold in final | wrong, a decoy's code | wrong, other | degenerate final memory |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for d, data in zip(argv[::2], argv[1::2]):
        preds, dec = load_predictions(Path(d)), decoys(Path(data))
        missing = [p["id"] for p in preds if p["id"] not in dec]
        if missing:
            sys.exit(f"{d}: {len(missing)} questions not in {data} (e.g. {missing[0]}): not the set it was run on")
        n = len(preds)
        right = sum(p["em"] == 1.0 for p in preds)
        wrong = [p for p in preds if p["em"] != 1.0]
        in_final = sum(bool(p.get("in_final")) for p in wrong)
        decoy = sum(not p.get("in_final") and any(c in re.findall(r"\d+", p["answer"]) for c in dec[p["id"]]) for p in wrong)
        # a wrong answer from a final memory holding the gold: whose code did it give?
        decoy_in_final = sum(bool(p.get("in_final")) and any(c in re.findall(r"\d+", p["answer"]) for c in dec[p["id"]]) for p in wrong)
        # ... or the gold cut short (the reply ran out of answer tokens before the code's end)
        cut = sum(bool(p.get("in_final")) and p["answer"] != "" and any(a.startswith(p["answer"]) for a in p["answers"]) for p in wrong)
        degenerate = sum(bool(REPEAT.search((p.get("memories") or [""])[-1])) for p in preds)
        print(f"| {d} | {n} | {right} | {in_final} ({cut} cut short, {decoy_in_final} the decoy's) | {decoy} | {len(wrong) - in_final - decoy} | {degenerate} |")


if __name__ == "__main__":
    main(sys.argv[1:])
