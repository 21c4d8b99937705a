"""quantized_hook's bytes on a real link: each node's interface counter, read inside the node
over a few steps, against the bytes the hook's format accounts for, 2 (W - 1) / W times the
messages (scales and packed codes): on 2 nodes by all-gather (one message of the whole bucket to
the other node), on 3 by reduce-scatter, the same formula. Measured, not modelled: a hook that
sent more (a fallback to fp32, a message sent twice, padding that grows with the model) fails
here."""
import json
import os

import pytest

import multinode
from test_multinode import RATE, _env, _tail

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "quantized_wire_job.py")


@pytest.mark.parametrize("nodes,bits", [(2, 8), (3, 1)])
def test_bytes_on_the_wire_are_the_formats(tmp_path, nodes, bits):
    with multinode.Cluster(nodes, rate=RATE) as cluster:
        results = cluster.torchrun([JOB, "--bits", str(bits), "--out", str(tmp_path)],
                                   timeout=300, env=_env())
    assert all(r.returncode == 0 for r in results), _tail(results)
    with open(tmp_path / "wire.json") as f:
        out = json.load(f)
    mean = sum(r["sent"] for r in out["rows"]) / len(out["rows"])
    modelled = out["modelled"]
    # Above the payload: TCP/IP headers (well under 4% at full segments), message padding to 16
    # bytes, Gloo's framing and the barrier; below it, nothing.
    print(f"{nodes} nodes, {bits} bits: {mean:.0f} bytes per step per rank, format {modelled:.0f}")
    assert modelled <= mean <= modelled * 1.06, (mean, modelled, out["rows"])
    # And far below allreduce's: 2 (W - 1) / W of the fp32 bucket.
    allreduce = 2 * (nodes - 1) / nodes * out["fp32_bytes"]
    assert mean <= allreduce * (bits / 32) * 1.2, (mean, allreduce)
