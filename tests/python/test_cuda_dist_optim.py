"""CUDA: ddpx.optim.DistributedOptimizer over RPC with the parameters on the GPU. Three TensorPipe
workers share the one GPU, each with the device map {0: 0} to every peer, so that the forward's
activations and distributed autograd's gradients travel GPU to GPU; the owners step in C++ (the
functional optimizers' CUDA kernels) on the stream the RPC agent gives the request. The same
differential training as test_dist_optim.py's (its _train), against torch's
DistributedOptimizer. Skipped without a GPU (and without a CUDA build of ddpx)."""
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

import ddpx
from ddpx.optim import DistributedOptimizer
from dist_utils import run_ranks
from test_dist_optim import _train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not ddpx._C.with_cuda,
                                reason="needs a CUDA GPU and a CUDA build of ddpx")

WORLD = 3
N = 8  # 8 x 8 weights: 64 elements per kernel, small enough to stay finite over the steps
CONFIGS = [
    (torch.optim.SGD, dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.5)),
    (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True)),
]


def _rank(rank, world_size, init_file, device):
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{init_file}", rpc_timeout=120)
    if device == "cuda":
        for peer in range(WORLD):
            if peer != rank:
                opts.set_device_map(f"worker{peer}", {0: 0})
        torch.cuda.set_device(0)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD, rpc_backend_options=opts)
    out = None
    if rank == 0:
        out = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, (cls, kwargs) in enumerate(CONFIGS):
                theirs = _train(cls, TorchDistributedOptimizer, kwargs, f"t{i}_", device, N)
                ours = _train(cls, DistributedOptimizer, kwargs, f"d{i}_", device, N)
                out.append((theirs, ours))
    rpc.shutdown()
    return out


def run(device):
    with tempfile.TemporaryDirectory(prefix="ddpx_rpc_cuda_") as d:
        return run_ranks(_rank, WORLD, args=(os.path.join(d, "rpc_init"), device),
                         timeout=300.0)[0]


@pytest.fixture(scope="module")
def cuda_results():
    return run("cuda")


@pytest.mark.parametrize("i", range(len(CONFIGS)),
                         ids=[f"cuda-{c.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"
                              for c, kw in CONFIGS])
def test_cuda_rpc_step_matches_torch(cuda_results, i):
    (initial, theirs), (initial_ours, ours) = cuda_results[i]
    for a, b in zip(initial, initial_ours):
        assert torch.equal(a, b)
    for start, t, o in zip(initial, theirs, ours):
        assert t.abs().max() < 1e3, "torch's run diverged: the comparison would say little"
        assert not torch.equal(t, start), "torch's optimizer did not move the weights"
        # torch's functional optimizers and ddpx's kernels on the GPU: the same formulas, FMA
        # contraction may differ by an ulp per step.
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-6)
