#!/usr/bin/env python3
"""Fails when a comment or docstring in the code carries provenance instead of a reason.

Comments say why: the invariant, the reason, the contract. Where a thing came from (a review
finding's id, an issue number, a commit hash, a date, a STYLE note, a measured figure that the
next benchmark run can change) goes in the commit message, and figures go in docs/benchmarks.md.
This check scans the comments of the code trees (C++/CUDA `//` and `/* */`, Python `#` and
triple-quoted strings, shell and CMake `#`) and prints `file:line: what` for each hit, with a
hint, then exits 1.

Allowed by rule: a reference to an upstream project's issue or pull request (`pytorch#104796`,
`pytorch/pytorch#104796`, a github.com URL): it explains a workaround and does not go stale.
For any other true exception, end the line with the marker `provenance-ok` (`// provenance-ok`,
`# provenance-ok`) and say in the comment why it is needed.

    python3 scripts/check_comments.py            # the whole tree (run by .ci/run)
    python3 scripts/check_comments.py FILE...    # some files

Standard library only; reads every file once (well under a second).
"""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tokenize
from typing import Iterator, List, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TREES = ("src", "include", "python", "scripts", "benchmarks", "tests", "examples", "cmake",
         "CMakeLists.txt")
# cmake/compat mirrors a torch header for Debian's libtorch-dev: kept as torch writes it.
# This script names the patterns it looks for.
SKIP_PREFIXES = ("cmake/compat/", "scripts/check_comments.py")
MARKER = "provenance-ok"

C_EXTS = (".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh", ".c")
PY_EXTS = (".py",)
HASH_EXTS = (".sh", ".cmake", ".in", ".txt", ".toml", ".cfg")

# (name, pattern, hint). Matched against comment text only, case-sensitive unless (?i).
RULES: List[Tuple[str, "re.Pattern[str]", str]] = [
    ("review id", re.compile(r"(?i)\breview(s|ed|er)?\b|\bfindings? [A-Z]\d"),
     "state the reason or invariant the finding stands for; the id goes in the commit message"),
    ("finding id", re.compile(r"(?<![\w-])[BFHNPSTX][1-9]'?(?=[:;,).]|\s(on|in|of|at)\b)"),
     "a review finding's id: state what it stands for instead"),
    ("issue number", re.compile(r"(?i)\bissue #?\d+|\bissues #?\d+(,| and)|(?<![\w/])#\d{1,5}\b"),
     "say what the issue asked for as a requirement; the number goes in the commit message "
     "(upstream issues are fine as pytorch#NNN or a URL)"),
    ("work item", re.compile(r"(?i)\b(item|stop|step) #?\d+ of (issue|the review)|\bstop \d+\b"),
     "say what the item requires, not where it was asked"),
    ("commit hash",
     re.compile(r"(?<![\w.+-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w.])"),
     "a commit hash ages: say what the commit changed, or point to docs/benchmarks.md"),
    ("date", re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|"
                        r"Nov|Dec)[a-z]* (\d{1,2}, )?20\d\d\b"),
     "a date ages: state the fact without when it was found"),
    ("STYLE note", re.compile(r"\bSTYLE(\.md)?\b(:|\.md)"),
     "say the reason itself, not the style rule's name"),
    ("measured figure",
     re.compile(r"\b\d+(\.\d+)?\s?(GB|MB|TB|GiB|MiB|KB)/s\b|\b\d+(\.\d+)?\s?[GTM]FLOP/s\b|"
                r"\b\d+(\.\d+)?\s?x (faster|slower|sooner|quicker)\b|"
                r"\b\d+(\.\d+)?x (torch|ddpx|the baseline)'s\b|\bspeed-?up of \d|"
                r"\b\d+(\.\d+)?-\d+(\.\d+)? ?(ms|us|µs)\b"),
     "a measured figure changes with the next run: give the reason (bound, complexity) and put "
     "the figure in docs/benchmarks.md"),
]
# Upstream references that are fine in a comment: owner/repo#N, pytorch#N, github.com URLs.
UPSTREAM = re.compile(r"[\w.-]+/[\w.-]+#\d+|\b(pytorch|torch|gloo|nccl|pybind11|cuda)#\d+|"
                      r"https?://\S+")


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def c_comments(text: str) -> Iterator[Tuple[int, str]]:
    """(line, text) of each line of each // and /* */ comment, skipping string/char literals."""
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"' or c == "'":
            if c == '"' and text[max(0, i - 1)] == "R" and text.startswith('"', i):
                m = re.match(r'"([^(\s]*)\(', text[i:])
                if m:  # raw string R"delim( ... )delim"
                    end = text.find(")" + m.group(1) + '"', i)
                    i = n if end < 0 else end + len(m.group(1)) + 2
                    continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            yield _line_of(text, i), text[i:j]
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            first = _line_of(text, i)
            for k, part in enumerate(text[i:j].split("\n")):
                yield first + k, part
            i = j
        else:
            i += 1


def py_comments(text: str) -> Iterator[Tuple[int, str]]:
    """(line, text) of each # comment and each line of each triple-quoted string."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                yield tok.start[0], tok.string
            elif tok.type == tokenize.STRING and re.match(r"^[rRbBuUfF]*('''|\"\"\")",
                                                           tok.string):
                for k, part in enumerate(tok.string.split("\n")):
                    yield tok.start[0] + k, part
    except (tokenize.TokenError, SyntaxError):
        yield from hash_comments(text)


def hash_comments(text: str) -> Iterator[Tuple[int, str]]:
    """(line, text) of # comments in shell and CMake: a # at the start or after a blank."""
    for no, line in enumerate(text.split("\n"), 1):
        m = re.search(r"(^|\s)#(?!\{)", line)
        if m:
            yield no, line[m.end() - 1:]


def comments_of(path: str, text: str) -> Iterator[Tuple[int, str]]:
    base = os.path.basename(path)
    if path.endswith(C_EXTS):
        return c_comments(text)
    if path.endswith(PY_EXTS) or text.startswith("#!") and "python" in text.split("\n", 1)[0]:
        return py_comments(text)
    if path.endswith(HASH_EXTS) or base == "CMakeLists.txt" or text.startswith("#!"):
        return hash_comments(text)
    return iter(())


def check_text(path: str, text: str) -> List[str]:
    lines = text.split("\n")
    out = []
    for no, comment in comments_of(path, text):
        if MARKER in lines[no - 1] if no <= len(lines) else False:
            continue
        scrubbed = UPSTREAM.sub(" ", comment)
        for name, pattern, hint in RULES:
            m = pattern.search(scrubbed)
            if m:
                out.append(f"{path}:{no}: {name} '{m.group(0).strip()}': {hint}")
                break
    return out


def tree_files() -> List[str]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *TREES],
            cwd=ROOT, check=True, capture_output=True, text=True).stdout.split("\n")
        files = [f for f in listed if f and os.path.isfile(os.path.join(ROOT, f))]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the trees
        files = []
        for top in TREES:
            if os.path.isfile(os.path.join(ROOT, top)):
                files.append(top)
            for d, _, names in os.walk(os.path.join(ROOT, top)):
                files += [os.path.relpath(os.path.join(d, f), ROOT) for f in names]
    return sorted(set(f for f in files if not f.startswith(SKIP_PREFIXES)))


def main(argv: Sequence[str]) -> int:
    # Files named on the command line are taken as given (relative to the working directory);
    # the tree's are relative to the repository root.
    files = [(f, f) for f in argv] or [(f, os.path.join(ROOT, f)) for f in tree_files()]
    problems: List[str] = []
    scanned = 0
    for f, full in files:
        try:
            with open(full, encoding="utf-8") as fh:
                text = fh.read()
        except (UnicodeDecodeError, IsADirectoryError):
            continue
        scanned += 1
        problems += check_text(f, text)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"ddpx: {len(problems)} comment(s) above carry provenance; rewrite each as the "
              f"reason it stands for, or end the line with '{MARKER}' if it must stay "
              f"(scripts/check_comments.py says what is allowed)", file=sys.stderr)
        return 1
    print(f"ddpx: comments: {scanned} files free of provenance")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
