#!/usr/bin/env python3
"""scripts/lm_report.py: tables and an SVG plot from the eval.json files of `pathattn eval --seq-len`.

    python3 scripts/lm_report.py --svg results/extrapolation.svg LABEL=RUN_DIR/eval.json ...

Prints markdown: loss per evaluation length (mean over whole windows, nats per byte) with the ratio of the
loss at 8x T_train to the loss at T_train (separate window sets, and within the same 8x windows), and the
loss per position bucket of the longest evaluation.
The SVG has two panels: the loss per position bucket of the longest evaluation, and the window loss against
the evaluation length. Standard library only; every number comes from the files named.
"""
import argparse
import json
import math

COLORS = {"rope": "#d62728", "path": "#1f77b4", "fox": "#2ca02c", "path-fox": "#9467bd"}
PALETTE = ["#1f77b4", "#9467bd", "#d62728", "#17becf", "#2ca02c", "#ff7f0e"]


def color(runs, d):
    """By attention kind, unless two runs of one kind differ by more than the seed: then by position."""
    kinds = [r["attn"] for r in runs]
    stems = {r["label"].rsplit("_s", 1)[0] for r in runs if r["attn"] == d["attn"]}
    if kinds.count(d["attn"]) > 1 and len(stems) > 1:
        return PALETTE[runs.index(d) % len(PALETTE)]
    return COLORS.get(d["attn"], "#333")


def load(arg):
    label, _, path = arg.partition("=")
    with open(path) as f:
        d = json.load(f)
    d["label"], d["path"] = label, path
    d["by_len"] = {r["seq_len"]: r["val"] for r in d["lengths"]}
    return d


def ratio(d, num, den):
    a, b = d["by_len"].get(num), d["by_len"].get(den)
    return a["loss"] / b["loss"] if a and b else float("nan")


def same_window_ratios(d, L, t0):
    """From the L-byte windows alone: (mean over all positions) / (mean over the first t0 - 1 positions), and
    (mean over the last bucket) / (mean over the first bucket). By causality the first t0 - 1 positions of a
    window are exactly what a t0-byte evaluation of that window's start would score, so these compare
    lengths on the same text."""
    v = d["by_len"].get(L)
    if not v:
        return float("nan"), float("nan")
    first = v["loss_by_bucket"][0]
    return v["loss"] / first, v["loss_by_bucket"][-1] / first


def tables(runs):
    lens = sorted({L for d in runs for L in d["by_len"]})
    t0 = runs[0]["train_seq_len"]
    out = []
    head = "| model | attn | params | step | " + " | ".join(f"{L // t0}x ({L})" for L in lens)
    head += " | 8x / 1x | 8x / 1x, same windows | last bucket / first, same windows |"
    out += [head, "|" + "---|" * (len(lens) + 7)]
    for d in runs:
        cells = [f"{d['by_len'][L]['loss']:.4f}" if L in d["by_len"] else "-" for L in lens]
        r8 = ratio(d, 8 * t0, t0)
        rs, rl = same_window_ratios(d, 8 * t0, t0)
        out.append(f"| {d['label']} | {d['attn']} | {d['params']} | {d['step']} | " + " | ".join(cells) +
                   f" | {r8:.3f} | {rs:.3f} | {rl:.3f} |")
    longest = max(lens)
    nb = max(len(d["by_len"][longest]["loss_by_bucket"]) for d in runs if longest in d["by_len"])
    show = [k for k in (0, 1, 3, 7, 15, 31, 63) if k < nb]
    b = runs[0]["by_len"][longest]["bucket"]
    out += ["", f"Loss per position bucket ({b} positions each) of the {longest}-byte windows:", ""]
    out.append("| model | " + " | ".join(f"[{k * b}, {(k + 1) * b})" for k in show) + " |")
    out.append("|" + "---|" * (len(show) + 1))
    for d in runs:
        v = d["by_len"].get(longest)
        if not v:
            continue
        out.append(f"| {d['label']} | " + " | ".join(f"{v['loss_by_bucket'][k]:.4f}" for k in show) + " |")
    return "\n".join(out)


def svg(runs, path, title):
    W, H, pad = 980, 380, 60
    pw = (W - 3 * pad) / 2
    ph = H - 2 * pad
    lens = sorted({L for d in runs for L in d["by_len"]})
    longest = max(lens)
    curves1, curves2 = [], []
    for d in runs:
        v = d["by_len"].get(longest)
        if v:
            b = v["bucket"]
            curves1.append((d, [((k + 0.5) * b, y) for k, y in enumerate(v["loss_by_bucket"])]))
        curves2.append((d, [(L, d["by_len"][L]["loss"]) for L in lens if L in d["by_len"]]))
    ys = [y for _, c in curves1 + curves2 for _, y in c]
    y0, y1 = min(ys), max(ys)
    y0, y1 = y0 - 0.05 * (y1 - y0), y1 + 0.05 * (y1 - y0)
    s = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{W}' height='{H}' font-family='sans-serif' "
         "font-size='11'>", f"<rect width='{W}' height='{H}' fill='white'/>",
         f"<text x='{W / 2}' y='18' text-anchor='middle' font-size='14'>{title}</text>"]

    def panel(ox, curves, xlabel, ptitle, xs):
        lx0, lx1 = math.log2(min(xs)), math.log2(max(xs))
        X = lambda x: ox + (math.log2(x) - lx0) / (lx1 - lx0) * pw
        Y = lambda y: pad + (1 - (y - y0) / (y1 - y0)) * ph
        s.append(f"<rect x='{ox}' y='{pad}' width='{pw}' height='{ph}' fill='none' stroke='#444'/>")
        s.append(f"<text x='{ox + pw / 2}' y='{pad - 8}' text-anchor='middle'>{ptitle}</text>")
        s.append(f"<text x='{ox + pw / 2}' y='{H - 18}' text-anchor='middle'>{xlabel}</text>")
        k = 2 ** math.ceil(lx0)
        while k <= 2 ** lx1 + 1e-9:
            s.append(f"<line x1='{X(k):.1f}' y1='{pad}' x2='{X(k):.1f}' y2='{pad + ph}' stroke='#ddd'/>")
            s.append(f"<text x='{X(k):.1f}' y='{pad + ph + 14}' text-anchor='middle'>{k}</text>")
            k *= 2
        for i in range(6):
            yv = y0 + (y1 - y0) * i / 5
            s.append(f"<text x='{ox - 4}' y='{Y(yv) + 4:.1f}' text-anchor='end'>{yv:.2f}</text>")
        t0 = runs[0]["train_seq_len"]
        if min(xs) <= t0 <= max(xs):
            s.append(f"<line x1='{X(t0):.1f}' y1='{pad}' x2='{X(t0):.1f}' y2='{pad + ph}' stroke='#888' "
                     "stroke-dasharray='2,3'/>")
        for d, c in curves:
            col = color(runs, d)
            dash = " stroke-dasharray='6,3'" if d["label"].endswith("_s2") else ""
            pts = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in c)
            s.append(f"<polyline points='{pts}' fill='none' stroke='{col}' stroke-width='1.6'{dash}/>")

    xs1 = [x for _, c in curves1 for x, _ in c]
    panel(pad, curves1, f"position in a {longest}-byte window (bucket centre)", "loss per position bucket (nats/byte)",
          xs1)
    panel(2 * pad + pw, curves2, "evaluation length (bytes)", "loss over whole windows (nats/byte)", lens)
    for i, d in enumerate(runs):
        col = color(runs, d)
        s.append(f"<text x='{pad + 8}' y='{pad + 14 + 13 * i}' fill='{col}'>{d['label']}</text>")
    s.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(s) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=path/to/eval.json")
    ap.add_argument("--svg", help="write the plot here")
    ap.add_argument("--title", default="byte-level LM on Linux C source: loss beyond the training length")
    a = ap.parse_args()
    runs = [load(r) for r in a.runs]
    print(tables(runs))
    if a.svg:
        svg(runs, a.svg, a.title)


if __name__ == "__main__":
    main()
