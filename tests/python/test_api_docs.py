"""The API reference covers the public API, and the public API is documented.

Python: every name in the ``__all__`` of ddpx, ddpx.hooks, ddpx.optim and ddpx.model_averaging
has a docstring and a directive on that module's page in docs/api/ (``.. autofunction::``,
``.. autoclass::`` with ``:members:``, ...); so does every public method and property of a
public class, including those it inherits from a private ddpx base (whose directive must then
say ``:inherited-members:``). The docstrings checked are those of this source tree
(docs/api/ddpx_tree.py), in a child process, so that the check sees a docstring edited since the
last ``pip install`` and the tests' own ddpx is left alone.

C++: every public declaration in the public headers (include/ddpx/**/*.h, no ``detail/`` folder,
no file named ``*private*``) has a comment. The rule, as the headers are written (a one-line
``//`` above each public declaration says what it promises): a declaration is public
when it is outside ``namespace detail`` and not in a private or protected section; it is
documented when a comment (``//``, ``///`` or ``/* */``) ends on its own line or on the line above
it, or above the run of declarations it belongs to (lines with no blank line between, such as a
constructor and its accessors under one comment, or two factories under "Factories mirroring
torch's names"). Declarations that need none: overrides (the base class documents them),
destructors, ``= default`` / ``= delete`` members, forward declarations, friends,
``static_assert``, enumerators (the enum's comment covers them). Macros named ``DDPX_*`` count as
declarations. The C++ check parses the headers with a small brace-counting scanner: no compiler,
no Doxygen, no torch.
"""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_DIR = os.path.join(REPO, "docs", "api")
INCLUDE = os.path.join(REPO, "include")
PUBLIC_MODULES = ["ddpx", "ddpx.hooks", "ddpx.optim", "ddpx.model_averaging"]

# ----------------------------------------------------------------------------------------------
# Python


def python_api() -> dict:
    """Runs in a child process with the tree's ddpx: every public name with what the check needs.

    Returns ``{module: [{"name", "kind", "doc", "members": [...], "private_bases": bool}]}``.
    """
    sys.path.insert(0, API_DIR)
    import importlib
    import inspect

    import ddpx_tree

    ddpx_tree.import_tree_ddpx()

    def has_doc(obj) -> bool:
        return bool((inspect.getdoc(obj) or "").strip())

    def data_documented(module, name) -> bool:
        # ``#: text`` above ``name = ...`` in the module's source, as autodoc reads it.
        src = inspect.getsource(module)
        return re.search(rf"^#:.*\n(#:.*\n)*{re.escape(name)}\s*[:=]", src, re.M) is not None

    def class_attr_documented(cls, name) -> bool:
        try:
            src = inspect.getsource(cls)
        except (OSError, TypeError):
            return False
        pattern = rf"^\s*#:.*\n(\s*#:.*\n)*\s*{re.escape(name)}\s*[:=]"
        return re.search(pattern, src, re.M) is not None

    report = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        entries = []
        for name in module.__all__:
            obj = getattr(module, name)
            entry = {"name": name, "members": [], "private_bases": False, "id": id(obj)}
            if inspect.ismodule(obj):
                entry.update(kind="module", doc=has_doc(obj))
            elif inspect.isclass(obj):
                entry.update(kind="class", doc=has_doc(obj))
                seen = set()
                for base in obj.__mro__:
                    if not base.__module__.startswith("ddpx"):
                        continue
                    private = base is not obj and (
                        base.__name__.startswith("_")
                        or any(part.startswith("_") for part in base.__module__.split(".")))
                    for attr, value in vars(base).items():
                        if attr.startswith("_") or attr in seen:
                            continue
                        seen.add(attr)
                        if isinstance(value, obj.__class__) and issubclass(obj, __import__(
                                "enum").Enum):
                            continue  # an enumerator: the enum's docstring covers it
                        if isinstance(value, (staticmethod, classmethod)):
                            value = value.__func__
                        if callable(value) or isinstance(value, property):
                            documented = has_doc(getattr(obj, attr))
                        else:
                            documented = class_attr_documented(base, attr)
                        entry["members"].append({"name": attr, "doc": documented})
                        entry["private_bases"] |= private
            elif callable(obj):
                entry.update(kind="function", doc=has_doc(obj))
            else:
                entry.update(kind="data", doc=data_documented(module, name))
            entries.append(entry)
        report[module_name] = entries
    return report


def run_python_api() -> dict:
    code = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import test_api_docs
        print("API-JSON", json.dumps(test_api_docs.python_api()))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("API-JSON ")][-1]
    return json.loads(line[len("API-JSON "):])


_DIRECTIVE = re.compile(r"^\.\. (auto|py:)?(module|function|class|data|exception|attribute|method)"
                        r"::\s+([\w.]+)(?:\(.*\))?\s*$")


def page_directives(module_name: str):
    """{qualified name: set of options} of the directives on the module's page ("auto" among the
    options for an autodoc directive)."""
    path = os.path.join(API_DIR, module_name + ".rst")
    assert os.path.isfile(path), f"no API page {os.path.relpath(path, REPO)}"
    found, current, last = {}, module_name, None
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^\.\. (?:currentmodule|module|automodule)::\s+(\S+)", line)
            if m:
                current = m.group(1)
                found[current] = set()
                last = current
                continue
            m = _DIRECTIVE.match(line)
            if m:
                name = m.group(3)
                last = name if "." in name and name.startswith("ddpx") else f"{current}.{name}"
                found[last] = {"auto"} if m.group(1) == "auto" else set()
                continue
            m = re.match(r"^\s+:([\w-]+):", line)
            if m and last is not None:
                found[last].add(m.group(1))
            elif line.strip() and not line.startswith((" ", "\t")):
                last = None
    return found


@pytest.fixture(scope="module")
def python_report():
    return run_python_api()


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_python_names_documented(python_report, module_name):
    missing = []
    # Data imported from elsewhere (``__version__``) has no ``#:`` comment to read: a plain
    # ``.. py:data::`` directive on the page, with its text, documents it.
    plain = {name for name, options in page_directives(module_name).items()
             if "auto" not in options}
    for entry in python_report[module_name]:
        if entry["kind"] == "data" and f"{module_name}.{entry['name']}" in plain:
            continue
        if not entry["doc"]:
            missing.append(f"{module_name}.{entry['name']}")
        for member in entry["members"]:
            if not member["doc"]:
                missing.append(f"{module_name}.{entry['name']}.{member['name']}")
    assert not missing, "public names without a docstring (or #: comment): " + ", ".join(missing)


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_python_names_on_api_page(python_report, module_name):
    directives = page_directives(module_name)
    problems = []
    if module_name not in directives:
        problems.append(f"docs/api/{module_name}.rst does not document module {module_name}")
    for entry in python_report[module_name]:
        qualified = f"{module_name}.{entry['name']}"
        if entry["kind"] == "module":
            page = os.path.join(API_DIR, qualified + ".rst")
            if not os.path.isfile(page):
                problems.append(f"{qualified}: no page docs/api/{qualified}.rst")
            continue
        if qualified not in directives:
            problems.append(f"{qualified}: no directive on docs/api/{module_name}.rst")
            continue
        options = directives[qualified]
        exported_from = [f"{other}.{e['name']}" for other, entries in python_report.items()
                         if other != module_name for e in entries if e["id"] == entry["id"]]
        if "auto" not in options and exported_from:
            continue  # a re-export: a plain directive pointing to its own page will do
        if entry["members"] and "members" not in options:
            problems.append(f"{qualified}: its directive lacks :members:")
        if entry["private_bases"] and "inherited-members" not in options:
            problems.append(f"{qualified}: public methods from a private base need "
                            ":inherited-members:")
    assert not problems, "\n".join(problems)


def test_api_index_lists_every_page():
    with open(os.path.join(API_DIR, "index.rst"), encoding="utf-8") as f:
        index = f.read()
    pages = sorted(os.path.splitext(p)[0] for p in os.listdir(API_DIR)
                   if p.endswith(".rst") and p != "index.rst")
    missing = [p for p in pages if not re.search(rf"^\s+{re.escape(p)}\s*$", index, re.M)]
    assert not missing, f"docs/api/index.rst's toctree lacks {missing}"


# ----------------------------------------------------------------------------------------------
# C++


def public_headers():
    """The public headers, relative to include/: no detail/ folder, no *private* file."""
    headers = []
    for root, dirs, files in os.walk(os.path.join(INCLUDE, "ddpx")):
        dirs[:] = sorted(d for d in dirs if d != "detail" and "private" not in d)
        headers += [os.path.relpath(os.path.join(root, f), INCLUDE) for f in sorted(files)
                    if f.endswith(".h") and "private" not in f]
    return headers


_STRING = re.compile(r'"(?:\\.|[^"\\])*"' + r"|'(?:\\.|[^'\\])*'")
_ACCESS = re.compile(r"^\s*(public|private|protected)\s*:\s*$")
_NAMESPACE = re.compile(r"^\s*(?:inline\s+)?namespace\b\s*([\w:]*)")
_CLASS = re.compile(r"^\s*(?:template\s*<.*>\s*)?(class|struct|union)\b\s*(?:\w+\s+)*?(\w+)?\s*"
                    r"(?:final)?\s*(?::[^{]*)?$", re.S)
_ENUM = re.compile(r"^\s*enum\b")
_FORWARD = re.compile(
    r"^\s*(?:template\s*<.*>\s*)?(class|struct|union|enum(\s+class)?)\s+[\w:]+\s*$", re.S)
_EXEMPT = re.compile(r"\boverride\b|=\s*default\s*$|=\s*delete\s*$|^\s*friend\b|^\s*~|"
                     r"^\s*virtual\s+~|^\s*static_assert\b|^\s*using\s+namespace\b", re.S)


def _comment_lines(lines):
    """Per line: (is a comment-only line, ends with a trailing comment, code with comments cut)."""
    out, in_block = [], False
    for raw in lines:
        code, comment_only, trailing = "", False, False
        text = _STRING.sub('""', raw)
        i = 0
        while i < len(text):
            if in_block:
                end = text.find("*/", i)
                if end < 0:
                    i = len(text)
                else:
                    in_block, i = False, end + 2
                continue
            if text.startswith("//", i):
                trailing = True
                break
            if text.startswith("/*", i):
                in_block, trailing = True, True
                i += 2
                continue
            code += text[i]
            i += 1
        comment_only = not code.strip() and (trailing or in_block or raw.strip().startswith("*"))
        out.append((comment_only, trailing and bool(code.strip()), code))
    return out


def undocumented_declarations(header: str):
    """``(line, declaration)`` for each public declaration of ``header`` with no comment."""
    with open(os.path.join(INCLUDE, header), encoding="utf-8") as f:
        lines = f.read().splitlines()
    info = _comment_lines(lines)

    def documented(first: int, last: int) -> bool:
        if any(info[i][1] for i in range(first, last + 1)):
            return True  # a comment on the declaration's own lines
        i = first - 1
        while i >= 0:
            comment_only, _, code = info[i]
            if comment_only:
                return True
            stripped = code.strip()
            if not stripped or _ACCESS.match(stripped) or stripped.endswith("{") and (
                    _NAMESPACE.match(stripped) or _CLASS.match(stripped[:-1])):
                return False  # a blank line, an access specifier or the scope's opening line
            i -= 1
        return False

    scopes = []  # ("ns", name) | ("class", access)
    found = []
    stmt, start, paren, skip, in_macro = "", None, 0, 0, False

    def public() -> bool:
        return all(not (kind == "ns" and name == "detail") and not (kind == "class" and name
                   != "public") for kind, name in scopes)

    def record(text: str, first: int, last: int) -> None:
        text = " ".join(text.split())
        if not text or _FORWARD.match(text) or _EXEMPT.search(text) or not public():
            return
        if not documented(first, last):
            found.append((first + 1, text[:100]))

    for lineno, (_, _, code) in enumerate(info):
        stripped = code.strip()
        if in_macro or (not stmt.strip() and stripped.startswith("#")):
            in_macro = stripped.endswith("\\")
            m = re.match(r"#\s*define\s+(DDPX_\w+)", stripped)
            if m and not skip and public():
                record("#define " + m.group(1), lineno, lineno)
            continue
        if skip == 0 and scopes and scopes[-1][0] == "class" and _ACCESS.match(stripped):
            scopes[-1] = ("class", _ACCESS.match(stripped).group(1))
            continue
        for ch in code:
            if skip:
                skip += {"{": 1, "}": -1}.get(ch, 0)
                if skip == 0:
                    stmt, start = "", None
                continue
            if start is None and not ch.isspace():
                start = lineno
            if ch in "([":
                paren += 1
            elif ch in ")]":
                paren -= 1
            elif ch == "{" and paren == 0:
                head = stmt.strip()
                ns = _NAMESPACE.match(head)
                cls = _CLASS.match(head)
                if ns or head.startswith('extern "C"'):
                    scopes.append(("ns", ns.group(1) if ns else ""))
                elif cls and "(" not in head and "=" not in head:
                    record(head, start, lineno)
                    scopes.append(("class", "private" if cls.group(1) == "class" else "public"))
                else:  # a function's body, an enum's enumerators or a braced initialiser
                    record(head, start, lineno)
                    skip = 1
                    continue
                stmt, start = "", None
                continue
            elif ch == "}" and paren == 0:
                if scopes:
                    scopes.pop()
                stmt, start = "", None
                continue
            elif ch == ";" and paren == 0:
                if stmt.strip() and not _ENUM.match(stmt):
                    record(stmt, start, lineno)
                stmt, start = "", None
                continue
            stmt += ch
        stmt += "\n"
    return found


def test_cpp_headers_found():
    headers = public_headers()
    assert "ddpx/hooks/comm_hook.h" in headers and len(headers) > 10, headers


@pytest.mark.parametrize("header", public_headers())
def test_cpp_declarations_documented(header):
    missing = undocumented_declarations(header)
    assert not missing, f"include/{header}: public declarations without a comment:\n" + "\n".join(
        f"  line {line}: {text}" for line, text in missing)


def test_cpp_page_lists_every_header():
    with open(os.path.join(API_DIR, "cpp.rst"), encoding="utf-8") as f:
        page = f.read()
    # Breathe finds a file by Doxygen's name for it, the file's base name.
    listed = set(re.findall(r"^\.\. doxygenfile::\s+(\S+)", page, re.M))
    missing = [h for h in public_headers() if os.path.basename(h) not in listed]
    assert not missing, f"docs/api/cpp.rst has no '.. doxygenfile::' for {missing}"
