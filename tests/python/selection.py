"""What the selected tests of a module need from its batch launches, so that ``pytest -k``
runs one case without launching every other case of its batch.

Multi-rank test modules run many cases (hooks, optimizers, configurations) in one launch of W
ranks and check each case in its own test: starting ranks costs seconds, a case a fraction of
that. A test says which cases it reads with the marker ``cases``: shell-style patterns
(``fnmatch``), formatted with the test's parameters::

    @pytest.mark.cases("torch_allreduce", "ddpx_allreduce_*")
    @pytest.mark.parametrize("world_size", [2, 3])
    def test_allreduce(world_size): ...

    @pytest.mark.cases("diff/{opt}/*")       # {opt}: the test's parameter
    @pytest.mark.parametrize("opt", ["sgd", "adam"])
    def test_diff(opt): ...

A test that reads only what every launch of its module makes marks itself ``cases()``. A batch
then launches ``wanted(__name__, names)``: the names of its cases that some selected
test of the module needs, in their order. When every test runs (CI), that is every case any
test reads: one launch, as before. When a selected test of the module has no marker, nothing is
known and every case runs. A test that reads a case its patterns miss fails with a KeyError
when run alone: the patterns are part of the test.
"""
import fnmatch
from typing import Dict, List, Optional, Sequence, Set

# Module name -> the patterns its selected tests need; None: a selected test said nothing, so
# every case. A module absent (nothing recorded yet, or not collected) also runs every case.
_patterns: Dict[str, Optional[Set[str]]] = {}


def record(items) -> None:
    """Called by conftest.py once the selection is final (after -k and -m)."""
    _patterns.clear()
    for item in items:
        module = getattr(getattr(item, "module", None), "__name__", None)
        if module is None:
            continue
        marker = item.get_closest_marker("cases")
        if marker is None:
            _patterns[module] = None
            continue
        if module in _patterns and _patterns[module] is None:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        # A parameter is a literal: its brackets and stars match themselves.
        literal = {k: _escape(v) if isinstance(v, str) else v for k, v in params.items()}
        formatted = {p.format(**literal) for p in marker.args}
        _patterns.setdefault(module, set()).update(formatted)


def _escape(text: str) -> str:
    """`text` as an fnmatch pattern that matches only itself."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in text)


def wanted(module: str, names: Sequence[str]) -> List[str]:
    """The names of `names` that the selected tests of `module` need, in order (every name when
    the selection is unknown: a module run outside pytest, or an unmarked selected test)."""
    patterns = _patterns.get(module)
    if patterns is None:
        return list(names)
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def wanted_cases(module: str, cases: Sequence[tuple]) -> List[tuple]:
    """wanted() for a list of cases whose first field is the name."""
    keep = set(wanted(module, [c[0] for c in cases]))
    return [c for c in cases if c[0] in keep]
