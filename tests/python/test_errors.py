"""Bad inputs: each must fail with the right exception type and a message that says what is
wrong, at registration where possible, and leave the DDP model usable when registration
failed. One launch of 2 ranks runs every distributed case; the tests read its record.
"""
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_cases as dc
import ddpx
import torch_compat as tc
from dist_utils import catch, run_ranks

WORLD_SIZE = 2


def _backward(ddp, rank):
    dc.loss_fn(ddp, *dc.make_batch(rank, 0)).backward()


def rank_errors(rank: int, world_size: int):
    out = {}

    # -- a second hook, by either path, is refused by DDP's Reducer -------------------------
    ddp = dc.make_ddp(dc.make_model(), "ddpx_allreduce_dropin")
    out["dropin_then_native"] = catch(
        lambda: ddpx.register_comm_hook(ddp, None, ddpx.hooks.fp16_compress_hook))
    ddp = dc.make_ddp(dc.make_model(), "ddpx_allreduce_native")
    out["native_then_native"] = catch(
        lambda: ddpx.register_comm_hook(ddp, None, ddpx.hooks.fp16_compress_hook))
    out["native_then_dropin"] = catch(
        lambda: ddp.register_comm_hook(None, ddpx.hooks.fp16_compress_hook))
    # The first hook stays in charge: the gradients are allreduce's, not fp16's.
    _backward(ddp, rank)
    out["grads_after_refused_second_hook"] = dc.flat_grad(ddp)
    ref = dc.make_ddp(dc.make_model(), "torch_allreduce")
    _backward(ref, rank)
    out["grads_torch_allreduce"] = dc.flat_grad(ref)

    # -- registration refused before anything is installed ------------------------------------
    ddp = dc.make_ddp(dc.make_model(), "torch_none")
    out["torch_hook_natively"] = catch(
        lambda: ddpx.register_comm_hook(ddp, None, torch_hooks.allreduce_hook))
    out["python_fn_natively"] = catch(
        lambda: ddpx.register_comm_hook(ddp, None, lambda state, bucket: None))
    out["state_not_pg_native"] = catch(
        lambda: ddpx.register_comm_hook(ddp, "group", ddpx.hooks.allreduce_hook))
    out["non_ddp_model"] = catch(
        lambda: ddpx.register_comm_hook(dc.make_model(), None, ddpx.hooks.allreduce_hook))
    out["C_hook_none"] = catch(lambda: ddpx._C.register_comm_hook(ddp.reducer, None))
    # ... so a valid hook can still be registered afterwards, and works.
    out["register_after_refusals"] = catch(
        lambda: ddpx.register_comm_hook(ddp, None, ddpx.hooks.allreduce_hook))
    _backward(ddp, rank)
    out["grads_after_refusals"] = dc.flat_grad(ddp)
    # DDP's logging data names the hook as the drop-in path (and torch) name it.
    out["logged_name_native"] = ddp._get_ddp_logging_data().get("comm_hook")
    dropin = dc.make_ddp(dc.make_model(), "torch_none")
    dropin.register_comm_hook(None, ddpx.hooks.allreduce_hook)
    out["logged_name_dropin"] = dropin._get_ddp_logging_data().get("comm_hook")

    # A group this rank is not a member of (torch hands such ranks GroupMember.NON_GROUP_MEMBER):
    # the error says so (not a bare "got object" / "got int").
    only_rank0 = dist.new_group(ranks=[0])
    out["non_member_group"] = catch(lambda: ddpx.register_comm_hook(
        dc.make_ddp(dc.make_model(), "torch_none"), only_rank0, ddpx.hooks.allreduce_hook))
    out["non_member_state"] = catch(lambda: ddpx.hooks.PowerSGDState(only_rank0))
    dist.barrier()

    # -- errors the C++ constructors raise ----------------------------------------------------
    out["compress_hook_fp32"] = catch(
        lambda: ddpx._C.compress_hook(dist.group.WORLD, torch.float32))
    out["compress_wrapper_fp64"] = catch(
        lambda: ddpx._C.compress_wrapper(ddpx.hooks.native_hook(ddpx.hooks.allreduce_hook),
                                         torch.float64))
    out["compress_hook_dtype_not_dtype"] = catch(
        lambda: ddpx._C.compress_hook(dist.group.WORLD, "float16"))

    # -- errors raised while the hook runs, i.e. from backward() -------------------------------
    # torch accepts any state object; ddpx's drop-in hook checks it when it first runs.
    ddp = dc.make_ddp(dc.make_model(), "torch_none")
    ddp.register_comm_hook(42, ddpx.hooks.fp16_compress_hook)
    loss = dc.loss_fn(ddp, *dc.make_batch(rank, 0))
    out["state_not_pg_dropin_backward"] = catch(loss.backward)

    for mode in dc.MODES:
        torch.manual_seed(0)
        emb = DDP(nn.Embedding(10, 4, sparse=True))
        if mode == "dropin":
            emb.register_comm_hook(None, ddpx.hooks.fp16_compress_hook)
        else:
            ddpx.register_comm_hook(emb, None, ddpx.hooks.fp16_compress_hook)
        loss = emb(torch.tensor([1, 2, 2 + rank])).sum()  # the forward pass is fine
        out[f"sparse_{mode}_backward"] = catch(loss.backward)
        dist.barrier()

    # Sparse buckets where torch averages them: allreduce_hook, post_localSGD_hook
    # and powerSGD_hook before start_powerSGD_iter give torch's allreduce_hook's gradient;
    # PowerSGD once compressing raises a clear error.
    def sparse_grad(register, steps=1):
        torch.manual_seed(0)
        emb = DDP(nn.Embedding(10, 4, sparse=True))
        register(emb)
        for step in range(steps):
            emb.zero_grad()
            emb(torch.tensor([1, 2, 2 + rank + step])).sum().backward()
        return emb.module.weight.grad.to_dense()

    out["sparse_torch"] = sparse_grad(
        lambda m: m.register_comm_hook(None, torch_hooks.allreduce_hook))
    for mode in dc.MODES:
        reg = (lambda m, st, h: m.register_comm_hook(st, h)) if mode == "dropin" else \
            (lambda m, st, h: ddpx.register_comm_hook(m, st, h))
        out[f"sparse_allreduce_{mode}"] = sparse_grad(
            lambda m: reg(m, None, ddpx.hooks.allreduce_hook))
        out[f"sparse_post_local_{mode}"] = sparse_grad(lambda m: reg(
            m, ddpx.hooks.PostLocalSGDState(None, dist.group.WORLD, start_localSGD_iter=5),
            ddpx.hooks.post_localSGD_hook))
        out[f"sparse_powersgd_{mode}"] = sparse_grad(lambda m: reg(
            m, ddpx.hooks.PowerSGDState(None, start_powerSGD_iter=5), ddpx.hooks.powerSGD_hook))
        out[f"sparse_powersgd_compressing_{mode}"] = catch(lambda: sparse_grad(lambda m: reg(
            m, ddpx.hooks.PowerSGDState(None, start_powerSGD_iter=2), ddpx.hooks.powerSGD_hook),
            steps=3))
        dist.barrier()

    # A bucket that is not floating point: DDP never builds one (integer tensors cannot require
    # grad, and 1.13's DDP cannot even broadcast complex parameters), so a Python hook hands
    # the C++ hook a real GradBucket whose buffer it replaced by an int32 tensor.
    def int_bucket_hook(state, bucket):
        bucket.set_buffer(bucket.buffer().to(torch.int32))
        return ddpx.hooks.native_hook(ddpx.hooks.allreduce_hook, state).run(bucket).then(
            lambda fut: fut.value())

    ddp = dc.make_ddp(dc.make_model(), "torch_none")
    ddp.register_comm_hook(None, int_bucket_hook)
    loss = dc.loss_fn(ddp, *dc.make_batch(rank, 0))
    out["int_bucket_backward"] = catch(loss.backward)
    return out


@functools.lru_cache(maxsize=None)
def record():
    return run_ranks(rank_errors, WORLD_SIZE)


def check(case: str, exc_type: str, *needles: str):
    for r, rank_record in enumerate(record()):
        got = rank_record[case]
        assert got is not None, f"{case}: nothing was raised on rank {r}"
        name, msg = got
        assert name == exc_type, (case, r, got)
        for needle in needles:
            assert needle in msg, (case, r, needle, msg)


ONCE = "can only be called once"


@pytest.mark.parametrize("case", ["dropin_then_native", "native_then_native",
                                  "native_then_dropin"])
def test_second_registration_is_refused(case):
    check(case, "RuntimeError", ONCE)


def test_refused_second_hook_leaves_the_first_in_charge():
    for rank_record in record():
        assert torch.equal(rank_record["grads_after_refused_second_hook"],
                           rank_record["grads_torch_allreduce"])


@pytest.mark.parametrize("case", ["torch_hook_natively", "python_fn_natively"])
def test_native_registration_needs_a_ddpx_hook(case):
    check(case, "TypeError", "ddpx hook", "ddp_model.register_comm_hook")


def test_native_state_must_be_a_process_group():
    check("state_not_pg_native", "TypeError", "ProcessGroup", "str")


def test_dropin_state_must_be_a_process_group():
    """Drop-in: torch stores any state; the ddpx hook's TypeError surfaces from backward()
    (torch 1.13: as DDP's RuntimeError, carrying the TypeError's text; 2.x: the TypeError)."""
    needles = ["state must be a torch.distributed.ProcessGroup or None", "int"]
    if not tc.HOOK_ERRORS_KEEP_TYPE:
        needles.append("TypeError")
    check("state_not_pg_dropin_backward", tc.hook_error_type("TypeError"), *needles)


def test_non_ddp_model_is_refused():
    check("non_ddp_model", "TypeError", "DistributedDataParallel", "Sequential")


def test_C_register_refuses_none():
    check("C_hook_none", "RuntimeError", "hook must not be None")


def test_refused_registrations_install_nothing():
    """After all those refusals, a valid registration works and gives allreduce's gradients."""
    for rank_record in record():
        assert rank_record["register_after_refusals"] is None
        assert torch.equal(rank_record["grads_after_refusals"],
                           rank_record["grads_torch_allreduce"])


def test_compress_dtypes_are_checked():
    check("compress_hook_fp32", "RuntimeError", "torch.float16 or torch.bfloat16", "Float")
    check("compress_wrapper_fp64", "RuntimeError", "torch.float16 or torch.bfloat16", "Double")
    check("compress_hook_dtype_not_dtype", "TypeError", "dtype must be a torch.dtype")


@pytest.mark.parametrize("mode", dc.MODES)
def test_sparse_gradients_are_refused_in_backward(mode):
    """nn.Embedding(sparse=True): DDP hands the hook a sparse bucket during backward; the hook
    refuses it and DDP raises a RuntimeError from backward(), on every rank."""
    check(f"sparse_{mode}_backward", "RuntimeError", "sparse", "fp16_compress_hook")


def test_non_floating_bucket_is_refused():
    check("int_bucket_backward", "RuntimeError", "floating-point", "Int")


# ---- no process group needed -------------------------------------------------------------------

@pytest.mark.parametrize("wrapper", [ddpx.hooks.fp16_compress_wrapper,
                                     ddpx.hooks.bf16_compress_wrapper])
@pytest.mark.parametrize("inner", [torch_hooks.allreduce_hook, lambda state, bucket: None],
                         ids=["torch_allreduce_hook", "lambda"])
def test_wrapper_needs_a_ddpx_hook(wrapper, inner):
    with pytest.raises(TypeError, match="ddpx hook"):
        wrapper(inner)


@pytest.mark.parametrize("state", ["group", 3, object()])
def test_native_hook_state_type(state):
    with pytest.raises(TypeError, match="ProcessGroup"):
        ddpx.hooks.native_hook(ddpx.hooks.fp16_compress_hook, state)


def test_default_group_needs_init():
    assert not dist.is_initialized()  # the ranks run in their own processes
    with pytest.raises(RuntimeError, match="not initialized"):
        ddpx.hooks.native_hook(ddpx.hooks.allreduce_hook, None)


def test_noop_needs_no_group():
    hook = ddpx.hooks.native_hook(ddpx.hooks.noop_hook, None)
    assert hook.name == "noop_hook"


def test_native_registration_logs_the_hook_name_as_the_dropin_path():
    for rank_record in record():
        assert rank_record["logged_name_native"] == rank_record["logged_name_dropin"]
        assert rank_record["logged_name_native"] == "allreduce_hook"


@pytest.mark.parametrize("case", ["non_member_group", "non_member_state"])
def test_a_group_this_rank_is_not_in_is_named_as_such(case):
    rec = record()
    assert rec[0][case] is None  # rank 0 is the group's member
    for rank_record in rec[1:]:
        name, msg = rank_record[case]
        assert name == "ValueError" and "this rank is not a member" in msg, rank_record[case]


@pytest.mark.parametrize("mode", dc.MODES)
@pytest.mark.parametrize("hook", ["allreduce", "post_local", "powersgd"])
def test_sparse_gradients_average_like_torch(hook, mode):
    """nn.Embedding(sparse=True): allreduce_hook, post_localSGD_hook (global phase) and
    powerSGD_hook before start_powerSGD_iter average the sparse bucket as torch's
    allreduce_hook does (bit for bit on 2 ranks)."""
    for rank_record in record():
        got, ref = rank_record[f"sparse_{hook}_{mode}"], rank_record["sparse_torch"]
        assert torch.equal(got, ref), (got, ref)


@pytest.mark.parametrize("mode", dc.MODES)
def test_sparse_gradients_cannot_be_compressed(mode):
    check(f"sparse_powersgd_compressing_{mode}", "RuntimeError", "powerSGD_hook",
          "sparse gradients cannot be compressed", "start_powerSGD_iter")
