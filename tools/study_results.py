#!/usr/bin/env python3
"""A study's results without its weights: what a machine that keeps nothing but a git checkout
carries from one sitting to the next (docs/STUDY.md, "A study over several machines").

    python3 tools/study_results.py save OUT DEST      keep study OUT's small files in DEST
    python3 tools/study_results.py restore DEST OUT   lay them back under OUT for `study` to go on

Kept per cell: settings.json, log.txt, and once its training finished train/config.toml,
train/metrics.jsonl and train/adapter.sha256 (the SHA-256 of adapter_model.safetensors); every
finished evaluation's results.json, results.md and predictions.jsonl (as predictions.jsonl.xz:
the memories make it the big one); at the top the study's study.json, study.md and plots. Not
kept: adapters, checkpoints, an evaluation's plots, locks.

A cell restored without its adapter is reported and finished as it is. An evaluation added to it
needs the adapter that made the others: `study` trains it again apart and adds to the cell only
when the new adapter's bytes have the kept hash (the same binary on the same kind of CPU with the
same threads makes the same bytes); otherwise it refuses.

Nothing is lost or mixed. Every file is checked before any is written, so a refusal writes
nothing:
- a cell's results belong to one adapter: a cell whose adapter (its hash, or the hash kept with
  it) differs between the two sides is refused whole, and so is a cell the other side holds
  results of without any hash to compare;
- a finished evaluation and a finished training never change: a kept file that differs from the
  one at hand is refused (identical ones are skipped; answers compare decompressed);
- log.txt only grows, settings.json only gains parts: the longer one is kept (a restore onto a
  machine that went on further leaves its files be); the report (study.*, plots) is derived and
  follows the side written from;
- restore adds nothing to a cell whose training there has no finished adapter (checkpoints only).
"""
import hashlib
import json
import lzma
import os
import sys
from pathlib import Path

HASH = "adapter.sha256"


def die(msg):
    print(f"study-results: {msg}", file=sys.stderr)
    sys.exit(1)


def write_atomic(path: Path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def settings_grow(old: bytes, new: bytes) -> bool:
    """`new` holds every part of `old`, unchanged."""
    try:
        a, b = json.loads(old), json.loads(new)
    except ValueError:
        return False
    return isinstance(a, dict) and isinstance(b, dict) and all(k in b and b[k] == v for k, v in a.items())


def grows(name: str, old: bytes, new: bytes) -> bool:
    return (name == "log.txt" and new.startswith(old)) or (name == "settings.json" and settings_grow(old, new))


def decide(data: bytes, dst: Path, what: str):
    """What to do with `data` for `dst`: 'write', 'skip', or a refusal (str)."""
    if not dst.exists():
        return "write"
    old = dst.read_bytes()
    name = dst.name
    if name.endswith(".xz"):
        same = lzma.decompress(old) == lzma.decompress(data)
    else:
        same = old == data
    if same:
        return "skip"
    if grows(name, old, data):
        return "write"
    if grows(name, data, old):
        return "skip"  # the destination went on further: it is kept
    if name in ("study.json", "study.md") or name.endswith(".png"):
        return "write"
    return f"{dst} exists and differs from {what}: not replaced (a finished result never changes; move it away first)"


def kept(rel: Path, src: Path) -> bool:
    """Whether a file of the study directory is one the results keep."""
    parts = rel.parts
    if len(parts) == 1:
        return rel.name in ("study.json", "study.md") or rel.suffix == ".png"
    if "checkpoints" in parts or "adapter" in parts or "reproduce" in parts:
        return False
    name = rel.name
    if name in ("settings.json", "log.txt"):
        return True
    if parts[-2] == "train":
        if name == HASH:
            return True  # a kept cell's hash, restored earlier
        # the settings and metrics of a finished training only (its adapter is there)
        return name in ("config.toml", "metrics.jsonl") and (src.parent / "adapter" / "adapter_model.safetensors").exists()
    if parts[-2].startswith("eval-") and name in ("results.json", "results.md", "predictions.jsonl"):
        # a finished evaluation only (results.json is written last)
        return (src.parent / "results.json").exists()
    return False


def cell_of(rel: Path):
    """The cell directory a file belongs to (base, cells/NAME), or None for the report."""
    if rel.parts[0] == "base" and len(rel.parts) > 1:
        return Path("base")
    if rel.parts[0] == "cells" and len(rel.parts) > 2:
        return Path(*rel.parts[:2])
    return None


def adapter_id(cell: Path):
    """The adapter a cell's results belong to: its adapter's hash, or the one kept with it."""
    a = cell / "train" / "adapter" / "adapter_model.safetensors"
    if a.exists():
        return sha256(a)
    h = cell / "train" / HASH
    return h.read_text().strip() if h.exists() else None


def has_results(cell: Path) -> bool:
    return any(True for _ in cell.glob("eval-*/results.json"))


def check_cells(a: Path, b: Path, cells, a_name: str, b_name: str):
    """Refuse any cell whose results on the two sides may belong to two adapters."""
    for cell in sorted(cells):
        if cell.parts[0] != "cells" or not (b / cell).exists():
            continue
        ia, ib = adapter_id(a / cell), adapter_id(b / cell)
        if ia is None and ib is None:
            continue
        if ia != ib and (has_results(a / cell) or has_results(b / cell)):
            die(
                f"{cell}: {a_name} and {b_name} hold it with different adapters ({ia or 'no hash'} vs {ib or 'no hash'}): "
                f"their results cannot be one cell. Nothing was written; keep one of them (move the other away)."
            )


def apply(plan):
    refusals = [d for _, _, d in plan if d not in ("write", "skip")]
    if refusals:
        die(refusals[0] + (f" (and {len(refusals) - 1} more)" if len(refusals) > 1 else "") + "; nothing was written")
    n = 0
    for data, dst, d in plan:
        if d == "write":
            write_atomic(dst, data)
            n += 1
    return n


def save(out: Path, dest: Path):
    plan = []
    cells = set()
    for src in sorted(p for p in out.rglob("*") if p.is_file()):
        rel = src.relative_to(out)
        if not kept(rel, src):
            continue
        data = src.read_bytes()
        if rel.name == "predictions.jsonl":
            rel = rel.with_name("predictions.jsonl.xz")
            # no time stamp in an .xz stream: the same answers give the same bytes here
            data = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
        if cell_of(rel):
            cells.add(cell_of(rel))
        plan.append((data, dest / rel, str(src)))
    # each finished training's adapter by its hash: what a training again must reproduce
    for adapter in sorted(out.glob("cells/*/train/adapter/adapter_model.safetensors")):
        rel = adapter.relative_to(out).parent.parent / HASH
        cells.add(cell_of(rel))
        plan.append(((sha256(adapter) + "\n").encode(), dest / rel, str(adapter)))
    check_cells(out, dest, cells, str(out), str(dest))
    n = apply([(data, dst, decide(data, dst, what)) for data, dst, what in plan])
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"study-results: {n} files of {out} written to {dest} ({size / 1e6:.1f} MB kept there)")


def restore(dest: Path, out: Path):
    files = sorted(p for p in dest.rglob("*") if p.is_file())
    if not files:
        die(f"{dest} holds no kept results")
    cells = {cell_of(p.relative_to(dest)) for p in files} - {None}
    for cell in sorted(cells):
        train = out / cell / "train"
        if (train / "checkpoints").exists() and not (train / "adapter").exists():
            die(
                f"{out / cell} has a training of its own under way (checkpoints, no adapter yet): the kept results of "
                f"{dest / cell} could be mixed with another adapter's. Nothing was written; restore into another OUT, or move that cell away first."
            )
    check_cells(dest, out, cells, str(dest), str(out))
    plan = []
    for src in files:
        rel = src.relative_to(dest)
        data = src.read_bytes()
        if rel.name == "predictions.jsonl.xz":
            rel = rel.with_name("predictions.jsonl")
            data = lzma.decompress(data)
        plan.append((data, out / rel, decide(data, out / rel, str(src))))
    n = apply(plan)
    print(f"study-results: {n} files of {dest} laid under {out}")


def main(argv):
    if len(argv) != 4 or argv[1] not in ("save", "restore"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        sys.exit(2)
    src, dst = Path(argv[2]), Path(argv[3])
    if not src.is_dir():
        die(f"{src} is not a directory")
    (save if argv[1] == "save" else restore)(src, dst)


if __name__ == "__main__":
    main(sys.argv)
