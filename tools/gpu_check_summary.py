#!/usr/bin/env python3
"""The summaries of tools/gpu-check.sh, written from what a stage left in its output folder.

    python3 tools/gpu_check_summary.py contact|bench|train OUT    # writes OUT/summary.md
    python3 tools/gpu_check_summary.py failed-tests OUT STEP      # tests of STEP to rerun alone
    python3 tools/gpu_check_summary.py tag-json SHAPE CASE < FILE  # last JSON line of FILE, tagged
    python3 tools/gpu_check_summary.py selftest [DIR]             # the checks on recorded runs (VERBOSE=1 prints them)

The shell script calls `contact|bench|train` after every step, so a stage killed at any point
still leaves a summary of what finished. Nothing here may stop that: every section is computed
on its own and a section that cannot be (a missing file, a half-written line, a field a
failed run never wrote) says so in the summary instead of raising. Standard library only (it
runs on the GPU machine's python and in CI).

What a stage leaves in OUT (at most 8 files come back from the GPU machine):
    meta.json     stage, commit, start time, budget, nvidia-smi lines, tool versions
    steps.jsonl   {"event": "start"|"end"|"skip", "step": NAME, ...} per step, as it happens
    log.txt       every step's output, streamed, after a "===== step NAME ... =====" header
    device.json   (contact) `infomem-engine device --json`
    conformance.json (contact) the conformance probes' inputs and both devices' results
    bench.jsonl   (bench) one line per model ({"shape", "config"}) and per measurement
    metrics.jsonl (train) the training run's per-step metrics
"""
import json
import os
import re
import sys

HBM = 4.3e12   # bytes/s: device-to-device copy measured on an H200 here
BF16 = 790e12  # FLOP/s: 8192³ bf16 matmul through PyTorch measured on an H200 here


# ---------------------------------------------------------------------------------------------
# reading what a stage left (each reader tolerates a missing file and broken lines)

def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_jsonl(path):
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    v = json.loads(line)
                except ValueError:
                    continue  # a line cut off by a kill
                if isinstance(v, dict):
                    out.append(v)
    except OSError:
        pass
    return out


def read_text(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


HEADER = re.compile(r"^===== step (\S+) .*=====$", re.M)


def log_sections(out):
    """step name -> its output in log.txt (the text after its header, up to the next one)."""
    text = read_text(os.path.join(out, "log.txt"))
    sections = {}
    marks = list(HEADER.finditer(text))
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        sections[m.group(1)] = text[m.end():end]
    return sections


def steps_table(out):
    """Ordered steps: name -> {"status", "rc", "secs", "limit", "why"}."""
    steps = {}
    for e in read_jsonl(os.path.join(out, "steps.jsonl")):
        name = e.get("step")
        if not name:
            continue
        s = steps.setdefault(name, {"status": "?", "rc": None, "secs": None, "limit": e.get("limit"), "why": None})
        ev = e.get("event")
        if ev == "start":
            s["status"] = "running"
            s["limit"] = e.get("limit", s["limit"])
        elif ev == "end":
            rc = e.get("rc")
            s["rc"], s["secs"] = rc, e.get("secs")
            s["status"] = "ok" if rc == 0 else ("timeout" if rc in (124, 137) else "failed")
        elif ev == "skip":
            s["status"], s["why"] = "skipped", e.get("why")
    return steps


def step_status(s):
    """How a step ended, in words."""
    st = s["status"]
    if st == "running":
        return f"**did not finish** (the stage was stopped while it ran; limit {s.get('limit')} s)"
    if st == "skipped":
        return f"skipped ({s.get('why') or 'time budget'})"
    if st == "timeout":
        return f"**timed out** after {s.get('secs')} s (limit {s.get('limit')} s)"
    rc = s.get("rc")
    sig = f", killed by signal {rc - 128}" if isinstance(rc, int) and 128 < rc < 160 and rc not in (124, 137) else ""
    return f"{st} (rc {rc}{sig}, {s.get('secs')} s)"


def step_line(name, s):
    return f"- `{name}`: {step_status(s)}"


def last_lines(text, n=3):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-n:]


def md_cell(s):
    return str(s).replace("|", "\\|").replace("\n", " ")[:300]


class Doc:
    """Markdown lines; `section` runs a function and turns any exception into a note."""

    def __init__(self):
        self.lines = []

    def add(self, *lines):
        self.lines.extend(lines)

    def section(self, title, fn, *args):
        self.add(f"## {title}", "")
        try:
            fn(self, *args)
        except Exception as e:  # noqa: BLE001 (a summary must never be lost to one section)
            self.add(f"(this section could not be summarized: {type(e).__name__}: {e})")
        self.add("")

    def text(self):
        return "\n".join(self.lines).rstrip() + "\n"


def head(doc, out, stage, title):
    meta = read_json(os.path.join(out, "meta.json")) or {}
    commit = str(meta.get("commit", "?"))[:12]
    doc.add(f"# GPU check — {title} (commit {commit})", "")
    gpu = meta.get("gpu") or "?"
    doc.add(f"Started {meta.get('started', '?')}; stage budget {meta.get('budget_s', '?')} s; GPU: {md_cell(gpu)}  ")
    if meta.get("driver"):
        doc.add(f"nvidia-smi: {md_cell(meta['driver'])}  ")
    doc.add("")
    return meta


def steps_section(doc, out):
    steps = steps_table(out)
    if not steps:
        doc.add("No step was recorded (steps.jsonl is missing or empty).")
    for name, s in steps.items():
        doc.add(step_line(name, s))


# ---------------------------------------------------------------------------------------------
# contact: environment, parity tests, compute-sanitizer

TEST_LINE = re.compile(r"^test (\S+) \.\.\. ?(ok|FAILED|ignored)?", re.M)


def parse_tests(text):
    """libtest output (--test-threads=1) -> ordered {name: "ok"|"FAILED"|"ignored"|"unfinished"},
    {name: first lines of its panic message}."""
    results, detail = {}, {}
    for m in TEST_LINE.finditer(text):
        results[m.group(1)] = m.group(2) or "unfinished"  # crashed, hung or killed mid-test
    # with one thread the harness prints "test X ... " before the test runs and the result after
    # the test's own output, possibly on a later line
    for name, res in list(results.items()):
        if res == "unfinished":
            m = re.search(r"^test " + re.escape(name) + r" \.\.\. (?:.*\n)*?.*?\b(ok|FAILED)$", text, re.M)
            if m:
                results[name] = m.group(1)
    for m in re.finditer(r"^---- (\S+) stdout ----\n((?:.*\n?){0,40})", text, re.M):
        block = m.group(2)
        p = block.find("panicked at")
        if p >= 0:
            lines = []
            for l in block[p:].splitlines()[:4]:
                if not l.strip() or l.startswith("note: run with"):
                    break
                lines.append(l.strip())
            detail[m.group(1)] = " ".join(lines)
    return results, detail


def listed_tests(sections, suite):
    """The test names `SUITE --list` printed (step "list:SUITE"), in order."""
    return [m.group(1) for m in re.finditer(r"^(\S+): test$", sections.get(f"list:{suite}", ""), re.M)]


def suite_results(sections, suite):
    """Results of a suite's parity step, with the listed tests it never reached as "not reached"
    (a process that crashed, or was killed, ends before them)."""
    results, detail = parse_tests(sections.get(f"parity:{suite}", ""))
    for name in listed_tests(sections, suite):
        results.setdefault(name, "not reached")
    return results, detail


def failed_tests(out, step):
    """Tests of a parity step ("parity:SUITE") to rerun one per process: failed, unfinished or
    never reached."""
    suite = step.split(":", 1)[-1]
    results, _ = suite_results(log_sections(out), suite)
    return [n for n, r in results.items() if r in ("FAILED", "unfinished", "not reached")]


def contact_env(doc, out, meta):
    dev = read_json(os.path.join(out, "device.json"))
    if dev:
        keys = ["device", "compute_capability", "multiprocessors", "driver_cuda_version", "libcuda", "cublaslt_version",
                "libcublasLt", "memory_total_gib", "memory_free_gib", "allocator", "allocator_detail", "kernels_nvcc", "kernels"]
        doc.add("| | |", "|---|---|")
        for k in keys:
            if k in dev:
                doc.add(f"| {k} | {md_cell(dev[k])} |")
        for k, v in dev.items():
            if k not in keys:
                doc.add(f"| {k} | {md_cell(v)} |")
    else:
        sec = log_sections(out).get("device", "")
        doc.add("`infomem-engine device` gave no report" + (": " + md_cell(" / ".join(last_lines(sec, 4))) if sec.strip() else "."))
    doc.add("")
    tools = meta.get("tools") or {}
    for k, v in tools.items():
        doc.add(f"- {k}: {md_cell(v)}")


def contact_tests(doc, out):
    sections = log_sections(out)
    steps = steps_table(out)
    total, passed, failed, unfinished = 0, 0, 0, 0
    rows = []
    suites = [n for n in steps if n.startswith("parity:")]
    if not suites:
        doc.add("No parity test ran.")
        return
    for step in suites:
        suite = step[len("parity:"):]
        results, detail = suite_results(sections, suite)
        st = steps[step]
        if not results:
            why = "; ".join(last_lines(sections.get(step, ""), 3)) or st["status"]
            doc.add(f"- `{suite}`: no test result ({step_status(st)}): {md_cell(why)}")
        for name, res in results.items():
            total += 1
            rerun = steps.get(f"rerun:{suite}:{name}")
            note = detail.get(name, "")
            if res in ("FAILED", "unfinished", "not reached") and rerun:
                rres, rdetail = parse_tests(sections.get(f"rerun:{suite}:{name}", ""))
                alone = rres.get(name, rerun["status"])
                if alone == "ok":
                    note = "passed when run alone: collateral of an earlier failure in the same process. " + note
                    res = "ok (alone)"
                else:
                    note = (rdetail.get(name) or note or "; ".join(last_lines(sections.get(f"rerun:{suite}:{name}", ""), 2)))
                    res = f"{res}, alone: {alone}"
            if res.startswith("ok"):
                passed += 1
            elif res.startswith(("unfinished", "not reached")):
                unfinished += 1
            else:
                failed += 1
            rows.append((suite, name, res, note))
    doc.add(f"**{passed} of {total} passed**, {failed} failed, {unfinished} did not finish or were not reached.", "")
    doc.add("| suite | test | result | first lines of the failure |", "|---|---|---|---|")
    for suite, name, res, note in rows:
        mark = res if res.startswith("ok") else f"**{res}**"
        doc.add(f"| {suite} | {name} | {mark} | {md_cell(note)} |")


SAN_SUMMARY = re.compile(r"=+ (ERROR|RACECHECK) SUMMARY: (\d+) (errors?|hazards?)[^\n]*", re.M)


def contact_sanitizer(doc, out, meta):
    steps = steps_table(out)
    sections = log_sections(out)
    names = [n for n in steps if n.split(":")[0] in ("memcheck", "racecheck", "synccheck", "initcheck")]
    if not names:
        have = (meta.get("tools") or {}).get("compute-sanitizer")
        doc.add("compute-sanitizer did not run" + (f" ({have})." if have else "."))
        return
    doc.add("| tool | test | result | findings |", "|---|---|---|---|")
    for n in names:
        tool, _, test = n.partition(":")
        text = sections.get(n, "")
        st = steps[n]
        m = SAN_SUMMARY.search(text)
        if m:
            count = int(m.group(2))
            first = [l.strip("= ").strip() for l in text.splitlines() if l.startswith("=========") and ("Invalid" in l or "hazard" in l.lower() or "Error" in l)][:2]
            res = "clean" if count == 0 else f"**{count} {m.group(3)}**"
            doc.add(f"| {tool} | {test} | {res} | {md_cell(m.group(0).strip('= ')) if count == 0 else md_cell(' / '.join(first) or m.group(0))} |")
        else:
            why = "; ".join(last_lines(text, 2))
            doc.add(f"| {tool} | {test} | {st['status']} | {md_cell(why or step_status(st))} |")


CONF_TALLY = re.compile(r"^(\S+)\s+(\d+) inputs: (\d+) equal, (\d+) NaN bits differ, (\d+) within bound, (\d+) violations$", re.M)


def contact_conformance(doc, out):
    steps = steps_table(out)
    if "conformance" not in steps:
        doc.add("The conformance probes did not run.")
        return
    text = log_sections(out).get("conformance", "")
    doc.add(f"Step: {step_status(steps['conformance'])}. GPU results against the emulator's models "
            "(src/backend/cuda/conformance.rs: exact claims bit for bit, approximations within the PTX ISA bounds).", "")
    rows = CONF_TALLY.findall(text)
    if rows:
        doc.add("| probe | inputs | equal | NaN bits differ | within bound | violations |", "|---|---|---|---|---|---|")
        for r in rows:
            doc.add(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {'**' + r[5] + '**' if r[5] != '0' else '0'} |")
        doc.add("")
    for l in text.splitlines():
        if l.startswith("conformance, mma.sync") or l.startswith("conformance: the emulator cannot run"):
            doc.add(f"- {l[len('conformance, '):] if l.startswith('conformance, ') else l}")
    viol = [l.strip() for l in text.splitlines() if "VIOLATION" in l]
    within = [l.strip() for l in text.splitlines() if l.strip().startswith(("within bound:", "NaN bits differ:", "mma D["))]
    for title, ls in (("Violations", viol), ("Other differences (first 8)", within)):
        if ls:
            doc.add("", f"{title}:", "")
            doc.add(*[f"- {md_cell(l)}" for l in ls[:8]])


def contact_verdict(out):
    sections, steps = log_sections(out), steps_table(out)
    suites = [n[len("parity:"):] for n in steps if n.startswith("parity:")]
    if not suites:
        return "INCOMPLETE: no parity test ran"
    bad, total = [], 0
    for suite in suites:
        results, _ = suite_results(sections, suite)
        total += len(results)
        for name, res in results.items():
            if res == "ok":
                continue
            alone = parse_tests(sections.get(f"rerun:{suite}:{name}", ""))[0].get(name)
            if alone != "ok":
                bad.append(name)
    san = [n for n, st in steps.items() if n.split(":")[0] in ("memcheck", "racecheck")]
    findings = [n for n in san if (m := SAN_SUMMARY.search(sections.get(n, ""))) and int(m.group(2)) > 0]
    running = [n for n, st in steps.items() if st["status"] in ("running", "timeout")
               or (st["status"] == "skipped" and n.startswith("parity:"))]
    if bad or findings:
        return f"FAIL: {len(bad)} of {total} parity tests failed" + (f"; compute-sanitizer findings in {', '.join(findings)}" if findings else "")
    if total == 0 or running:
        return "INCOMPLETE: " + (f"{', '.join(running)} did not finish" if running else "no test result")
    return f"PASS: {total} of {total} parity tests" + (f"; compute-sanitizer clean on {len(san)} runs" if san else "")


def contact(out):
    doc = Doc()
    meta = head(doc, out, "contact", "contact (environment, CUDA parity tests, compute-sanitizer)")
    try:
        doc.add(f"**{contact_verdict(out)}**", "")
    except Exception as e:  # noqa: BLE001
        doc.add(f"(no verdict: {type(e).__name__}: {e})", "")
    doc.section("Environment", contact_env, out, meta)
    doc.section("Conformance probes (GPU vs the emulator's models)", contact_conformance, out)
    doc.section("CUDA parity tests (inference and training)", contact_tests, out)
    doc.section("compute-sanitizer on the attention and q/k-norm RoPE kernels", contact_sanitizer, out, meta)
    doc.section("Steps (in order)", steps_section, out)
    return doc.text()


# ---------------------------------------------------------------------------------------------
# bench: ours vs PyTorch, with roofline fractions

def shape_numbers(c):
    d, L, V, I = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"], c["intermediate_size"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim") or d // nh
    per_layer = d * (nh * hd + 2 * nkv * hd) + (nh * hd + 2 * nkv * hd) + nh * hd * d + 3 * d * I + 2 * d
    body = L * per_layer + d
    head = V * d  # tied or not, the head is a V x d product
    return dict(d=d, L=L, V=V, nh=nh, nkv=nkv, hd=hd, body=body, head=head)


def attn_flops(s, t_ctx0, n_new):
    # causal attention: QK^T and PV, 2 FLOPs per MAC, for n_new queries after t_ctx0 cached keys
    keys = n_new * t_ctx0 + n_new * (n_new + 1) / 2
    return 4 * s["L"] * s["nh"] * s["hd"] * keys


def ideal_seconds(s, r):
    """The workload's time at the roofline: FLOPs / bf16 rate, or bytes / HBM bandwidth."""
    work = r["work"]
    B = r.get("batch") or r.get("rollout_n")
    if work == "train":
        # LoRA training, forward + backward: the frozen weights need the forward (2N per token)
        # and the input gradients (2N), not weight gradients; attention forward + backward (3x);
        # the head on the loss rows only. Recomputation is not counted (model FLOPs).
        T = r["seq_len"]
        last = r.get("score_last") or r.get("loss_tokens_per_seq") or 128
        return (4 * s["body"] * B * T + 3 * B * attn_flops(s, 0, T) + 4 * s["head"] * B * last) / BF16
    if work == "score":
        T, last = r["seq_len"], r.get("score_last") or 64
        return (2 * s["body"] * B * T + B * attn_flops(s, 0, T) + 2 * s["head"] * B * last) / BF16
    kv_tok = s["L"] * 2 * s["nkv"] * s["hd"] * 2  # bf16 K and V of one token, all layers
    wbytes = 2 * (s["body"] + s["head"])
    if work == "rollout":
        # per chunk: the section once (shared prefix) + each rollout's memory, then the memory's
        # decode steps; ideal for the shared-prefix schedule (PyTorch prefills the section n times)
        C = r.get("chunks") or 8
        S = r.get("seq_len") or r.get("chunk_tokens")
        N = r.get("new_tokens") or r.get("memory_tokens")
        t = 0.0
        for c in range(C):
            mem = 0 if c == 0 else N
            t += (2 * s["body"] * (S + B * mem) + attn_flops(s, 0, S) + B * attn_flops(s, S, mem) + 2 * s["head"] * B) / BF16
            for i in range(1, N):
                t += (wbytes + B * (S + mem + i) * kv_tok) / HBM
        return t
    P = r.get("seq_len") or r.get("prompt_len")
    N = r["new_tokens"]
    t = (2 * s["body"] * B * P + B * attn_flops(s, 0, P) + 2 * s["head"] * B) / BF16
    for i in range(1, N):  # decode steps (the first new token comes from the prefill)
        t += (wbytes + B * (P + i) * kv_tok) / HBM
    return t


def bench_rows(out):
    """(shape, case) -> {"ours": rec, "torch": rec}; shape -> config."""
    rows, configs = {}, {}
    for r in read_jsonl(os.path.join(out, "bench.jsonl")):
        if "config" in r and "shape" in r:
            configs[r["shape"]] = r["config"]
            continue
        shape, case = r.get("shape", "?"), r.get("case", r.get("work", "?"))
        side = "ours" if r.get("impl") == "infomem-engine" else "torch"
        rows.setdefault((shape, case), {})[side] = r
    return rows, configs


def bench_table(doc, out):
    rows, configs = bench_rows(out)
    steps = steps_table(out)
    sections = log_sections(out)
    # a side that produced no JSON line: say why from its step ("ours:SHAPE:CASE" runs one case,
    # "torch:SHAPE" all of a shape's cases in one process)
    for name, st in steps.items():
        parts = name.split(":")
        if parts[0] == "ours" and len(parts) == 3:
            r = rows.setdefault((parts[1], parts[2]), {})
            if "ours" not in r:
                why = step_status(st) if st["status"] != "ok" else "finished without a JSON line"
                tail = "; ".join(last_lines(sections.get(name, ""), 2))
                r["ours"] = {"error": why + (f": {tail}" if tail and st["status"] in ("failed", "timeout", "ok") else "")}
    for (shape, case), r in rows.items():
        st = steps.get(f"torch:{shape}")
        if "torch" not in r and st:
            if st["status"] in ("skipped", "running", "timeout"):
                r["torch"] = {"error": step_status(st)}
            elif st["status"] == "failed":
                tail = "; ".join(last_lines(sections.get(f"torch:{shape}", ""), 2))
                r["torch"] = {"error": step_status(st) + (f": {tail}" if tail else "")}
            else:
                r["torch"] = {"error": "no result line for this case"}
    if not rows:
        doc.add("No measurement was recorded.")
        return
    doc.add("| model | workload | ours tok/s | torch tok/s | ours/torch | ours roofline | torch roofline | notes |",
            "|---|---|---:|---:|---:|---:|---:|---|")
    for (shape, case), v in sorted(rows.items()):
        o, t = v.get("ours"), v.get("torch")
        ok = lambda r: bool(r) and "error" not in r and isinstance(r.get("tokens_per_s"), (int, float)) and r.get("seconds")
        notes = []
        for side, r in (("ours", o), ("torch", t)):
            if r and "error" in r:
                notes.append(f"{side}: {r['error']}")
            elif r is None:
                notes.append(f"{side}: not run")
        if ok(t) and t.get("grad_checkpointing"):
            notes.append("torch with gradient checkpointing")
        ideal = None
        base = o if ok(o) else (t if ok(t) else None)
        if base and shape in configs:
            try:
                ideal = ideal_seconds(shape_numbers(configs[shape]), base)
            except (KeyError, TypeError, ZeroDivisionError) as e:
                notes.append(f"roofline not computed ({type(e).__name__}: {e})")
        f = lambda r: f"{r['tokens_per_s']:.0f}" if ok(r) else "—"
        roof = lambda r: f"{ideal / r['seconds']:.1%}" if ok(r) and ideal else "—"
        ratio = f"{o['tokens_per_s'] / t['tokens_per_s']:.2f}×" if ok(o) and ok(t) and t["tokens_per_s"] else "—"
        doc.add(f"| {shape} | {case} | {f(o)} | {f(t)} | {ratio} | {roof(o)} | {roof(t)} | {md_cell('; '.join(notes))} |")
    doc.add("")
    doc.add("Roofline (fraction = ideal time / measured time): train = model-FLOPs utilization, FLOPs =")
    doc.add("4·N·tokens (forward 2N + backward to the inputs 2N, N = non-embedding parameters; frozen weights")
    doc.add("get no weight gradient) + 3 × causal attention + 4·V·d per loss token, over 790 TFLOP/s bf16")
    doc.add("(recomputation not counted); score = (2·N·tokens + causal attention + head on the scored rows) /")
    doc.add("790 TFLOP/s; decode = prefill FLOPs / 790 TFLOP/s + Σ_steps (bf16 weights + K/V read) / 4.3 TB/s;")
    doc.add("rollout = the same per chunk with the section prefilled once. 790 TFLOP/s and 4.3 TB/s were measured")
    doc.add("on an H200 here (KINDS.md). Each side: one warm-up with the timed shapes, then one timed run.")


def bench(out):
    doc = Doc()
    head(doc, out, "bench", "bench (ours vs PyTorch + transformers + PEFT, same GPU, same weights)")
    doc.section("Throughput", bench_table, out)
    doc.section("Steps (in order)", steps_section, out)
    return doc.text()


# ---------------------------------------------------------------------------------------------
# train: GRPO + InfoMem steps on the GPU

def train_metrics(doc, out):
    ms = read_jsonl(os.path.join(out, "metrics.jsonl"))
    if not ms:
        doc.add("No metrics.jsonl: the training run wrote no step (see log.txt).")
        return
    num = lambda m, k: m.get(k) if isinstance(m.get(k), (int, float)) else None
    f = lambda v, p=3: "—" if v is None else f"{v:.{p}f}"
    doc.add("| step | reward | success | gain | loss | grad norm | rollout s | score s | update s | step s | train tok/s | skipped |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for m in ms:
        doc.add(f"| {m.get('step', '?')} | {f(num(m, 'reward_mean'), 4)} | {f(num(m, 'success_rate'))} | {f(num(m, 'gain_mean'), 4)} | "
                f"{f(num(m, 'loss'), 4)} | {f(num(m, 'grad_norm'), 4)} | {f(num(m, 'rollout_s'), 2)} | {f(num(m, 'score_s'), 2)} | "
                f"{f(num(m, 'update_s'), 2)} | {f(num(m, 'step_s'), 2)} | {f(num(m, 'train_tokens_per_s'), 0)} | {md_cell(m.get('skipped') or '')} |")
    tot = {k: sum(num(m, k) or 0 for m in ms) for k in ("rollout_s", "score_s", "update_s", "step_s")}
    st = max(tot["step_s"], 1e-9)
    doc.add("")
    doc.add(f"Time split over {len(ms)} steps ({tot['step_s']:.1f} s): rollout {100 * tot['rollout_s'] / st:.0f}%, "
            f"scoring {100 * tot['score_s'] / st:.0f}%, update {100 * tot['update_s'] / st:.0f}%, other (rewards, "
            f"bookkeeping, checkpoints) {100 * max(st - tot['rollout_s'] - tot['score_s'] - tot['update_s'], 0) / st:.0f}%.  ")
    upd = [m for m in ms if not m.get("skipped")]
    doc.add(f"Updates applied: {len(upd)} of {len(ms)} steps.  ")
    doc.add("Reward curve: " + ", ".join(f(num(m, "reward_mean"), 4) for m in ms) + "  ")
    doc.add("Answer-gain curve (nats/token; the signal a random model can move): " + ", ".join(f(num(m, "gain_mean"), 4) for m in ms))


def train_after(doc, out):
    sections = log_sections(out)
    steps = steps_table(out)
    said = False
    for name in ("rollout", "eval", "check-peft"):
        if name in steps:
            said = True
            doc.add(step_line(name, steps[name]))
            for l in last_lines(sections.get(name, ""), 2):
                doc.add(f"  - `{md_cell(l)}`")
    if not said:
        doc.add("Not run (the training step did not finish).")


def train(out):
    doc = Doc()
    meta = head(doc, out, "train", "train (GRPO + InfoMem steps on the GPU)")
    doc.add(f"Backend {meta.get('backend', 'cuda')}; model: {meta.get('model', 'SmolLM2-135M-shaped random weights, byte-level tokenizer')}.", "")
    doc.section("Training steps", train_metrics, out)
    doc.section("The trained adapter: rollout, eval, PEFT", train_after, out)
    doc.section("Steps (in order)", steps_section, out)
    return doc.text()


def write(stage, out):
    fn = {"contact": contact, "bench": bench, "train": train}[stage]
    try:
        text = fn(out)
    except Exception as e:  # noqa: BLE001 (the last resort: still write a summary)
        text = f"# GPU check — {stage}\n\nThe summary could not be built: {type(e).__name__}: {e}\nSee log.txt and steps.jsonl.\n"
    tmp = os.path.join(out, f".summary.md.{os.getpid()}.tmp")  # two writers may race: last one wins whole
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out, "summary.md"))
    return text


def tag_json(shape, case, text):
    """The last JSON object line of `text` with shape and case added (None if there is none)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                r = json.loads(line)
            except ValueError:
                continue
            r["shape"], r["case"] = shape, case
            return json.dumps(r)
    return None


# ---------------------------------------------------------------------------------------------
# selftest: the code above on recorded runs (tools/gpu-check-selftest/<case>/)

def selftest(root):
    failures = []

    def expect(case, text, *needles, absent=()):
        for n in needles:
            if n not in text:
                failures.append(f"{case}: summary lacks {n!r}")
        for n in absent:
            if n in text:
                failures.append(f"{case}: summary should not contain {n!r}")

    cases = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not cases:
        failures.append(f"no recorded runs under {root}")
    for case in cases:
        src = os.path.join(root, case)
        spec = read_json(os.path.join(src, "expect.json")) or {}
        stage = spec.get("stage") or case.split("-")[0]
        import shutil
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            for f in os.listdir(src):
                if f != "expect.json":
                    shutil.copy(os.path.join(src, f), tmp)
            before = len(failures)
            text = write(stage, tmp)
            if "could not be summarized" in text or "could not be built" in text:
                failures.append(f"{case}: a section raised")
            expect(case, text, *spec.get("contains", []), absent=spec.get("absent", []))
            for step, want in (spec.get("failed_tests") or {}).items():
                got = failed_tests(tmp, step)
                if got != want:
                    failures.append(f"{case}: failed-tests {step}: {got} != {want}")
            if len(failures) > before or os.environ.get("VERBOSE"):
                print(f"--- {case} ({stage}) ---\n{text}")

    # the roofline arithmetic against numbers worked by hand: a 2-layer model, d 64, 4 heads of
    # 16 (kv 2), ffn 128, vocab 1000 -> per layer qkv 64·(64+32+32) = 8,192 + bias 128 + o 64·64
    # = 4,096 + mlp 3·64·128 = 24,576 + norms 128 = 37,120; body 2·37,120 + 64 = 74,304; head 64,000
    cfg = dict(hidden_size=64, num_hidden_layers=2, vocab_size=1000, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=2)
    s = shape_numbers(cfg)
    if (s["body"], s["head"], s["hd"]) != (74304, 64000, 16):
        failures.append(f"shape_numbers: {s}")
    # Qwen3-4B (tools/bench_torch.py's qwen3-4b): head_dim 128 is not hidden/heads = 80, so q is
    # 32·128 = 4096 wide on a 2560 hidden; per layer qkv 2560·(4096+2·1024) = 15,728,640 + 6,144
    # (the bias term, which Qwen3 lacks: ~0.006%) + o 4096·2560 = 10,485,760 + mlp 3·2560·9728 =
    # 74,711,040 + norms 5,120 = 100,936,704; 36 layers + 2560 = 3,633,723,904 (the model card:
    # 3.6B non-embedding parameters)
    q3 = shape_numbers(dict(hidden_size=2560, num_hidden_layers=36, vocab_size=151936, intermediate_size=9728,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128))
    if (q3["body"], q3["head"], q3["hd"]) != (3633723904, 151936 * 2560, 128):
        failures.append(f"shape_numbers (Qwen3-4B): {q3}")
    # score, 1 × 8 tokens, last 2: 2·74304·8 + attention 4·2·4·16·(8·9/2) + 2·64000·2
    want = (2 * 74304 * 8 + 4 * 2 * 4 * 16 * 36 + 2 * 64000 * 2) / BF16
    got = ideal_seconds(s, {"work": "score", "batch": 1, "seq_len": 8, "score_last": 2})
    if abs(got - want) > 1e-18:
        failures.append(f"score ideal {got} != {want}")
    # decode, batch 2, prompt 4, 3 new: prefill FLOPs + 2 steps of (weights + K/V of 2·(4+i) tokens)
    kv = 2 * 2 * 2 * 16 * 2
    want = (2 * 74304 * 2 * 4 + 2 * 4 * 2 * 4 * 16 * 10 + 2 * 64000 * 2) / BF16 + sum((2 * (74304 + 64000) + 2 * (4 + i) * kv) / HBM for i in (1, 2))
    got = ideal_seconds(s, {"work": "decode", "batch": 2, "prompt_len": 4, "new_tokens": 3})
    if abs(got - want) > 1e-18:
        failures.append(f"decode ideal {got} != {want}")
    # the rollout record of either side (PyTorch names the sizes rollout_n/chunk_tokens/memory_tokens)
    a = ideal_seconds(s, {"work": "rollout", "batch": 4, "seq_len": 32, "new_tokens": 8, "chunks": 2})
    b = ideal_seconds(s, {"work": "rollout", "rollout_n": 4, "chunk_tokens": 32, "memory_tokens": 8, "chunks": 2})
    if a != b or not a > 0:
        failures.append(f"rollout ideal differs between the two sides' field names: {a} vs {b}")
    if tag_json("m", "c", 'noise\n{"a": 1}\n{"impl": "x"}\nafter') != json.dumps({"impl": "x", "shape": "m", "case": "c"}):
        failures.append("tag_json does not take the last JSON line")
    if tag_json("m", "c", "no json\n{broken") is not None:
        failures.append("tag_json invents a line")

    if failures:
        print("gpu-check selftest: FAILED", file=sys.stderr)
        for f in failures:
            print(f"  - {f}", file=sys.stderr)
        return 1
    print(f"gpu-check selftest: ok ({len(cases)} recorded runs, roofline arithmetic, JSON tagging)", file=sys.stderr)
    return 0


def main(argv):
    if len(argv) >= 2 and argv[0] in ("contact", "bench", "train"):
        print(write(argv[0], argv[1]), end="")
        return 0
    if len(argv) == 3 and argv[0] == "failed-tests":
        print("\n".join(failed_tests(argv[1], argv[2])))
        return 0
    if len(argv) == 3 and argv[0] == "tag-json":
        line = tag_json(argv[1], argv[2], sys.stdin.read())
        if line is None:
            return 1
        print(line)
        return 0
    if argv and argv[0] == "selftest":
        root = argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu-check-selftest")
        return selftest(root)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
