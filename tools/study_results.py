#!/usr/bin/env python3
"""A study's results without its weights: what a machine that keeps nothing but a git checkout
carries from one sitting to the next (docs/STUDY.md, "A study over several machines").

    python3 tools/study_results.py save OUT DEST      keep study OUT's small files in DEST
    python3 tools/study_results.py restore DEST OUT   lay them back under OUT for `study` to go on

Kept per cell: settings.json, log.txt, train/config.toml, train/metrics.jsonl and
train/adapter.sha256 (the SHA-256 of adapter_model.safetensors; both once the training finished)
and every finished evaluation's results.json, results.md and predictions.jsonl (as
predictions.jsonl.xz: the memories make it the big one); at the top the study's study.json,
study.md and plots. Not kept: adapters, checkpoints, an evaluation's plots, locks.

A cell restored without its adapter is reported and finished as it is. An evaluation added to it
needs the adapter that made the others: `study` trains it again apart and adds to the cell only
when the new adapter's bytes have the kept hash (the same binary on the same kind of CPU with the
same threads makes the same bytes); otherwise it refuses.

Nothing is lost or mixed:
- a finished evaluation and a finished training never change: a kept file that differs from the
  one at hand is refused (identical ones are skipped);
- log.txt only grows (the new one must begin with the kept one), settings.json only gains parts
  (every kept part must be there, unchanged); the report (study.*, plots) is derived and follows;
- restore adds nothing to a cell that has a training of its own under OUT (an adapter or a
  checkpoint): its results would be mixed with another adapter's.
"""
import lzma
import os
import sys
from pathlib import Path

def die(msg):
    print(f"study-results: {msg}", file=sys.stderr)
    sys.exit(1)


def write_atomic(path: Path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def settings_grow(old: bytes, new: bytes) -> bool:
    import json

    try:
        a, b = json.loads(old), json.loads(new)
    except ValueError:
        return False
    return isinstance(a, dict) and isinstance(b, dict) and all(k in b and b[k] == v for k, v in a.items())


def put(data: bytes, dst: Path, what: str) -> bool:
    """Write `data` to `dst` by the rules above; True when something was written."""
    if dst.exists():
        old = dst.read_bytes()
        if old == data:
            return False
        name = dst.name
        ok = (
            (name == "log.txt" and data.startswith(old))
            or (name == "settings.json" and settings_grow(old, data))
            or (name in ("study.json", "study.md") or name.endswith(".png"))
        )
        if not ok:
            die(f"{dst} exists and differs from {what}: not replaced (a finished result never changes; move it away first)")
    write_atomic(dst, data)
    return True


def sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return "sha256:" + h.hexdigest()


def kept(rel: Path, src: Path) -> bool:
    """Whether a file of the study directory is one the results keep."""
    parts = rel.parts
    if len(parts) == 1:
        return rel.name in ("study.json", "study.md") or rel.suffix == ".png"
    if "checkpoints" in parts or "adapter" in parts:
        return False
    name = rel.name
    if name in ("settings.json", "log.txt"):
        return True
    if parts[-2] == "train":
        if name == "config.toml":
            return True
        # the metrics of a finished training only (its adapter is there)
        return name == "metrics.jsonl" and (src.parent / "adapter" / "adapter_model.safetensors").exists()
    if parts[-2].startswith("eval-") and name in ("results.json", "results.md", "predictions.jsonl"):
        # a finished evaluation only (results.json is written last)
        return (src.parent / "results.json").exists()
    return False


def save(out: Path, dest: Path):
    n = 0
    for src in sorted(p for p in out.rglob("*") if p.is_file()):
        rel = src.relative_to(out)
        if not kept(rel, src):
            continue
        data = src.read_bytes()
        if rel.name == "predictions.jsonl":
            rel = rel.with_name("predictions.jsonl.xz")
            # no time stamp in an .xz stream: the same answers give the same bytes
            data = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
        n += put(data, dest / rel, str(src))
    # each finished training's adapter by its hash: what a training again must reproduce
    for adapter in sorted(out.glob("cells/*/train/adapter/adapter_model.safetensors")):
        rel = adapter.relative_to(out).parent.parent / "adapter.sha256"
        n += put((sha256(adapter) + "\n").encode(), dest / rel, str(adapter))
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"study-results: {n} files of {out} written to {dest} ({size / 1e6:.1f} MB kept there)")


def has_own_training(cell: Path) -> bool:
    train = cell / "train"
    return (train / "adapter").exists() or (train / "checkpoints").exists()


def cell_of(rel: Path):
    """The cell directory a kept file belongs to (base, cells/NAME), or None for the report."""
    if rel.parts[0] == "base":
        return Path("base")
    if rel.parts[0] == "cells" and len(rel.parts) > 2:
        return Path(*rel.parts[:2])
    return None


def restore(dest: Path, out: Path):
    files = sorted(p for p in dest.rglob("*") if p.is_file())
    if not files:
        die(f"{dest} holds no kept results")
    for src in files:
        cell = cell_of(src.relative_to(dest))
        if cell is not None and cell.parts[0] == "cells" and has_own_training(out / cell):
            die(
                f"{out / cell} has a training of its own (an adapter or checkpoints): the kept results of "
                f"{dest / cell} would be mixed with another adapter's. Restore into another OUT, or move that cell away first."
            )
    n = 0
    for src in files:
        rel = src.relative_to(dest)
        data = src.read_bytes()
        if rel.name == "predictions.jsonl.xz":
            rel = rel.with_name("predictions.jsonl")
            data = lzma.decompress(data)
        n += put(data, out / rel, str(src))
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
