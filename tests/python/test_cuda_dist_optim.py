"""CUDA: ddpx.optim.DistributedOptimizer over RPC with the parameters on the GPU. Three TensorPipe
workers share the one GPU, each with the device map {0: 0} to every peer, so that the forward's
activations and distributed autograd's gradients travel GPU to GPU; the owners step in C++ (the
functional optimizers' CUDA kernels) on the stream the RPC agent gives the request. Differential
against torch's DistributedOptimizer on the same parameters and gradients, as
test_dist_optim.py does on the CPU. Skipped without a GPU (and without a CUDA build of ddpx)."""
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

import ddpx
from dist_utils import run_ranks
from ddpx.optim import DistributedOptimizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not ddpx._C.with_cuda,
                                reason="needs a CUDA GPU and a CUDA build of ddpx")

WORLD = 3
STEPS = 20
CONFIGS = [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.5)),
    (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.9, centered=True)),
]
_PARAMS = {}


def _init_rpc_cuda(rank, init_file):
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{init_file}", rpc_timeout=120)
    for peer in range(WORLD):
        if peer != rank:
            opts.set_device_map(f"worker{peer}", {0: 0})
    torch.cuda.set_device(0)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD, rpc_backend_options=opts)


def _make_param(key, seed, shape):
    g = torch.Generator().manual_seed(seed)
    _PARAMS[key] = torch.rand(shape, generator=g).cuda().requires_grad_(True)
    return _PARAMS[key]


def _get_param(key):
    p = _PARAMS[key]
    assert p.is_cuda
    return p.detach().cpu()


def _forward(key, x):
    assert x.is_cuda, "the device map did not deliver the activation on the GPU"
    return torch.mm(_PARAMS[key], x)


def _train(cls, dist_optim_cls, kwargs, tag):
    r1 = rpc.remote("worker1", _make_param, args=(f"{tag}1", 1, (64, 64)))
    r2 = rpc.remote("worker2", _make_param, args=(f"{tag}2", 2, (64, 64)))
    initial = [rpc.rpc_sync(f"worker{k}", _get_param, args=(f"{tag}{k}",)) for k in (1, 2)]
    opt = dist_optim_cls(cls, [r1, r2], **kwargs)
    g = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        with dist_autograd.context() as cid:
            x = torch.rand((64, 8), generator=g).cuda()
            h = rpc.rpc_sync("worker1", _forward, args=(f"{tag}1", x))
            out = rpc.rpc_sync("worker2", _forward, args=(f"{tag}2", torch.tanh(h)))
            loss = (out - 0.5).pow(2).mean()
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
    native = getattr(opt, "is_native", None)
    final = [rpc.rpc_sync(f"worker{k}", _get_param, args=(f"{tag}{k}",)) for k in (1, 2)]
    return initial, final, native


def _rank(rank, world_size, init_file):
    _init_rpc_cuda(rank, init_file)
    out = None
    if rank == 0:
        out = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, (cls, kwargs) in enumerate(CONFIGS):
                theirs = _train(cls, TorchDistributedOptimizer, kwargs, f"t{i}_")
                ours = _train(cls, DistributedOptimizer, kwargs, f"d{i}_")
                out.append((theirs, ours))
    rpc.shutdown()
    return out


@pytest.fixture(scope="module")
def cuda_results():
    with tempfile.TemporaryDirectory(prefix="ddpx_rpc_cuda_") as d:
        return run_ranks(_rank, WORLD, args=(os.path.join(d, "rpc_init"),), timeout=300.0)[0]


@pytest.mark.parametrize("i", range(len(CONFIGS)),
                         ids=[f"cuda-{c.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"
                              for c, kw in CONFIGS])
def test_cuda_rpc_step_matches_torch(cuda_results, i):
    (initial, theirs, _), (initial_ours, ours, native) = cuda_results[i]
    assert native, "ddpx fell back to the Python path for a class with a C++ form"
    for a, b in zip(initial, initial_ours):
        assert torch.equal(a, b)
    for start, t, o in zip(initial, theirs, ours):
        assert not torch.equal(t, start), "torch's optimizer did not move the weights"
        # torch's functional optimizers and ddpx's kernels on the GPU: the same formulas, FMA
        # contraction may differ by an ulp per step.
        torch.testing.assert_close(o, t, rtol=1e-5, atol=1e-6)
