"""Sphinx configuration of ddpx's documentation site: the user guide (docs/guide, Markdown through
myst-parser), the project notes it links to (docs/*.md) and the API reference (docs/api: the
Python API from the docstrings, the C++ API from the public headers through Doxygen and Breathe).

The source folder is docs/, this folder holds the configuration: ``scripts/docs.sh`` runs
``sphinx-build -c docs/api docs build-docs/html -W --keep-going``.
"""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BUILD = os.environ.get("DDPX_DOCS_BUILD", os.path.join(REPO, "build-docs"))

# The docstrings of this tree, not of the last pip install (see ddpx_tree.py).
sys.path.insert(0, HERE)
import ddpx_tree  # noqa: E402

ddpx = ddpx_tree.import_tree_ddpx()

project = "ddpx"
author = "the ddpx developers"
copyright = "the ddpx developers"
release = version = ddpx.__version__

root_doc = "api/index"
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # torch's docstring style: Args:, Returns:, Example::
    "myst_parser",
    "breathe",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["api/_build"]
templates_path = []

# Markdown: GitHub's heading anchors, so that the guide's links to "page.md#a-heading" resolve
# here as they do on GitHub.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# C++: Doxygen's XML of include/ddpx (Doxyfile beside this file), run before Sphinx reads.
DOXYGEN_XML = os.path.join(BUILD, "doxygen", "xml")
breathe_projects = {"ddpx": DOXYGEN_XML}
breathe_default_project = "ddpx"
breathe_default_members = ("members",)
breathe_show_include = True
primary_domain = "py"
# Breathe renders, for each ``doxygenfile``, the namespaces the file opens (``namespace ddpx``)
# as C++ declarations, so every header after the first redeclares ``ddpx``; an inherited
# overload brought in by ``using Base::f`` is declared twice the same way. These duplicates
# only decide which of two identical targets a C++ cross-reference lands on.
suppress_warnings = ["duplicate_declaration.cpp"]


def run_doxygen(app) -> None:
    os.makedirs(os.path.dirname(DOXYGEN_XML), exist_ok=True)
    env = dict(os.environ, DDPX_DOXYGEN_OUT=os.path.dirname(DOXYGEN_XML), DDPX_REPO=REPO,
               DDPX_DOXYGEN_FILTER=f"{sys.executable} {os.path.join(HERE, 'doxygen_filter.py')}")
    proc = subprocess.run(["doxygen", os.path.join(HERE, "Doxyfile")], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0 or proc.stderr.strip():
        # Doxygen's warnings are errors too (WARN_AS_ERROR), like Sphinx's under -W.
        raise RuntimeError("doxygen failed:\n" + proc.stderr)


# The guide links to README.md and CONTRIBUTING.md at the repository root, outside Sphinx's
# source folder (docs/): myst cannot resolve them (myst.xref_missing). On the site such a link
# becomes the file's repository path in code, so every other missing reference still fails.
_OUTSIDE_LINK = re.compile(r"\[([^\]]+)\]\(((?:\.\./)+)([\w.-]+\.md)(#[\w-]*)?\)")


def _outside_docs(docname: str, ups: str) -> bool:
    return len(ups) // 3 > docname.count("/")


def rewrite_outside_links(app, docname: str, source: list) -> None:
    def repl(m):
        if not _outside_docs(docname, m.group(2)):
            return m.group(0)
        text, path = m.group(1), m.group(3)
        return f"`{path}`" if text.strip("`") == path else f"{text} (`{path}`)"

    source[0] = _OUTSIDE_LINK.sub(repl, source[0])


def setup(app):
    app.connect("builder-inited", run_doxygen)
    app.connect("source-read", rewrite_outside_links)


html_theme = "furo"
html_title = f"ddpx {release}"
html_static_path = []
# build-docs/html/index.html: the site's front page is api/index.html (the guide's Markdown and
# the API pages share docs/ as the source folder); a redirect keeps the obvious URL working.
html_extra_path = [os.path.join(HERE, "_extra")]
