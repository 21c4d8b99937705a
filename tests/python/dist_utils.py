"""A small harness that runs a function on W torch.distributed ranks, one process per rank.

    results = run_ranks(fn, world_size=2, args=(...))   # [fn's return value on rank 0, 1, ...]

``fn(rank, world_size, *args, **kwargs)`` runs in a fresh process after
``dist.init_process_group`` (Gloo by default, a free TCP port on 127.0.0.1 chosen per call). Its
return value travels back with ``torch.save`` through a file, so tensors, dicts and lists of
them are fine. If a rank raises, the parent raises :class:`RankError` (an AssertionError, so
pytest shows a test failure) carrying every failing rank's traceback; the other ranks, which
may be blocked in a collective, are killed after a short grace period. If the ranks do not all
finish within ``timeout`` seconds they are killed and :class:`RankTimeout` is raised, so a hang
fails the test instead of blocking the suite.

Processes start with the ``forkserver`` method by default, with torch preloaded in the server:
starting W ranks then costs ~0.1 s instead of ~2 s with ``spawn``, and, unlike ``fork``, the
ranks never inherit the pytest process's OpenMP/threads state. ``DDPX_TEST_START_METHOD=spawn``
(or ``fork``) overrides it. ``fn`` must be importable by name in a child process: a module-level
function of a test module (conftest.py puts this directory on sys.path).
"""
import datetime
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["RankError", "RankTimeout", "catch", "exit_rank", "free_port", "run_ranks",
           "start_method", "wait_for_result_of"]

# Seconds a collective may wait inside a rank before Gloo gives up (a desynchronised rank then
# fails instead of hanging until the parent's timeout).
COLLECTIVE_TIMEOUT_S = 60.0
# Seconds the parent leaves the other ranks, once one has failed, to report their own errors.
FAILURE_GRACE_S = 3.0
# How many times a launch is retried when the chosen port was taken in the meantime.
PORT_RETRIES = 3


class RankError(AssertionError):
    """One or more ranks raised; the message holds their tracebacks."""


class RankTimeout(RankError):
    """The ranks did not all finish in time (a hang or a deadlock)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def catch(fn: Callable[[], object]) -> Optional[Tuple[str, str]]:
    """(exception type name, message) of what ``fn()`` raised, or None: what a rank records of an
    expected error, for the test to inspect once the record is back in the parent."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return type(exc).__name__, str(exc)
    return None


# Where this rank's result goes (set in each rank process by _rank_main).
_result_path: Optional[str] = None


def exit_rank(result: Any = None) -> None:
    """Ends this rank at once, as if ``fn`` had returned ``result``, skipping the teardown (the
    barrier and destroy_process_group, which need every peer alive): for fault tests, where a
    rank dies on purpose or survives a dead peer. Never returns."""
    assert _result_path is not None, "exit_rank() is for rank processes started by run_ranks"
    tmp = _result_path + ".tmp"
    torch.save(result, tmp)
    os.replace(tmp, _result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def wait_for_result_of(rank: int, max_s: float) -> bool:
    """Waits until `rank` has left a result (returned, or called exit_rank), at most `max_s`
    seconds; True if it did. A stalled rank in a fault test sleeps with this, so that it stalls
    exactly as long as its peers need to notice, not a fixed worst case."""
    assert _result_path is not None, "wait_for_result_of() is for rank processes of run_ranks"
    path = os.path.join(os.path.dirname(_result_path), f"rank{rank}.pt")
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.05)
    return False


def start_method() -> str:
    return os.environ.get("DDPX_TEST_START_METHOD", "forkserver")


_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        method = start_method()
        _ctx = mp.get_context(method)
        if method == "forkserver":
            # Modules imported once in the server and inherited by every rank. A module that
            # fails to import is skipped by the server, so listing ddpx here is harmless, and so
            # is torch._dynamo on torch 1.13, which has none. torch 2.x's DDP imports
            # torch._dynamo (~300 modules) in its constructor: most of the start-up of every
            # rank that builds a DDP model, unless it is preloaded here.
            _ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.parallel",
                                         "torch._dynamo", "ddpx"])
    return _ctx


def _rank_main(fn: Callable, rank: int, world_size: int, port: int, backend: str, outdir: str,
               args: Sequence[Any], kwargs: Dict[str, Any], collective_timeout_s: float,
               threads: int) -> None:
    global _result_path
    result_path = _result_path = os.path.join(outdir, f"rank{rank}.pt")
    error_path = os.path.join(outdir, f"rank{rank}.err")
    try:
        # Every rank is on this machine: Gloo and TensorPipe (RPC) on loopback, instead of an
        # address guessed from the host name, which a machine without a network may not have.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
        # W ranks share this machine's cores: one intra-op thread each avoids oversubscription
        # and keeps results independent of the machine's core count.
        torch.set_num_threads(threads)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        result = fn(rank, world_size, *args, **kwargs)
        tmp = result_path + ".tmp"
        torch.save(result, tmp)
        os.replace(tmp, result_path)
        try:
            dist.barrier()  # nobody tears the store down while another rank still needs it
            dist.destroy_process_group()
        except Exception:  # pragma: no cover - teardown only
            pass
    except BaseException:  # noqa: B902 - report everything, including SystemExit
        with open(error_path + ".tmp", "w") as f:
            f.write(traceback.format_exc())
        os.replace(error_path + ".tmp", error_path)
        sys.stderr.flush()
        os._exit(1)


def _read_errors(outdir: str, world_size: int) -> Dict[int, str]:
    errors = {}
    for rank in range(world_size):
        path = os.path.join(outdir, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path) as f:
                errors[rank] = f.read()
    return errors


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _launch_once(fn, world_size, args, kwargs, backend, timeout, collective_timeout_s, threads,
                 outdir):
    ctx = _context()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, backend, outdir, tuple(args), dict(kwargs),
                  collective_timeout_s, threads),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed_at: Optional[float] = None
    try:
        while True:
            alive = [p for p in procs if p.is_alive()]
            if not alive:
                break
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            now = time.monotonic()
            if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
                break
            if now > deadline:
                break
            time.sleep(0.02)
    finally:
        timed_out = any(p.is_alive() for p in procs) and failed_at is None
        _kill(procs)

    errors = _read_errors(outdir, world_size)
    for rank, p in enumerate(procs):
        if rank not in errors and p.exitcode not in (0, None) and failed_at is not None:
            if not os.path.exists(os.path.join(outdir, f"rank{rank}.pt")):
                errors[rank] = (f"rank {rank} exited with code {p.exitcode} without a result "
                                "(killed after another rank failed, or crashed)\n")
    if timed_out:
        done = [r for r in range(world_size) if os.path.exists(os.path.join(outdir, f"rank{r}.pt"))]
        msg = (f"{getattr(fn, '__name__', fn)} on {world_size} ranks did not finish within "
               f"{timeout:.0f} s (a hang?); ranks with a result: {done}")
        if errors:
            msg += "\n" + "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RankTimeout(msg)
    if errors:
        raise RankError(
            f"{getattr(fn, '__name__', fn)} failed on {len(errors)} of {world_size} ranks:\n"
            + "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    results = []
    for rank in range(world_size):
        path = os.path.join(outdir, f"rank{rank}.pt")
        if not os.path.exists(path):
            raise RankError(f"rank {rank} exited with code {procs[rank].exitcode} and no result")
        results.append(torch.load(path))
    return results


def _worker_aborted(text: str) -> bool:
    """Whether a RankError says a rank's process aborted (SIGABRT) and took the others'
    connections down: "exited with code -6", or tensorpipe's "eof" on an RPC peer."""
    return "exited with code -6" in text or "eof (this error originated at tensorpipe" in text


def run_ranks(fn: Callable, world_size: int, args: Sequence[Any] = (),
              kwargs: Optional[Dict[str, Any]] = None, backend: str = "gloo",
              timeout: float = 120.0, collective_timeout_s: float = COLLECTIVE_TIMEOUT_S,
              threads: int = 1, retry_aborted: bool = False) -> List[Any]:
    """Runs ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks of a fresh
    process group and returns the ranks' return values, in rank order.

    Raises :class:`RankError` with the tracebacks when a rank raises, :class:`RankTimeout` when
    the ranks are not all done after ``timeout`` seconds. ``retry_aborted``: launch once more
    (the first failure printed) when a rank's process aborted; the RPC tests take it, for a
    ``std::bad_alloc`` abort inside torch's RPC agent that CI saw twice (once in torch's own
    DistributedOptimizer, before any ddpx optimizer had run) and that never reproduced alone.
    """
    kwargs = kwargs or {}
    retried_abort = False
    for attempt in range(PORT_RETRIES):
        with tempfile.TemporaryDirectory(prefix="ddpx_ranks_") as outdir:
            try:
                return _launch_once(fn, world_size, args, kwargs, backend, timeout,
                                    collective_timeout_s, threads, outdir)
            except RankError as exc:
                # The port picked by free_port() can be taken by someone else (another xdist
                # worker) before rank 0's store binds it: launch again on a new port. (torch
                # 2.15's TCPStore says "EADDRINUSE ... address already in use", in lower case.)
                text = str(exc)
                taken = "address already in use" in text.lower() or "EADDRINUSE" in text
                aborted = retry_aborted and not retried_abort and _worker_aborted(text)
                if (taken or aborted) and attempt + 1 < PORT_RETRIES:
                    if aborted:
                        retried_abort = True
                        print(f"run_ranks: a rank aborted; running once more:\n{text}",
                              file=sys.stderr)
                    continue
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def build_cmake_project(src: str, build: str, prefix: str) -> None:
    """Configures and builds the CMake project in `src` into `build` against the packages under
    `prefix` (the installed ddpx's ``cmake_prefix_path``), as a C++ user would: Release, ninja
    and ccache where present, no package registry. Asserts that both steps succeed."""
    cfg = ["cmake", "-S", str(src), "-B", str(build), f"-DCMAKE_PREFIX_PATH={prefix}",
           "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON"]
    if shutil.which("ninja"):
        cfg += ["-G", "Ninja"]
    if shutil.which("ccache"):
        cfg += ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    for cmd in (cfg, ["cmake", "--build", str(build), "--parallel", "2"]):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (
            f"{' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
