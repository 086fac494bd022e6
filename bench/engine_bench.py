"""bench/engine_bench.py: the C++ training engine (`pathattn train`) against the same model in PyTorch
(pathattn.models.PaTHForCausalLM, torch.compile, bf16 autocast, AdamW with the engine's hyperparameters), on
one device in one run: same architecture, batch size, sequence length and kind of data. Prints a markdown
table (tokens/s, words/s, engine / PyTorch) and writes it to --out. Benchmarks never gate anything.

    python bench/engine_bench.py --pathattn build-cuda-apps/apps/pathattn            # on a GPU
    python bench/engine_bench.py --device cpu --tiny --steps 2 --pathattn build/apps/pathattn   # smoke test
"""
import argparse
import csv
import datetime
import glob
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each configuration: the engine's config (a file or a preset) and its `--set` overrides. The PyTorch side
# reads the same values (engine_model_config below), so the two sides cannot drift apart.
#   lm: a language-model-like setup: byte-level text (the repository's own docs), width 512, 4 layers,
#       8 heads of 64, T = 1024, 16 sequences a step (w rank 32: the rank pathattn.models has).
#   a5: the A5 word problem as the engine's GPU runs train it (results/a5.md, "GPU, length 10, 2 layers"):
#       repro_a5_small (width 128, 2 heads) with 2 layers, words of length 10, 512 words a step, lr 2e-3.
CONFIGS = {
    "lm": {
        "config": "configs/bytes_linux_small.json",
        "sets": {"model.d_model": 512, "model.n_layer": 4, "model.n_head": 8, "model.w_rank": 32,
                 "task.seq_len": 1024, "train.batch_size": 16, "train.threads": 0},
        "tiny": {"model.d_model": 64, "model.n_layer": 1, "model.n_head": 2, "task.seq_len": 64,
                 "train.batch_size": 2},
    },
    "a5": {
        "preset": "repro_a5_small",
        "sets": {"model.n_layer": 2, "task.seq_len": 10, "train.batch_size": 512, "train.lr": 2e-3,
                 "train.warmup_steps": 300},
        "tiny": {"train.batch_size": 8},
    },
}

# Engine defaults (docs/engine.md) for the keys the PyTorch side needs and a config may leave unset.
ENGINE_DEFAULTS = {
    "model": {"attn": "path", "d_model": 64, "n_layer": 1, "n_head": 2, "n_kv_head": 0, "head_dim": 0,
              "mlp_hidden": 0, "tie_embeddings": True, "w_rank": 32, "norm_eps": 1e-5, "init_std": 0.02},
    "task": {"seq_len": 0},
    "train": {"batch_size": 16, "lr": 3e-3, "min_lr_ratio": 0.1, "warmup_steps": 50, "weight_decay": 0.1,
              "beta1": 0.9, "beta2": 0.95, "adam_eps": 1e-8, "grad_clip": 1.0, "seed": 1},
}
A5_ORDER = 60


def doc_files():
    """The text the lm configuration trains on: README.md and docs/*.md, paths relative to the root."""
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def config_sets(name, tiny, steps, device, extra):
    """The `--set` overrides of one configuration: its own, the tiny ones, --engine-set's (extra), and those
    of a timing run."""
    c = CONFIGS[name]
    sets = dict(c["sets"])
    if tiny:
        sets.update(c["tiny"])
    if name == "lm":
        sets["task.files"] = doc_files()
        sets["task.eval_sequences"] = 4
    else:
        sets["task.eval_sequences"] = 64
    sets.update(extra)
    sets.update({"train.steps": steps, "train.log_every": 1, "train.eval_every": 0, "train.checkpoint_every": 0,
                 "train.device": "cuda" if device.startswith("cuda") else "cpu"})
    return sets


def engine_model_config(name, sets):
    """The resolved engine config (the file or preset overlaid with sets) as {section: {key: value}}."""
    c = CONFIGS[name]
    cfg = {k: dict(v) for k, v in ENGINE_DEFAULTS.items()}
    base = {}
    if "config" in c:
        with open(os.path.join(ROOT, c["config"])) as f:
            base = json.load(f)
    else:
        with open(os.path.join(ROOT, "configs", c["preset"] + ".json")) as f:
            base = json.load(f)
    for sec, kv in base.items():
        cfg.setdefault(sec, {}).update(kv)
    for key, val in sets.items():
        sec, k = key.split(".", 1)
        cfg.setdefault(sec, {})[k] = val
    return cfg


def engine_command(binary, name, sets, out_dir):
    """argv of `pathattn train` for one configuration."""
    c = CONFIGS[name]
    cmd = [binary, "train"]
    cmd += ["--config", c["config"]] if "config" in c else ["--preset", c["preset"]]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={json.dumps(v) if not isinstance(v, str) else v}"]
    return cmd + ["--out", out_dir, "--no-progress"]


def run_engine(binary, name, sets, warmup, steps, device):
    """Trains warmup + steps steps; the rate is taken between the metrics lines of step warmup and of the
    last step (elapsed_s since the training loop started), so startup, warm-up and the final evaluation and
    checkpoint are not counted. Returns (seconds for `steps` steps, the command as a string)."""
    env = dict(os.environ)
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]  # the engine runs on the process's device 0
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run")
        cmd = engine_command(binary, name, sets, out)
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"engine failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
        lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if x.strip()]
    el = {j["step"]: j["elapsed_s"] for j in lines if "elapsed_s" in j}
    total = warmup + steps
    if total not in el or (warmup > 0 and warmup not in el):
        raise RuntimeError(f"engine metrics lack step {warmup} or {total}")
    seconds = el[total] - (el[warmup] if warmup > 0 else 0.0)
    shown = [os.path.relpath(binary, ROOT) if os.path.isabs(binary) else binary] + cmd[1:]
    shown[shown.index("--out") + 1] = "DIR"
    return seconds, " ".join(shlex.quote(a) for a in shown)


def engine_kernels(binary, name, sets, device, skip, count):
    """The engine's GPU time by kernel over a window of `count` launches after the first `skip` (Nsight Compute,
    `ncu`, one row per launch): [(kernel, launches, microseconds)] largest first, and the optimizer steps in the
    window (the gradient norm's final kernel runs once a step)."""
    env = dict(os.environ)
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["ncu", "--csv", "--metrics", "gpu__time_duration.sum", "--launch-skip", str(skip), "--launch-count",
               str(count)] + engine_command(binary, name, sets, os.path.join(tmp, "run"))
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ncu failed ({r.returncode}): {' '.join(cmd)}\n{(r.stderr or r.stdout)[-2000:]}")
    return ncu_kernel_times(r.stdout)


def kernel_short_name(name):
    """A demangled kernel name without its return type, parameter list and anonymous namespaces."""
    name = name.strip()
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    name = name.replace("(anonymous namespace)::", "")
    return name[5:] if name.startswith("void ") else name


def ncu_kernel_times(text):
    """`ncu --csv --metrics gpu__time_duration.sum` output (one row per launch) by kernel: [(kernel, launches,
    microseconds)] largest first, and the launches of the engine's once-a-step kernel (sumsq_final)."""
    rows = list(csv.DictReader(x for x in text.splitlines() if x.startswith('"')))
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    total, launches = {}, {}
    for row in rows:
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        k = kernel_short_name(row["Kernel Name"])
        us = float(row["Metric Value"].replace(",", "")) * scale.get(row.get("Metric Unit", "ns"), 1e-3)
        total[k] = total.get(k, 0.0) + us
        launches[k] = launches.get(k, 0) + 1
    steps = sum(n for k, n in launches.items() if "sumsq_final" in k)
    return sorted(((k, launches[k], t) for k, t in total.items()), key=lambda x: -x[2]), steps


def kernel_table(name, kernels, steps, step_seconds, top=25):
    """Markdown lines: the window's kernels by time, per optimizer step, beside the step's wall time."""
    tot = sum(t for _, _, t in kernels)
    per = max(steps, 1)
    out = [f"### {name}: GPU time by kernel, per step ({steps} steps in the window; "
           f"kernels {tot / per:,.0f} us a step against {step_seconds * 1e6:,.0f} us of wall time a step)", "",
           "| kernel | launches a step | us a step | share |", "|---|---|---|---|"]
    for k, n, t in kernels[:top]:
        out.append(f"| `{k[:80]}` | {n / per:.1f} | {t / per:,.1f} | {t / tot:.1%} |")
    if len(kernels) > top:
        rest = sum(t for _, _, t in kernels[top:])
        out.append(f"| ({len(kernels) - top} more) | | {rest / per:,.1f} | {rest / tot:.1%} |")
    return out


def hf_config(cfg):
    """The PaTHConfig of the engine's model, field by field as `pathattn export-hf` writes it."""
    from pathattn.models import PaTHConfig
    m = cfg["model"]
    if m["attn"] != "path":
        raise ValueError(f"model.attn: this benchmark compares PaTH models, got {m['attn']!r}")
    d, nh = m["d_model"], m["n_head"]
    if m["head_dim"] not in (0, d // nh):
        raise ValueError("model.head_dim: pathattn.models has head_dim = d_model / n_head")
    if m["w_rank"] not in (0, 32):
        raise ValueError("model.w_rank: pathattn.models has a rank-32 or a full (0) w projection")
    ffn = m["mlp_hidden"] or ((4 * d * 2 // 3 + 7) // 8) * 8
    vocab = 256 if cfg["task"]["name"] == "bytes" else A5_ORDER
    return PaTHConfig(vocab_size=vocab, hidden_size=d, num_hidden_layers=m["n_layer"], num_heads=nh,
                      num_kv_heads=m["n_kv_head"] or nh, intermediate_size=ffn, norm_eps=m["norm_eps"],
                      initializer_range=m["init_std"], tie_word_embeddings=m["tie_embeddings"],
                      use_forget_gate=False, use_w_shortconv=True, use_low_rank_w=m["w_rank"] == 32,
                      use_cache=False)


def a5_table():
    """[60, 60] products of A5: element k is the k-th even permutation of 0..4 (lexicographic); (a*b)[i] = a[b[i]]."""
    from itertools import permutations
    perms = [p for p in permutations(range(5))
             if sum(p[i] > p[j] for i in range(5) for j in range(i + 1, 5)) % 2 == 0]
    index = {p: i for i, p in enumerate(perms)}
    return torch.tensor([[index[tuple(a[b[i]] for i in range(5))] for b in perms] for a in perms])


def batches(cfg, n, device, seed):
    """n (tokens, targets) pairs of [B, T] int64 on the device, drawn as the engine's task draws them:
    bytes: windows of T + 1 bytes of the training split, every next byte a target; a5: uniform words of T
    elements, the running product at every position."""
    g = torch.Generator().manual_seed(seed)
    B, T = cfg["train"]["batch_size"], cfg["task"]["seq_len"]
    out = []
    if cfg["task"]["name"] == "bytes":
        data = b"".join(open(os.path.join(ROOT, f), "rb").read() for f in cfg["task"]["files"])
        train = torch.frombuffer(bytearray(data[:int(len(data) * 0.9)]), dtype=torch.uint8).long()
        for _ in range(n):
            start = torch.randint(0, train.numel() - T - 1, (B, 1), generator=g)
            win = train[start + torch.arange(T + 1)]
            out.append((win[:, :-1].to(device), win[:, 1:].to(device)))
    elif cfg["task"]["name"] == "a5":
        table = a5_table()
        for _ in range(n):
            x = torch.randint(0, A5_ORDER, (B, T), generator=g)
            y = torch.empty_like(x)
            p = x[:, 0]
            y[:, 0] = p
            for t in range(1, T):
                p = table[p, x[:, t]]
                y[:, t] = p
            out.append((x.to(device), y.to(device)))
    else:
        raise ValueError(f"task.name: this benchmark has bytes and a5 data, got {cfg['task']['name']!r}")
    return out


def lr_at(tc, step):
    """The engine's schedule: linear warm-up to lr, then cosine to lr * min_lr_ratio over train.steps."""
    lr, w, S = tc["lr"], tc["warmup_steps"], tc["steps"]
    if step < w:
        return lr * (step + 1) / w
    if S - w <= 1:
        return lr
    frac = min(1.0, (step - w) / (S - w - 1))
    return lr * (tc["min_lr_ratio"] + (1 - tc["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * frac)))


def run_torch(cfg, warmup, steps, device, compile_model, amp):
    """Trains warmup + steps steps of PaTHForCausalLM; returns seconds for the last `steps` (CUDA events on a
    GPU, wall time around synchronised steps on the CPU)."""
    from pathattn.models import PaTHForCausalLM
    torch.manual_seed(cfg["train"]["seed"])
    model = PaTHForCausalLM(hf_config(cfg)).to(device)
    model.train()
    tc = cfg["train"]
    # AdamW as the engine's: decay on matrices and embeddings, not on norms, biases or the w convolution.
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "conv" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "conv" not in n)]
    cuda = device.startswith("cuda")
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc["weight_decay"]},
                             {"params": other, "weight_decay": 0.0}], lr=tc["lr"],
                            betas=(tc["beta1"], tc["beta2"]), eps=tc["adam_eps"], fused=cuda)
    params = list(model.parameters())

    def loss_of(x, y):
        with torch.autocast(device_type="cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    # A fresh compile per configuration with static shapes: otherwise the second configuration's new shapes
    # would recompile it with dynamic shapes, inside the timed steps.
    torch._dynamo.reset()
    fwd_bwd = torch.compile(loss_of, dynamic=False) if compile_model else loss_of
    data = batches(cfg, 8, device, seed=tc["seed"])

    def step(i):
        x, y = data[i % len(data)]
        loss = fwd_bwd(x, y)
        loss.backward()
        if tc["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, tc["grad_clip"], foreach=True)
        for grp in opt.param_groups:
            grp["lr"] = lr_at(tc, i)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize(device)
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for i in range(warmup, warmup + steps):
            loss = step(i)
        t1.record()
        torch.cuda.synchronize(device)
        seconds = t0.elapsed_time(t1) / 1e3
    else:
        start = time.perf_counter()
        for i in range(warmup, warmup + steps):
            loss = step(i)
        seconds = time.perf_counter() - start
    if not math.isfinite(loss.item()):
        raise RuntimeError("PyTorch loss is not finite")
    del model, opt, params, data
    if cuda:
        torch.cuda.empty_cache()  # the next engine run gets the whole device
    return seconds


def write_report(lines, out):
    """Prints the markdown lines and writes them to `out` (nothing written where out is '')."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text)


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="lm,a5", help="comma-separated, of: " + ", ".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=50, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 10; 1 with --tiny)")
    ap.add_argument("--out", default="results/bench/engine_h200.md", help="markdown table ('' : print only)")
    ap.add_argument("--pathattn", default="build/apps/pathattn", help="the `pathattn` program (a CUDA build for a GPU)")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine side")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch side")
    ap.add_argument("--no-compile", action="store_true", help="PyTorch without torch.compile")
    ap.add_argument("--no-amp", action="store_true", help="PyTorch in fp32 (default: bf16 autocast)")
    ap.add_argument("--tiny", action="store_true", help="small models and batches (a smoke test)")
    ap.add_argument("--engine-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra engine override for every configuration, e.g. train.matmul=bf16 (repeatable; "
                         "the PyTorch side reads the model and train keys too)")
    ap.add_argument("--kernels", action="store_true",
                    help="also the engine's GPU time by kernel under Nsight Compute (ncu), a window of launches "
                         "after the warm-up steps (engine side only)")
    ap.add_argument("--kernel-window", type=int, default=2000, help="launches in the --kernels window")
    ap.add_argument("--commit", default=None, help="commit to report when git is not available "
                                                           "(else $PATHATTN_COMMIT)")
    args = ap.parse_args()

    names = [c for c in args.configs.split(",") if c]
    for c in names:
        if c not in CONFIGS:
            ap.error(f"--configs: unknown configuration {c!r} (have {', '.join(CONFIGS)})")
    if args.steps < 1:
        ap.error("--steps: must be >= 1")
    if args.kernel_window < 1:
        ap.error("--kernel-window: must be >= 1")
    extra = {}
    for kv in args.engine_set:
        key, eq, val = kv.partition("=")
        if not eq or "." not in key:
            ap.error(f"--engine-set: expected section.key=value, got {kv!r}")
        try:
            extra[key] = json.loads(val)
        except json.JSONDecodeError:
            extra[key] = val
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 10)
    if warmup < 0:
        ap.error("--warmup: must be >= 0")
    if not (args.device == "cpu" or args.device == "cuda" or args.device.startswith("cuda:")):
        ap.error(f"--device: cuda, cuda:N or cpu, got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device: no CUDA device is visible to torch")
    binary = args.pathattn if os.path.isabs(args.pathattn) else os.path.join(os.getcwd(), args.pathattn)
    if not args.no_engine and not os.access(binary, os.X_OK):
        ap.error(f"--pathattn: no executable at {args.pathattn}")
    device = "cuda:0" if args.device == "cuda" else args.device
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = "none (CPU)"

    rows, commands, ktables = [], [], []
    for name in names:
        sets = config_sets(name, args.tiny, warmup + args.steps, args.device, extra)
        cfg = engine_model_config(name, sets)
        B, T = cfg["train"]["batch_size"], cfg["task"]["seq_len"]
        eng = tor = None
        if not args.no_engine:
            sec, cmd = run_engine(binary, name, sets, warmup, args.steps, args.device)
            eng = args.steps / sec
            commands.append(cmd)
            if args.kernels:
                # The window starts after the warm-up's launches, counted from one step's (measured here).
                _, one = engine_kernels(binary, name, config_sets(name, args.tiny, 2, args.device, extra),
                                        args.device, 0, 100000)
                per_step = max(1, int(sum(n for _, n, _ in one) / 2))
                ks, nsteps = engine_kernels(binary, name, sets, args.device, warmup * per_step, args.kernel_window)
                ktables += kernel_table(name, ks, nsteps, sec / args.steps) + [""]
        if not args.no_torch:
            tor = args.steps / run_torch(cfg, warmup, args.steps, device, not args.no_compile, not args.no_amp)
        m = cfg["model"]
        rows.append((name, f"{m['d_model']} / {m['n_layer']} / {m['n_head']}", T, B, eng, tor))
        print(f"{name}: engine {eng} steps/s, torch {tor} steps/s", file=sys.stderr)

    def cell(sps, per_step):
        return "-" if sps is None else f"{sps * per_step:,.0f}"

    engine_side = "CUDA device, fp32" if args.device.startswith("cuda") else "CPU, fp32"
    if extra.get("train.matmul") in ("tf32", "bf16"):
        engine_side += f", {extra['train.matmul'].upper()} GEMMs"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = git_commit() or args.commit or os.environ.get("PATHATTN_COMMIT") or "unknown"
    torch_side = ("torch.compile" if not args.no_compile else "eager") + (", bf16 autocast" if not args.no_amp
                                                                          else ", fp32")
    lines = [f"# Training engine vs PyTorch ({'tiny configurations, ' if args.tiny else ''}{args.device})", "",
             f"- Date: {now}. Commit: {commit}. GPU: {gpu}. torch {torch.__version__}.",
             f"- Engine: `pathattn train` ({engine_side}); "
             f"PyTorch: pathattn.models.PaTHForCausalLM, {torch_side}, AdamW (engine's hyperparameters).",
             f"- Warm-up steps: {warmup}; then {args.steps} timed steps a side. words/s: sequences (a5: words of "
             "the word problem) a second, as the engine's results count them.",
             "- Command: `python " + " ".join(shlex.quote(a) for a in ["bench/engine_bench.py"] + sys.argv[1:]) + "`"]
    lines += [f"- Engine command: `{c}`" for c in commands]
    lines += ["", "| config | width / layers / heads | T | batch | engine tokens/s | PyTorch tokens/s | "
                  "engine words/s | PyTorch words/s | engine / PyTorch |", "|---|---|---|---|---|---|---|---|---|"]
    for name, arch, T, B, eng, tor in rows:
        ratio = f"{eng / tor:.2f}x" if eng and tor else "-"
        lines.append(f"| {name} | {arch} | {T} | {B} | {cell(eng, B * T)} | {cell(tor, B * T)} | {cell(eng, B)} | "
                     f"{cell(tor, B)} | {ratio} |")
    if ktables:
        lines += ["", "## The engine's kernels (`--kernels`: Nsight Compute, gpu__time_duration of each launch)", ""]
        lines += ktables
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
