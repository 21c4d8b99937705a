"""The harness itself: results come back in rank order, a rank's exception or crash becomes a
test failure with its traceback, and a hang becomes a timeout instead of a stuck suite."""
import os
import time
import types

import pytest
import torch
import torch.distributed as dist

from dist_utils import RankError, RankTimeout, free_port, run_ranks


def rank_sum(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t}


def rank_raises_on_1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 waits in a collective that never completes


def rank_crashes_on_0(rank, world_size):
    # Both ranks finish initialising first: rank 0 hosts the store, and leaving earlier can fail
    # rank 1's init ("Connection reset by peer") before rank 0's exit is observed.
    dist.barrier()
    if rank == 0:
        os._exit(3)
    dist.barrier()


def rank_hangs(rank, world_size):
    time.sleep(3600)


@pytest.mark.parametrize("world_size", [1, 3])
def test_results_in_rank_order(world_size):
    res = run_ranks(rank_sum, world_size, args=(10,))
    expected_sum = sum(10.0 + r for r in range(world_size))
    assert [r["rank"] for r in res] == list(range(world_size))
    assert all(r["world"] == world_size for r in res)
    assert all(r["sum"].item() == expected_sum for r in res)


def test_exception_on_one_rank_fails_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(rank_raises_on_1, 2, timeout=60)
    msg = str(info.value)
    assert "--- rank 1 ---" in msg and "ValueError: boom from rank 1" in msg
    assert "rank_raises_on_1" in msg  # the traceback, not just the message
    assert time.monotonic() - start < 30  # the blocked rank 0 was killed, not waited for


def test_crash_fails():
    # Either rank 0's exit is reported, or rank 1's collective failing on the closed connection
    # is seen first; what matters is a RankError instead of a pass or a hang.
    with pytest.raises(RankError, match=r"rank 0 exited with code 3|--- rank 1 ---"):
        run_ranks(rank_crashes_on_0, 2, timeout=60)


def test_hang_times_out():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match="did not finish within 2 s"):
        run_ranks(rank_hangs, 2, timeout=2)
    assert time.monotonic() - start < 15


def test_free_port_is_bindable():
    import socket
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


class _Marker:
    def __init__(self, *args):
        self.args = args


class _Item:
    """What selection.record reads of a pytest item: its module, its `cases` marker and its
    parameters."""

    def __init__(self, module, patterns=None, **params):
        self.module = types.SimpleNamespace(__name__=module)
        self._marker = None if patterns is None else _Marker(*patterns)
        self.callspec = types.SimpleNamespace(params=params)

    def get_closest_marker(self, name):
        return self._marker if name == "cases" else None


def test_selection_launches_what_the_selected_tests_read(monkeypatch):
    """selection.wanted: the union of the selected tests' patterns, formatted with their
    parameters, in the batch's order; everything for an unmarked test or an unknown module;
    nothing but the always-made records for `cases()`."""
    import selection
    monkeypatch.setattr(selection, "_patterns", {})
    names = ["torch/r1", "dropin/r1", "native/r1", "torch/r4", "dropin/r4", "allreduce"]
    assert selection.wanted("m", names) == names  # before any selection: all
    selection.record([_Item("m", ("torch/{opts}", "dropin/{opts}"), opts="r4"),
                      _Item("m", ("allreduce",)),
                      _Item("empty", ()),
                      _Item("unmarked"), _Item("unmarked", ("torch/*",))])
    assert selection.wanted("m", names) == ["torch/r4", "dropin/r4", "allreduce"]
    assert selection.wanted("empty", names) == []
    assert selection.wanted("unmarked", names) == names
    assert selection.wanted("not collected", names) == names
    cases = [(n, "fn", {}) for n in names]
    assert selection.wanted_cases("m", cases) == [cases[3], cases[4], cases[5]]


def test_selection_takes_parameters_literally(monkeypatch):
    """A parameter's brackets and stars are characters of a case name (torch's test ids), not
    a pattern: the formatted marker matches that one name, and the marker's own stars still
    match many."""
    import selection
    monkeypatch.setattr(selection, "_patterns", {})
    names = ["parity[Adam-maximize=False]", "parity[Adam-maximize=True]", "parityA", "p*", "pq"]
    selection.record([_Item("m", ("{name}",), name="parity[Adam-maximize=False]"),
                      _Item("m", ("{name}",), name="p*"),
                      _Item("n", ("parity[[]{kind}*",), kind="Adam")])
    assert selection.wanted("m", names) == ["parity[Adam-maximize=False]", "p*"]
    assert selection.wanted("n", names) == names[:2]
