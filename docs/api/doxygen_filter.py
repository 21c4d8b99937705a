"""Doxygen's input filter (docs/api/Doxyfile): prints a header with its plain comments made
Doxygen comments, so the reference shows what the headers say without a second comment syntax
in the sources.

* the comment block that opens the file becomes the file's description (``@file``);
* a ``//`` line at the start of a line becomes ``///`` (the declaration below it);
* ``decl;  // text`` becomes ``decl;  ///< text`` (a field's trailing comment);
* ``}  // namespace x`` and comments inside function bodies are left alone (plain comments).
The line count is unchanged, so Doxygen's line numbers are the file's.
"""
import os
import re
import sys


def main(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, depth, opening = [], 0, True
    for i, line in enumerate(lines):
        stripped = line.strip()
        if opening and stripped.startswith("//"):
            text = stripped[2:].lstrip("/").strip()
            if i == 0:  # "@file NAME" then the text: the file's description, on one line
                name = path.replace(os.sep, "/").rsplit("/include/", 1)[-1]
                out.append(f"/// @file {name} {text}".rstrip())
                continue
            out.append("/// " + text)
            continue
        opening = False
        code = re.sub(r'"(?:\\.|[^"\\])*"', '""', line.split("//")[0])
        if depth <= 0 and re.match(r"^\s*//(?!/)", line):
            line = re.sub(r"^(\s*)//", r"\1///", line, count=1)
        elif depth <= 0 and re.search(r"[;,]\s*//(?!/)", line) and not stripped.startswith("}"):
            line = re.sub(r"([;,]\s*)//(?!/)", r"\1///<", line, count=1)
        depth += function_depth_change(code)
        out.append(line)
    sys.stdout.write("\n".join(out))


_scopes = []


def function_depth_change(code: str) -> int:
    """+1 for each function body opened, -1 for each closed; namespace, class and enum braces
    do not count (their members' comments are documentation)."""
    change = 0
    for m in re.finditer(r"[{}]", code):
        if m.group() == "{":
            head = code[:m.start()]
            scope = not re.search(r"\)\s*(const\s*)?(noexcept\s*)?(override\s*)?$|\)\s*:.*$|=\s*$",
                                  head) and (re.search(r"\b(namespace|class|struct|enum|union)\b",
                                                       head) or not head.strip())
            _scopes.append(scope)
            change += 0 if scope else 1
        else:
            change -= 0 if (_scopes.pop() if _scopes else True) else 1
    return change


if __name__ == "__main__":
    main(sys.argv[1])
