"""dev/cuda/sass_stats.py: static instruction mix of the CUDA kernels, from `cuobjdump -sass` text.

Kernel work without a GPU at hand: per kernel, the counts of the instructions that matter for the tensor-core
products (HMMA, LDS, LDSM, FSETP: the cvt.rna.tf32 rounding compiles to FSETP + IMAD/SEL per element), and for
the innermost loop that holds HMMA instructions, its length per HMMA (how many instructions each tensor-core
instruction costs to feed). cuobjdump and nvdisasm come with the CUDA toolkit; where the toolkit lacks them,
NVIDIA's wheels carry them (pinned: nvidia-cuda-cuobjdump==13.5.37, nvidia-cuda-nvdisasm==13.5.37; put their
bin/ directories on PATH). Usage:
    cuobjdump -sass build-cuda/libpathattn_capi.so > lib.sass
    python3 dev/cuda/sass_stats.py lib.sass [--match chunk_prep] [--loops]
"""
import argparse
import collections
import re


def functions(text):
    """(name, [(address, instruction)]) per function of a cuobjdump -sass listing."""
    for part in re.split(r"\n\s+Function : ", text)[1:]:
        name = part.split("\n", 1)[0].strip()
        ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,6})\*/\s+([^;]+);", part)]
        yield name, ins


def opcode(ins):
    words = ins.split()
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return op.split(".")[0]


def innermost_hmma_loop(ins):
    """The shortest backward-branch range that contains an HMMA: (length, HMMA count, opcode counts)."""
    best = None
    for addr, t in ins:
        if opcode(t) != "BRA":
            continue
        targets = re.findall(r"0x([0-9a-f]+)", t)
        if not targets or int(targets[-1], 16) >= addr:
            continue
        lo = int(targets[-1], 16)
        body = [x for a, x in ins if lo <= a <= addr]
        n_hmma = sum(opcode(x) == "HMMA" for x in body)
        if n_hmma and (best is None or len(body) < best[0]):
            best = (len(body), n_hmma, collections.Counter(opcode(x) for x in body))
    return best


def short_name(mangled):
    """kernel<dtype, template ints...> from an Itanium-mangled name (enough to tell instantiations apart)."""
    m = re.match(r"_ZN?", mangled)
    pos, idents = (m.end() if m else 0), []
    while pos < len(mangled) and mangled[pos].isdigit():  # <length><identifier>, nested names in order
        digits = re.match(r"\d+", mangled[pos:]).group(0)
        pos += len(digits)
        idents.append(mangled[pos: pos + int(digits)])
        pos += int(digits)
    kernel = next((i for i in reversed(idents) if i.endswith("_kernel")), idents[-1] if idents else None)
    if kernel is None:
        return mangled[:60]
    args = mangled[pos:]
    dtype = "bf16" if "bfloat16" in args else ("fp16" if "half" in args else "")
    ints = re.findall(r"L[ib](\d+)E", args)
    return f"{kernel}<{', '.join(([dtype] if dtype else []) + ints)}>"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sass")
    ap.add_argument("--match", default="", help="only functions whose mangled name contains this")
    ap.add_argument("--loops", action="store_true", help="also the innermost HMMA loop of each function")
    a = ap.parse_args()
    with open(a.sass) as fh:
        text = fh.read()
    print("| function | instructions | HMMA | LDS | LDSM | FSETP | IMAD | per HMMA | innermost HMMA loop |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, ins in functions(text):
        if a.match not in name:
            continue
        ops = collections.Counter(opcode(t) for _, t in ins)
        h = ops["HMMA"]
        loop = ""
        if a.loops:
            best = innermost_hmma_loop(ins)
            if best:
                loop = f"{best[0]} instr / {best[1]} HMMA = {best[0] / best[1]:.1f}"
        short = short_name(name)
        print(f"| {short} | {len(ins)} | {h} | {ops['LDS']} | {ops['LDSM']} | {ops['FSETP']} | {ops['IMAD']} | "
              f"{len(ins) / h if h else 0:.1f} | {loop} |")


if __name__ == "__main__":
    main()
