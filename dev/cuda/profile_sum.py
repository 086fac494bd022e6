"""dev/cuda/profile_sum.py: per-kernel sums over the slices of one call, from the [profile] lines of
dev/cuda/shape.py (or any run with PATHATTN_CUDA_PROFILE=1). A call the workspace limit slices prints one line per
slice and pass; this adds them up per kernel, so that a sliced call can be set against the one-slice split
(--ws-limit-mib -1). Sliced calls run on two streams, so their sums count overlapped time twice.
    python3 dev/cuda/shape.py --K 64 --T 1024 2>&1 | python3 dev/cuda/profile_sum.py
"""
import re
import sys


def main():
    acc, order, slices = {}, [], []
    for line in sys.stdin:
        if line.startswith("[slices]"):
            slices.append(line.strip())
            continue
        m = re.match(r"\[profile\] (\w+):(.*)", line)
        if not m:
            continue
        for name, ms in re.findall(r" ([^;]+?) ([0-9.]+) ms;", m.group(2)):
            key = f"{m.group(1)}:{name}"
            if key not in acc:
                acc[key] = [0.0, 0]
                order.append(key)
            acc[key][0] += float(ms)
            acc[key][1] += 1
    for s in slices:
        print(s)
    for key in order:
        print(f"{key:32s} {acc[key][0]:8.3f} ms over {acc[key][1]} launch(es)")
    print(f"{'sum':32s} {sum(a[0] for a in acc.values()):8.3f} ms")


if __name__ == "__main__":
    main()
