"""pytest set-up for the multi-node tests: ddpx jobs launched by torchrun across network
namespaces made by scripts/multinode.py (one "machine" per namespace, rate-limited links).

The whole directory is skipped, with the reason, where the machine cannot host namespaces (not
root, no iproute2, a kernel without veth/bridge/tbf). The jobs import the installed ddpx, as
tests/python does (conftest there). scripts/test.sh runs this directory on the newest torch line
(DDPX_MULTINODE=1, its default there).
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
for path in (os.path.join(REPO, "scripts"), os.path.join(REPO, "tests", "python")):
    if path not in sys.path:
        sys.path.insert(0, path)

import multinode  # noqa: E402

_WHY_NOT = multinode.why_not_available()


def pytest_collection_modifyitems(config, items):
    if _WHY_NOT is None:
        return
    skip = pytest.mark.skip(reason=f"multi-node tests need network namespaces: {_WHY_NOT}")
    for item in items:
        if str(item.fspath).startswith(HERE):
            item.add_marker(skip)


def pytest_report_header(config):
    return [f"multi-node harness: {'available' if _WHY_NOT is None else _WHY_NOT}"]
