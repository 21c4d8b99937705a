#!/usr/bin/env python3
"""Several machines on one: N Linux network namespaces ("nodes") joined by a switch, each link
rate-limited, and a ``torchrun --nnodes N`` job launched across them with c10d rendezvous and
Gloo (and TensorPipe) bound to the nodes' interfaces.

    python3 scripts/multinode.py check
    python3 scripts/multinode.py run --nodes 2 --rate 1gbit -- benchmarks/train_digits.py --epochs 1
    python3 scripts/multinode.py run --nodes 3 --python .venv/bin/python --no-python -- build/x

Topology: node i is the namespace ``<prefix>-n<i>`` holding ``eth0`` with address
``10.<net>.0.<i+1>/24``; the switch is the namespace ``<prefix>-sw`` holding a bridge, one port
per node (a veth pair each). ``--rate`` (tc's form: ``500mbit``, ``1gbit``, ``10gbit``) limits
both directions of every link with a token bucket (``tc ... tbf``; this kernel has no
``netem``, so no latency is added). Nothing is routed outside the namespaces the harness made:
the nodes have no default route, and the switch is an isolated bridge. Everything is removed on
exit (``ip netns del``), even after an error or a timeout; ``cleanup --prefix P`` removes what
a killed run left.

Each node also has a UTS namespace of its own, its host name being the namespace's name, and
resolves the nodes' names through ``/etc/netns/<ns>/hosts`` (which ``ip netns exec`` mounts
over ``/etc/hosts``; removed with the namespace).

torchrun on every node: ``--nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint
<node 0>:<port> --local-addr <node's address>`` (without it the workers are given the machine's
hostname as MASTER_ADDR, which resolves outside the namespace, and hang), ``--rdzv-conf
is_host=1`` on node 0 only (the hostname resolves to another address, so torchrun would not
host the store itself), ``GLOO_SOCKET_IFNAME=eth0`` and ``TP_SOCKET_IFNAME=eth0``. The job's
bytes on the wire are read from each node's interface counters (/proc/net/dev in the node).

Needs root (namespaces, links, qdiscs), ``ip`` and ``tc`` (iproute2), ``unshare``
(util-linux) and a kernel with veth, bridge, tbf and UTS namespaces: ``check`` says which is
missing. The module is also imported by the multi-node
tests (tests/multinode) and the network benchmark (benchmarks/bench_network.py).
"""
import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

IFNAME = "eth0"


def _run(argv: Sequence[str], check: bool = True,
         timeout: float = 30.0) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, timeout=timeout, capture_output=True, text=True)


def why_not_available() -> Optional[str]:
    """None when this machine can host a cluster; else what is missing, in words."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, links and qdiscs); run as root or with sudo"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (apt-get install {package})"
    probe = f"ddpxprobe{os.getpid() % 100000}"
    try:
        _run(["ip", "netns", "add", probe])
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot create a network namespace: {getattr(exc, 'stderr', exc)}".strip()
    try:
        steps = [
            (["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"],
             "veth"),
            (["ip", "-n", probe, "link", "add", "br0", "type", "bridge"], "bridge"),
            (["ip", "-n", probe, "link", "set", "pa", "up"], "veth"),
            (["tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1gbit",
              "burst", "256kb", "latency", "100ms"], "tbf (sch_tbf)"),
            (["ip", "netns", "exec", probe, "unshare", "--uts", "--", "sh", "-c",
              "echo probe > /proc/sys/kernel/hostname"], "a UTS namespace"),
        ]
        for argv, what in steps:
            done = _run(argv, check=False)
            if done.returncode != 0:
                return f"the kernel refuses {what}: {done.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def tx_bytes_of(proc_net_dev: str, ifname: str = IFNAME) -> int:
    """The transmitted-bytes counter of `ifname` in the text of a /proc/net/dev (KeyError if
    the interface is not there). The benchmark's workers read their own namespace's file."""
    for line in proc_net_dev.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == ifname:
            return int(rest.split()[8])
    raise KeyError(ifname)


def _netns_etc(ns: str) -> str:
    # What ip netns exec mounts over /etc for `ns` (the node's hosts file lives there).
    return os.path.join("/etc/netns", ns)


def delete_namespace(ns: str) -> None:
    """Kills what runs in `ns`, deletes it and its /etc/netns folder (idempotent)."""
    for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(_netns_etc(ns), ignore_errors=True)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _burst(rate: str) -> str:
    """tbf's bucket for `rate`: 10 ms of traffic, at least 256 KiB (veth hands tbf segments of up
    to 64 KiB with its offloads on; a bucket smaller than a segment drops it)."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for suffix, scale in units.items():
        if rate.endswith(suffix):
            bits = float(rate[: -len(suffix)]) * scale
            break
    else:
        raise ValueError(f"rate must look like 500mbit, 1gbit or 10gbit, got {rate!r}")
    return f"{max(int(bits / 8 / 100), 256 * 1024)}b"


class Cluster:
    """N nodes and a switch, made on entry, removed on exit (see the module's docstring)."""

    def __init__(self, nodes: int, rate: Optional[str] = None, prefix: Optional[str] = None,
                 net: Optional[int] = None):
        if nodes < 1:
            raise ValueError(f"nodes must be at least 1, got {nodes}")
        if rate is not None:
            _burst(rate)  # validates
        self.nodes, self.rate = nodes, rate
        # Unique per process, so that concurrent test workers do not collide.
        self.prefix = prefix or f"ddpx{os.getpid() % 100000}"
        self.net = net if net is not None else 100 + os.getpid() % 150
        self._made: List[str] = []

    # ---- names and addresses
    def ns(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def addr(self, i: int) -> str:
        return f"10.{self.net}.0.{i + 1}"

    # ---- life cycle
    def __enter__(self) -> "Cluster":
        reason = why_not_available()
        if reason is not None:
            raise RuntimeError(f"multinode: {reason}")
        # A SIGTERM (timeout(1), a CI runner cancelling) would end the process without
        # __exit__ and leave the namespaces behind: turn it into SystemExit while the cluster
        # lives (the main thread only: Python delivers signals there).
        self._old_term = None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_term = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)

    def _ip(self, *argv: str) -> None:
        _run(["ip", *argv])

    def _hosts_file(self, i: int) -> str:
        # ip netns exec bind-mounts /etc/netns/<ns>/* over /etc/*: each node resolves the
        # nodes' names (its host name among them) to their addresses, as a cluster's DNS would.
        return os.path.join(_netns_etc(self.ns(i)), "hosts")

    def _create(self) -> None:
        self._ip("netns", "add", self.switch)
        self._made.append(self.switch)
        self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns, port = self.ns(i), f"p{i}"
            self._ip("netns", "add", ns)
            self._made.append(ns)
            os.makedirs(os.path.dirname(self._hosts_file(i)), exist_ok=True)
            with open(self._hosts_file(i), "w") as f:
                f.write("127.0.0.1 localhost\n" + "".join(
                    f"{self.addr(k)} {self.ns(k)}\n" for k in range(self.nodes)))
            self._ip("-n", ns, "link", "set", "lo", "up")
            self._ip("-n", ns, "link", "add", IFNAME, "type", "veth", "peer", "name", port)
            self._ip("-n", ns, "link", "set", port, "netns", self.switch)
            self._ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME)
            self._ip("-n", ns, "link", "set", IFNAME, "up")
            self._ip("-n", self.switch, "link", "set", port, "master", "br0")
            self._ip("-n", self.switch, "link", "set", port, "up")
            if self.rate is not None:
                # Both directions: the node's egress and the switch port's (the node's ingress).
                for where, dev in ((ns, IFNAME), (self.switch, port)):
                    _run(["tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                          self.rate, "burst", _burst(self.rate), "latency", "100ms"])

    def remove(self) -> None:
        """Kills what runs in the namespaces and deletes them (idempotent)."""
        for ns in reversed(self._made):
            delete_namespace(ns)
        self._made.clear()

    # ---- running things on nodes
    def popen(self, i: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None,
              **kwargs) -> subprocess.Popen:
        """Starts argv on node i: in its network namespace, and in a UTS namespace of its own
        whose host name is the node's name (as machines have their own: code that groups ranks
        by host, like post-local SGD's intra-node subgroups, sees one host per node)."""
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: from torch 2.5 the workers of every rendezvous
        # round share the agents' store, with no per-round prefix, so after a restart
        # (--max-restarts) a worker can read the address its dead peer published in the round
        # before, and Gloo's connectFullMesh then fails to connect to it. Without the sharing
        # each round has a store of its own; a job that never restarts sees no difference.
        full_env = dict(os.environ, GLOO_SOCKET_IFNAME=IFNAME, TP_SOCKET_IFNAME=IFNAME,
                        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        full_env.update(env or {})
        name_it = 'echo "$0" > /proc/sys/kernel/hostname && exec "$@"'
        return subprocess.Popen(["ip", "netns", "exec", self.ns(i), "unshare", "--uts", "--",
                                 "sh", "-c", name_it, self.ns(i), *argv], env=full_env,
                                **kwargs)

    def tx_bytes(self, i: int) -> int:
        """Bytes node i has sent on its link so far (its eth0's counter)."""
        out = _run(["ip", "netns", "exec", self.ns(i), "cat", "/proc/net/dev"]).stdout
        try:
            return tx_bytes_of(out)
        except KeyError:
            raise RuntimeError(f"multinode: no {IFNAME} in node {i}") from None

    def set_link(self, i: int, up: bool) -> None:
        """Cuts (or restores) node i's link, as a pulled cable."""
        self._ip("-n", self.ns(i), "link", "set", IFNAME, "up" if up else "down")

    def torchrun_argv(self, i: int, script: Sequence[str], nproc: int = 1,
                      python: str = sys.executable, port: int = 29400, no_python: bool = False,
                      max_restarts: int = 0, rdzv_id: str = "ddpx",
                      extra: Sequence[str] = ()) -> List[str]:
        """torchrun's command line for node i (see the module's docstring); `extra` are more
        torchrun options."""
        argv = [python, "-m", "torch.distributed.run", "--nnodes", str(self.nodes),
                "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"{self.addr(0)}:{port}", "--rdzv-id", rdzv_id, "--local-addr", self.addr(i),
                "--max-restarts", str(max_restarts)]
        if i == 0:
            argv += ["--rdzv-conf", "is_host=1"]
        if no_python:
            argv.append("--no-python")
        return argv + list(extra) + list(script)

    def torchrun(self, script: Sequence[str], timeout: float = 300.0, nproc: int = 1,
                 python: str = sys.executable, env: Optional[Dict[str, str]] = None,
                 no_python: bool = False, max_restarts: int = 0, port: int = 29400,
                 capture: bool = True, extra: Sequence[str] = (), rdzv_id: str = "ddpx"
                 ) -> List[subprocess.CompletedProcess]:
        """Runs `script` under torchrun on every node and waits (at most `timeout` seconds:
        then every node is killed and TimeoutError raised). Returns each node's result."""
        procs = []
        for i in range(self.nodes):
            procs.append(self.popen(
                i, self.torchrun_argv(i, script, nproc, python, port, no_python, max_restarts,
                                      rdzv_id=rdzv_id, extra=extra),
                env=env, stdout=subprocess.PIPE if capture else None,
                stderr=subprocess.STDOUT if capture else None, text=True))
        deadline = time.monotonic() + timeout
        results = []
        try:
            for i, p in enumerate(procs):
                left = max(0.0, deadline - time.monotonic())
                try:
                    out, _ = p.communicate(timeout=left)
                except subprocess.TimeoutExpired:
                    raise TimeoutError(f"multinode: node {i}'s torchrun still runs after "
                                       f"{timeout:.0f} s") from None
                results.append(subprocess.CompletedProcess(p.args, p.returncode, out, None))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return results


def _cleanup(prefix: str) -> None:
    for name in _run(["ip", "netns", "list"]).stdout.split("\n"):
        name = name.split(" ")[0]
        if name.startswith(prefix + "-"):
            delete_namespace(name)
            print(f"removed {name}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="say whether this machine can host a cluster")
    run = sub.add_parser("run", help="run a torchrun job across N nodes")
    run.add_argument("--nodes", type=int, default=2)
    run.add_argument("--rate", default=None,
                     help="per-link limit, tc's form (1gbit); none: unlimited")
    run.add_argument("--nproc-per-node", type=int, default=1)
    run.add_argument("--python", default=sys.executable)
    run.add_argument("--no-python", action="store_true", help="torchrun --no-python")
    run.add_argument("--timeout", type=float, default=600.0)
    run.add_argument("script", nargs=argparse.REMAINDER, help="-- script and its arguments")
    clean = sub.add_parser("cleanup", help="remove namespaces a killed run left behind")
    clean.add_argument("--prefix", required=True)
    args = p.parse_args(argv)
    if args.cmd == "check":
        reason = why_not_available()
        print("multinode: this machine can host a cluster" if reason is None
              else f"multinode: {reason}")
        return 0 if reason is None else 1
    if args.cmd == "cleanup":
        _cleanup(args.prefix)
        return 0
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        p.error("run needs a script after --")
    with Cluster(args.nodes, args.rate) as cluster:
        t0 = time.monotonic()
        sent0 = [cluster.tx_bytes(i) for i in range(args.nodes)]
        results = cluster.torchrun(script, timeout=args.timeout, nproc=args.nproc_per_node,
                                   python=args.python, no_python=args.no_python, capture=False)
        sent = [cluster.tx_bytes(i) - s for i, s in enumerate(sent0)]
    print(f"multinode: {args.nodes} nodes ({args.rate or 'unlimited'} links), "
          f"{time.monotonic() - t0:.1f} s, exit codes {[r.returncode for r in results]}, "
          f"bytes sent per node {sent}")
    return max(abs(r.returncode) for r in results)


if __name__ == "__main__":
    sys.exit(main())
