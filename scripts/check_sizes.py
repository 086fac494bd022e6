#!/usr/bin/env python3
"""scripts/check_sizes.py: size limits of the sources (part of scripts/test.sh).

Prints every file under src/ longer than 700 lines and every function longer than 150 lines, and exits non-zero
if there is one (functions listed in ALLOWED are printed but pass). Functions are found with a brace-matching scan
of C++/CUDA: comments, string and character literals and preprocessor lines are blanked first; a brace block at
namespace or class scope whose header has a parameter list (and no `=`) is a function, counted from the first
line of its header to its closing brace; lambdas and local classes are counted inside their enclosing function.
Usage: check_sizes.py [--max-file N] [--max-function N] [PATH ...]   (default PATH: src; files or folders)
"""
import argparse
import os
import re
import sys

EXTS = (".h", ".hpp", ".cuh", ".c", ".cc", ".cpp", ".cu")
# Functions over the limit not yet split (path:function): reported, not failed. Remove an entry once it is split.
ALLOWED = set()


def blank_noncode(text):
    """Returns text with comments, literals and preprocessor lines replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c == "#" or (line_start and c in " \t" and text[i:].lstrip(" \t").startswith("#")):
            # A preprocessor directive, with its backslash continuations.
            while i < n:
                if text[i] == "\n":
                    if i > 0 and text[i - 1] == "\\":
                        out.append("\n")
                        i += 1
                        continue
                    break
                out.append(" ")
                i += 1
            continue
        if text.startswith("//", i):
            while i < n and text[i] != "\n":
                out.append(" ")
                i += 1
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.extend(ch if ch == "\n" else " " for ch in text[i:j])
            i = j
            continue
        m = re.match(r'R"([^(\s]{0,16})\(', text[i:i + 20])
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.extend(ch if ch == "\n" else " " for ch in text[i:j])
            i = j
            continue
        if c in "\"'":
            # A digit separator (1'000) is not a character literal.
            if c == "'" and i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum():
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c)
            out.extend(" " for _ in range(j - i - 2))
            out.append(c if j - i >= 2 else "")
            i = j
            continue
        out.append(c)
        line_start = c == "\n" or (line_start and c in " \t")
        i += 1
    return "".join(out)


def strip_template_params(header):
    """Removes `template <...>` parameter lists (which may hold `class`, `=` and parentheses)."""
    while True:
        m = re.search(r"\btemplate\s*<", header)
        if not m:
            return header
        depth, j = 1, m.end()
        while j < len(header) and depth:
            depth += {"<": 1, ">": -1}.get(header[j], 0)
            j += 1
        header = header[:m.start()] + " " + header[j:]


def top_level(header):
    """Returns header with the contents of (), [] and {} groups removed (the brackets kept)."""
    out, depth = [], 0
    for ch in header:
        if ch in "([{":
            if depth == 0:
                out.append(ch)
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                out.append(ch)
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def classify(header):
    """Kind of the block a `{` opens after `header` at namespace or class scope."""
    h = strip_template_params(header).strip()
    t = top_level(h)
    if re.match(r"^(inline\s+)?namespace\b", t) or re.match(r'^extern\s*""\s*$', t):
        return "namespace"
    head = t.split("(")[0]
    if re.search(r"\b(class|struct|union)\b", head) and "=" not in head:
        return "class"
    if re.search(r"\benum\b", head):
        return "other"
    if "(" in t and not re.search(r"(?<![=!<>])=(?!=)", t.replace("operator=", "operator")):
        return "function"
    return "other"


def scan(path):
    """Yields (name, first_line, last_line) for every function definition in the file."""
    with open(path, encoding="utf-8", errors="replace") as f:
        code = blank_noncode(f.read())
    stack = []  # kinds of the open blocks: namespace, class, function, other
    header_start = 0  # offset where the current declaration's header begins
    func = None  # (name, start offset, depth) of the function being counted
    i, n = 0, len(code)
    line_of = lambda off: code.count("\n", 0, off) + 1
    while i < n:
        c = code[i]
        in_scope = not stack or stack[-1] in ("namespace", "class")
        if c == "{":
            if func is None and in_scope:
                header = code[header_start:i]
                kind = classify(header)
                if kind == "function":
                    name = re.findall(r"([~\w:]+(?:\s*<[^()]*>)?|operator\s*\S+)\s*\(", top_level(
                        strip_template_params(header)).replace("()", "("))
                    start = header_start + len(header) - len(header.lstrip())
                    func = (name[-1] if name else "?", start, len(stack))
                stack.append(kind)
            else:
                stack.append("other")
            if stack[-1] != "other" or func is not None:
                header_start = i + 1
        elif c == "}":
            if not stack:
                raise SyntaxError(f"{path}:{line_of(i)}: unmatched '}}'")
            kind = stack.pop()
            if func is not None and len(stack) == func[2]:
                yield func[0], line_of(func[1]), line_of(i)
                func = None
                header_start = i + 1
            elif kind != "other" and func is None:
                header_start = i + 1
        elif c == ";" and func is None and in_scope:
            header_start = i + 1
        elif c == ":" and func is None and in_scope and re.search(
                r"\b(public|private|protected)\s*$", code[header_start:i]):
            header_start = i + 1
        i += 1
    if stack:
        raise SyntaxError(f"{path}: {len(stack)} unclosed '{{'")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-file", type=int, default=700)
    ap.add_argument("--max-function", type=int, default=150)
    ap.add_argument("roots", nargs="*", default=["src"])
    args = ap.parse_args()
    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    bad = 0
    paths = []
    for root in args.roots:
        if os.path.isfile(root):
            paths.append(root)
        for dirpath, _, files in sorted(os.walk(root)):
            paths += [os.path.join(dirpath, name) for name in sorted(files) if name.endswith(EXTS)]
    for path in paths:
        if not path.endswith(EXTS):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            nlines = sum(1 for _ in f)
        if nlines > args.max_file:
            print(f"{path}: file of {nlines} lines (limit {args.max_file})")
            bad += 1
        try:
            for fname, first, last in scan(path):
                if last - first + 1 > args.max_function:
                    allowed = f"{os.path.normpath(path)}:{fname}" in ALLOWED
                    print(f"{path}:{first}: function {fname} of {last - first + 1} lines "
                          f"(limit {args.max_function}){' (allowed: not yet split)' if allowed else ''}")
                    bad += 0 if allowed else 1
        except SyntaxError as e:
            print(f"{e} (the scan could not match braces)")
            bad += 1
    print(f"check_sizes: {bad} over the limits" if bad else "check_sizes: ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
