#!/usr/bin/env python3
"""scripts/check_links.py: every relative link in the repository's markdown files must name a file in the repository.

Checks inline links [text](target) and reference definitions [name]: target outside code spans and fenced code
blocks; web links (http, https, mailto) and in-page anchors (#...) are not followed, and an anchor after a
path is ignored. Prints each broken link as FILE:LINE: target and exits 1 if there is one.
    python3 scripts/check_links.py [ROOT]
"""
import os
import re
import subprocess
import sys

INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
SKIP_DIRS = {".git", "runs", "dist", "__pycache__", "node_modules"}


def markdown_files(root):
    """Tracked and untracked-but-not-ignored .md files (git), else a walk that skips build outputs."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             check=True, capture_output=True).stdout.decode()
        files = [f for f in out.split("\0") if f.endswith(".md")]
        return sorted(f for f in files if os.path.isfile(os.path.join(root, f)))
    except (OSError, subprocess.CalledProcessError):
        found = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.startswith("build") and not x.startswith(".")]
            found += [os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith(".md")]
        return sorted(found)


def links(text):
    """(line number, target) of each link outside fenced code blocks and code spans."""
    fence = None
    for no, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        m = re.match(r"(`{3,}|~{3,})", stripped)
        if m:
            if fence is None:
                fence = m.group(1)[0] * len(m.group(1))
            elif stripped.startswith(fence):
                fence = None
            continue
        if fence is not None:
            continue
        plain = re.sub(r"(`+)(?:(?!\1).)*?\1", "", line)  # drop code spans
        for m in INLINE.finditer(plain):
            yield no, m.group(1)
        m = REFDEF.match(plain)
        if m:
            yield no, m.group(1)


def broken(root, rel, target):
    """Why target (linked from file rel) does not resolve to a file in the repository, or None."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
        return None
    path = target.split("#", 1)[0].split("?", 1)[0]
    if not path:
        return None
    base = root if path.startswith("/") else os.path.join(root, os.path.dirname(rel))
    full = os.path.normpath(os.path.join(base, path.lstrip("/")))
    if os.path.relpath(full, root).startswith(".."):
        return "outside the repository"
    if not os.path.exists(full):
        return "no such file"
    if not os.path.isfile(full):
        return "not a file"
    return None


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    files = markdown_files(root)
    bad = n = 0
    for rel in files:
        with open(os.path.join(root, rel), encoding="utf-8") as fh:
            text = fh.read()
        for no, target in links(text):
            n += 1
            why = broken(root, rel, target)
            if why:
                bad += 1
                print(f"{rel}:{no}: {target} ({why})")
    print(f"check_links: {len(files)} markdown files, {n} links, {bad} broken")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
