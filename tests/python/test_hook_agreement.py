"""Ranks that built their hooks differently fail fast, on every rank, with a ValueError naming the
option and both values (or both hooks), before any bucket is exchanged: each ddpx hook
all-gathers a record of what it is and how it is configured at its first bucket
(src/hooks/agreement.h). Without it they ended in Gloo's "data size doesn't match" on one rank
or a hang until the group's timeout (30 minutes by default), with nothing naming the cause.

One launch of 2 Gloo ranks runs every case in turn (a fresh DDP model each, the group stays in
step: the record all-gather completed on both ranks before they raised), drop-in and native.
"""
import functools
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_cases as dc
import ddpx
from dist_utils import catch, run_ranks

H = ddpx.hooks


def _quantized(rank, **per_rank):
    kw = {k: v[rank] for k, v in per_rank.items()}
    return H.QuantizedState(start_iter=1, **kw), H.quantized_hook


def _quantized_iter(rank):
    # Per-rank checkpoints saved one step apart: without error feedback the rotation's signs are
    # keyed by the iteration, and the ranks would decode each other's blocks with wrong ones.
    state = H.QuantizedState(use_error_feedback=False, start_iter=0)
    state.iter = 3 + rank
    return state, H.quantized_hook


def _powersgd(rank, hook=H.powerSGD_hook, **per_rank):
    kw = {k: v[rank] for k, v in per_rank.items()}
    kw.setdefault("start_powerSGD_iter", 2)
    return H.PowerSGDState(process_group=None, **kw), hook


def _post_local(rank, groups, start):
    return (H.PostLocalSGDState(process_group=None, subgroup=groups[rank],
                                start_localSGD_iter=start[rank]), H.post_localSGD_hook)


def _zero2(rank, ddp, bits):
    zero = ddpx.optim.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=0.1)
    return zero, functools.partial(H.reduce_scatter_hook, bits=bits[rank])


# name -> (what rank r registers: fn(rank, ddp, groups) -> (state, hook), the expected text).
CASES = {
    "quantized_bits": (lambda r, ddp, g: _quantized(r, bits=(8, 4)),
                       "bits is 8 on rank 0 and 4 on rank 1"),
    "quantized_iter": (lambda r, ddp, g: _quantized_iter(r), "iter is 3 on rank 0 and 4 on rank 1"),
    "quantized_exchange": (lambda r, ddp, g: _quantized(r, exchange=("auto", "reduce_scatter")),
                           "exchange is 'auto' on rank 0 and 'reduce_scatter' on rank 1"),
    "powersgd_rank": (lambda r, ddp, g: _powersgd(r, matrix_approximation_rank=(1, 2)),
                      "matrix_approximation_rank is 1 on rank 0 and 2 on rank 1"),
    "powersgd_start": (lambda r, ddp, g: _powersgd(r, start_powerSGD_iter=(10, 5)),
                       "start_powerSGD_iter is 10 on rank 0 and 5 on rank 1"),
    "batched_vs_layerwise": (
        lambda r, ddp, g: _powersgd(r, hook=(H.powerSGD_hook, H.batched_powerSGD_hook)[r]),
        "rank 0 runs powerSGD_hook and rank 1 runs batched_powerSGD_hook"),
    "quantized_vs_powersgd": (
        lambda r, ddp, g: _quantized(r, bits=(8, 8)) if r == 0 else _powersgd(r),
        "rank 0 runs quantized_hook and rank 1 runs powerSGD_hook"),
    "post_local_start": (lambda r, ddp, g: _post_local(r, g, (2, 3)),
                         "start_localSGD_iter is 2 on rank 0 and 3 on rank 1"),
    "allreduce_vs_fp16": (lambda r, ddp, g: (None, (H.allreduce_hook, H.fp16_compress_hook)[r]),
                          "rank 0 runs allreduce_hook and rank 1 runs fp16_compress_hook"),
    "wrapper_vs_not": (
        lambda r, ddp, g: _powersgd(r, hook=(H.fp16_compress_wrapper(H.powerSGD_hook),
                                             H.powerSGD_hook)[r]),
        "rank 0 runs fp16_compress_wrapper_hook(powerSGD_hook) and rank 1 runs powerSGD_hook"),
    "zero2_bits": (lambda r, ddp, g: _zero2(r, ddp, (8, 32)),
                   "bits is 8 on rank 0 and 32 on rank 1"),
}
# The same options on both ranks: the check passes and training goes on.
AGREEING = {
    "quantized": lambda r, ddp, g: _quantized(r, bits=(4, 4)),
    "powersgd": lambda r, ddp, g: _powersgd(r, matrix_approximation_rank=(2, 2)),
    "zero2": lambda r, ddp, g: _zero2(r, ddp, (8, 8)),
}


def _run(rank, make, kind, groups):
    dist._DEFAULT_FIRST_BUCKET_BYTES = dc.BUCKET_BYTES
    ddp = DDP(dc.make_model(), bucket_cap_mb=dc.BUCKET_BYTES / 2 ** 20)
    state, hook = make(rank, ddp, groups)
    if kind == "native":
        ddpx.register_comm_hook(ddp, state, hook)
    else:
        if isinstance(hook, functools.partial):  # DDP reads a drop-in hook's __name__
            bound = hook

            def hook(state, bucket):
                return bound(state, bucket)
        ddp.register_comm_hook(state, hook)
    started = time.monotonic()

    def steps():
        for step in range(3):
            ddp.zero_grad()
            dc.loss_fn(ddp, *dc.make_batch(rank, step)).backward()
    err = catch(steps)
    return err, time.monotonic() - started


def rank_cases(rank, world_size):
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank makes every group
    out = {}
    for kind in ("native", "dropin"):
        for name, (make, _) in CASES.items():
            out[(name, kind)] = _run(rank, make, kind, groups)
        for name, make in AGREEING.items():
            out[(name, kind)] = _run(rank, make, kind, groups)
        dist.barrier()
    return out


@functools.lru_cache(maxsize=None)
def results():
    return run_ranks(rank_cases, 2, timeout=240)


@pytest.mark.parametrize("kind", ["native", "dropin"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_disagreeing_ranks_fail_fast_naming_the_option(case, kind):
    text = CASES[case][1]
    got = [r[(case, kind)] for r in results()]
    for rank, (err, seconds) in enumerate(got):
        assert err is not None, (rank, "no error")
        assert err[0] == "ValueError", (rank, err)
        assert text in err[1], (rank, err[1])
        assert "did not build the same hook" in err[1], err[1]
        assert seconds < 10, (rank, seconds)
    assert got[0][0][1] == got[1][0][1]  # one message on every rank


@pytest.mark.parametrize("kind", ["native", "dropin"])
@pytest.mark.parametrize("case", sorted(AGREEING))
def test_agreeing_ranks_train(case, kind):
    for rank, r in enumerate(results()):
        err, _ = r[(case, kind)]
        assert err is None, (rank, err)
