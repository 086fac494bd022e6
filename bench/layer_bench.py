"""bench/layer_bench.py: a whole attention layer, forward+backward with its projections, on one GPU in one process.

Layers (hidden 2048, 16 heads, head dim 128, bf16 parameters and activations, causal, 32k tokens a step):
  rope      q / k / v / o projections, rotary embedding, torch SDPA on the cuDNN backend (the baseline);
  path      pathattn.nn.PaTHAttention (the CUDA op through the torch custom op);
  path_fox  the same with the forget gate (PaTH-FoX);
  fla       fla.layers.PaTHAttention (flash-linear-attention's Triton kernel), where the package imports.
Beside each layer, the parts of the PaTH layer timed alone (each forward+backward on the shapes the layer makes):
the attention op, the q / k / v / w / beta (/ g) projections, the w preparation (short convolution, SiLU and L2
norm by head: the layer's w_conv_norm op, or its unfused modules where the op does not take the shape) and the
output projection, so the layer's own non-attention cost is visible. The cases of a shape take turns in rounds
(bench/gpu_bench.py's bench_rounds); every cell is the median of every timed run. Writes a markdown table (--out)
and prints it. Benchmarks never gate anything.
    python3 bench/layer_bench.py [--Ts 1024,4096,16384] [--out results/bench/layer_h200.md]
"""
import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench as gb  # noqa: E402

HIDDEN, HEADS, TOKENS = 2048, 16, 32768


class RopeAttention(nn.Module):
    """The baseline: a standard rotary-embedding attention layer of the same width (no bias, as the PaTH layer)."""

    def __init__(self, hidden, heads, device, dtype, theta=10000.0):
        super().__init__()
        fk = dict(bias=False, device=device, dtype=dtype)
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden, **fk), nn.Linear(hidden, hidden, **fk)
        self.v_proj, self.o_proj = nn.Linear(hidden, hidden, **fk), nn.Linear(hidden, hidden, **fk)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
                                        / self.head_dim)

    def rotate(self, x, cos, sin):  # x [B, H, T, D]; rotate-half convention
        x1, x2 = x.chunk(2, dim=-1)
        return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)

    def forward(self, x):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        B, T, _ = x.shape
        shape = (B, T, self.heads, self.head_dim)
        q, k, v = (p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        ang = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * self.inv_freq[None]
        cos, sin = torch.cat((ang, ang), -1).cos().to(x.dtype), torch.cat((ang, ang), -1).sin().to(x.dtype)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


def step_fn(layer, x, dy, unpack):
    """One forward+backward of `layer` on x with output gradient dy; `unpack` takes the output tensor."""
    def fn():
        y = unpack(layer(x))
        y.backward(dy)
    return fn


def part_cases(layer, x, dy):
    """The PaTH layer's pieces, each as a forward+backward on detached inputs of the shapes the layer makes."""
    import pathattn
    with torch.no_grad():
        q, k, v, w_raw, beta, g = layer._project(x)
        w = layer._prepare_w(w_raw, None)
        o, _ = pathattn.parallel_path_attn(q, k, v, w, beta, g)

    def leaf(t):
        return None if t is None else t.detach().clone().requires_grad_()

    def fb(f, inputs, grads):
        def fn():
            outs = f(*inputs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.backward([a for a in outs if a is not None and a.requires_grad],
                                    [gr for a, gr in zip(outs, grads) if a is not None and a.requires_grad])
        return fn, [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]

    xq = leaf(x)
    dq, dk, dv, dw, db = (torch.randn_like(t) for t in (q, k, v, w_raw, beta))
    dg = torch.randn_like(g) if g is not None else None
    cases = {"op": fb(lambda *a: pathattn.parallel_path_attn(*a)[0], [leaf(t) for t in (q, k, v, w, beta, g)],
                      [torch.randn_like(o)]),
             "proj": fb(layer._project, [xq], [dq, dk, dv, dw, db, dg])}
    cases["wprep"] = fb(lambda a: layer._prepare_w(a, None), [leaf(w_raw)], [torch.randn_like(w)])
    cases["o_proj"] = fb(layer._out, [leaf(o)], [dy])
    return cases


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--Ts", default="1024,4096,16384")
    ap.add_argument("--out", default="results/bench/layer_h200.md")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--no-parts", action="store_true", help="time the whole layers only")
    ap.add_argument("--no-fla", action="store_true",
                    help="leave out fla's layer (its Triton kernels compile and autotune for minutes on first use)")
    ap.add_argument("--unfused-w", action="store_true",
                    help="the layer's w preparation by the unfused modules (clears pathattn.nn.FUSED_W_ON_CUDA)")
    args = ap.parse_args()
    import pathattn
    import pathattn.nn
    from pathattn.nn import PaTHAttention
    if args.unfused_w:
        pathattn.nn.FUSED_W_ON_CUDA = False
    if not pathattn.backend_available("cuda"):
        sys.exit("error: pathattn was built without the CUDA backend (or no GPU is visible)")
    FlaPaTH = None
    if not args.no_fla:
        try:
            from fla.layers import PaTHAttention as FlaPaTH
        except Exception as e:  # noqa: BLE001
            print("fla.layers import failed (the fla column stays empty):", e)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    layers = {"rope": RopeAttention(HIDDEN, HEADS, dev, dt),
              "path": PaTHAttention(HIDDEN, HEADS, device=dev, dtype=dt),
              "path_fox": PaTHAttention(HIDDEN, HEADS, use_forget_gate=True, device=dev, dtype=dt)}
    if FlaPaTH is not None:
        try:
            layers["fla"] = FlaPaTH(hidden_size=HIDDEN, num_heads=HEADS).to(dev, dt)
        except Exception as e:  # noqa: BLE001
            print("fla.layers.PaTHAttention could not be built:", e)
    unpack = {"rope": lambda y: y}
    for name in ("path", "path_fox", "fla"):
        unpack[name] = lambda y: y[0]

    lines = [f"# A PaTH attention layer against a RoPE layer on {torch.cuda.get_device_name()}\n",
             f"Date {datetime.date.today()}, commit {os.environ.get('PATHATTN_COMMIT', '?')}, torch {torch.__version__}"
             f", fla {getattr(sys.modules.get('fla'), '__version__', '-')}. Command: `bench/layer_bench.py"
             f"{gb.shown_flags()}`. Hidden {HIDDEN}, {HEADS} heads of {HIDDEN // HEADS}, bf16, causal, {TOKENS} "
             f"tokens a step, forward+backward of the layer with its projections; each cell the median of every "
             f"timed run over {args.rounds} rounds in which the cases of a shape take turns (bench_rounds).\n",
             "| T | B | RoPE (cuDNN) ms | PaTH ms | PaTH-FoX ms | fla PaTH ms | PaTH / RoPE | PaTH-FoX / RoPE "
             "| fla / PaTH | runs a cell |", "|---|---|---|---|---|---|---|---|---|---|"]
    part_lines = ["", "## The PaTH layers' parts (forward+backward of each piece alone, ms)\n",
                  "op: pathattn's attention op; proj: the q, k, v, w, beta (and g) projections with beta's sigmoid "
                  "and g's log-sigmoid; wprep: w's short convolution, SiLU and L2 norm by head (the w_conv_norm op; "
                  "its gradient reaches the convolution's weight too); o_proj: the output projection; rest: the whole "
                  "layer less these parts (autograd glue, casts, copies).\n",
                  "| T | layer | layer | op | proj | wprep | o_proj | rest | op share |",
                  "|---|---|---|---|---|---|---|---|---|"]
    for T in (int(t) for t in args.Ts.split(",")):
        B = max(1, TOKENS // T)
        x = torch.randn(B, T, HIDDEN, device=dev, dtype=dt, requires_grad=True)
        dy = torch.randn(B, T, HIDDEN, device=dev, dtype=dt)
        cases = {}
        for name, layer in layers.items():
            cases[name] = (step_fn(layer, x, dy, unpack[name]), [x] + list(layer.parameters()))
        if not args.no_parts:
            for name in ("path", "path_fox"):
                for part, (fn, gtn) in part_cases(layers[name], x, dy).items():
                    cases[f"{name}:{part}"] = (fn, gtn)
        res = gb.bench_rounds(cases, args.rounds, args.runs, may_fail=("fla",))
        ms = {key: gb.median_ms(r) for key, r in res.items()}
        m = {key: v[0] for key, v in ms.items()}
        nan = float("nan")
        fla = m.get("fla", nan)
        lines.append(f"| {T} | {B} | {m['rope']:.2f} | {m['path']:.2f} | {m['path_fox']:.2f} | {fla:.2f} | "
                     f"{m['path'] / m['rope']:.2f} | {m['path_fox'] / m['rope']:.2f} | {fla / m['path']:.2f} | "
                     f"{min(v[1] for v in ms.values())} |")
        if not args.no_parts:
            for name in ("path", "path_fox"):
                parts = [m.get(f"{name}:{p}", 0.0) for p in ("op", "proj", "wprep", "o_proj")]
                rest = m[name] - sum(parts)
                part_lines.append(f"| {T} | {name} | {m[name]:.2f} | " + " | ".join(f"{p:.2f}" for p in parts)
                                  + f" | {rest:.2f} | {parts[0] / m[name]:.2f} |")
        print("\n".join(lines[-1:]), flush=True)
        del x, dy
        torch.cuda.empty_cache()
    text = "\n".join(lines + ([] if args.no_parts else part_lines)) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
