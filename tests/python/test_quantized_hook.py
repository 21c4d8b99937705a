"""ddpx.hooks.QuantizedState and quantized_hook through real DDP models on 2-3 Gloo ranks: the
drop-in and native registrations give the same gradients bit for bit and every rank the same
ones; before start_iter the hook is allreduce_hook, bit for bit; 16-bit models and the compress
wrappers work; a checkpoint (per-rank state_dict, and pickling) resumes bit for bit; training
with every bit width converges. The kernels' closed forms are tested in C++
(tests/cpp/test_quantized.cpp).

Each scenario runs once (one launch of W ranks) and the tests read its results, so
``pytest -k`` selects one scenario.
"""
import functools
import inspect
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_cases as dc
import ddpx
import torch_compat as tc
from dist_utils import catch, run_ranks

STEPS = 6
START = 2
REL_ERROR = {8: 0.05, 4: 0.3, 2: 1.5, 1: 2.0}


def _register(ddp: DDP, kind: str, state) -> None:
    if kind == "native":
        ddpx.register_comm_hook(ddp, state, ddpx.hooks.quantized_hook)
    elif kind == "dropin":
        ddp.register_comm_hook(state, ddpx.hooks.quantized_hook)
    elif kind == "fp16_wrap":
        ddpx.register_comm_hook(ddp, state, ddpx.hooks.fp16_compress_wrapper(
            ddpx.hooks.quantized_hook))
    elif kind == "allreduce":
        ddpx.register_comm_hook(ddp, None, ddpx.hooks.allreduce_hook)
    else:
        raise ValueError(kind)


def _train(rank: int, ddp: DDP, steps, dtype=torch.float32, opt=None):
    grads = []
    for step in steps:
        ddp.zero_grad()
        x, y = dc.make_batch(rank, step, dtype)
        dc.loss_fn(ddp, x, y).backward()
        grads.append(dc.flat_grad(ddp))
        if opt is not None:
            opt.step()
    return grads


def other_exchange(world_size: int) -> str:
    """The exchange that "auto" does not take on world_size ranks."""
    return "reduce_scatter" if world_size == 2 else "allgather"


def rank_grads(rank: int, world_size: int, bits: int, dtype: torch.dtype, stochastic: bool):
    out = {}
    for kind in ("native", "dropin", "allreduce", "other_exchange", "rotated") + (
            ("fp16_wrap",) if dtype == torch.float32 else ()):
        dist._DEFAULT_FIRST_BUCKET_BYTES = dc.BUCKET_BYTES
        ddp = DDP(dc.make_model(dtype), bucket_cap_mb=dc.BUCKET_BYTES / 2 ** 20)
        exchange = other_exchange(world_size) if kind == "other_exchange" else "auto"
        # "auto" rotates without error feedback only; here it is asked for with it.
        rotation = "hadamard" if kind == "rotated" else "auto"
        state = ddpx.hooks.QuantizedState(bits=bits, block_size=32, start_iter=START,
                                          stochastic_rounding=stochastic, exchange=exchange,
                                          rotation=rotation)
        _register(ddp, "native" if kind in ("other_exchange", "rotated") else kind, state)
        out[kind] = _train(rank, ddp, range(STEPS), dtype)
    return out


SCENARIOS = [(2, 8, torch.float32, False), (3, 4, torch.float32, False),
             (2, 1, torch.float32, False), (3, 2, torch.float32, True),
             (2, 8, torch.float16, False), (2, 4, torch.bfloat16, True)]


@functools.lru_cache(maxsize=None)
def grads_of(world_size, bits, dtype, stochastic):
    return run_ranks(rank_grads, world_size, args=(bits, dtype, stochastic))


@pytest.mark.parametrize("world_size,bits,dtype,stochastic", SCENARIOS,
                         ids=[f"W{w}-{b}bit-{str(d)[6:]}{'-sr' if s else ''}"
                              for w, b, d, s in SCENARIOS])
def test_dropin_native_and_ranks_agree(world_size, bits, dtype, stochastic):
    if dtype in (torch.float16, torch.bfloat16) and tc.TORCH_VERSION < (2, 0):
        # torch 1.13 has no CPU fp16 matmul for the model and no bf16 in Gloo for the warm-up's
        # allreduce; the hook's 16-bit buckets are tested in C++ (test_quantized).
        pytest.skip("16-bit CPU models need torch >= 2.0")
    res = grads_of(world_size, bits, dtype, stochastic)
    for rank in range(world_size):
        for step in range(STEPS):
            native = res[rank]["native"][step]
            other = res[rank]["other_exchange"][step]
            assert native.dtype == dtype
            assert torch.equal(native, res[rank]["dropin"][step]), (rank, step)
            assert torch.equal(native, res[0]["native"][step]), (rank, step)
            rotated = res[rank]["rotated"][step]
            # Both exchanges, and the rotation, give every rank the same bits.
            assert torch.equal(other, res[0]["other_exchange"][step]), (rank, step)
            assert torch.equal(rotated, res[0]["rotated"][step]), (rank, step)
            allreduce = res[rank]["allreduce"][step]
            if step < START:
                # The warm-up is allreduce_hook's mean, bit for bit.
                assert torch.equal(native, allreduce), (rank, step)
                assert torch.equal(other, allreduce), (rank, step)
                assert torch.equal(rotated, allreduce), (rank, step)
            elif step == START:
                # The first quantized step (residuals still zero): near the mean, not equal to
                # it. Relative L2 error, loose bounds of the two levels' errors. (Later steps
                # add the residuals' changes, e_{t-1} - e_t, which the C++ tests bound.)
                # Stochastic rounding trades a larger error for no bias: twice the bound.
                bound = REL_ERROR[bits] * (2 if stochastic else 1)
                for got in (native, other, rotated):
                    diff = (got.double() - allreduce.double()).norm().item()
                    rel = diff / allreduce.double().norm().item()
                    assert 0 < rel <= bound, (rank, step, rel)
                # The exchanges quantize differently (once by all-gather, twice otherwise).
                assert not torch.equal(native, other), (rank, step)
                assert not torch.equal(native, rotated), (rank, step)
        if "fp16_wrap" in res[rank]:
            # The wrapper quantizes the fp16 cast of the bucket: close to the fp32 hook's.
            wrapped = res[rank]["fp16_wrap"][STEPS - 1]
            assert torch.isfinite(wrapped).all()
            assert torch.equal(wrapped, res[0]["fp16_wrap"][STEPS - 1])


def rank_resume(rank: int, world_size: int, path: str, via_pickle: bool):
    """Trains 6 steps; saves after 3 (model, optimizer, hook state: per rank); a new DDP model
    and state loaded from the files trains steps 3-5 again."""
    def build():
        dist._DEFAULT_FIRST_BUCKET_BYTES = dc.BUCKET_BYTES
        ddp = DDP(dc.make_model(), bucket_cap_mb=dc.BUCKET_BYTES / 2 ** 20)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        return ddp, opt

    ddp, opt = build()
    state = ddpx.hooks.QuantizedState(bits=2, block_size=16, start_iter=1,
                                      stochastic_rounding=True)
    ddpx.register_comm_hook(ddp, state, ddpx.hooks.quantized_hook)
    _train(rank, ddp, range(3), opt=opt)
    saved = {"model": ddp.state_dict(), "opt": opt.state_dict(),
             "hook": pickle.dumps(state) if via_pickle else state.state_dict()}
    torch.save(saved, f"{path}.{rank}")
    original = _train(rank, ddp, range(3, 6), opt=opt)

    ddp2, opt2 = build()
    loaded = torch.load(f"{path}.{rank}", weights_only=False)
    ddp2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["opt"])
    if via_pickle:
        state2 = pickle.loads(loaded["hook"])
    else:
        state2 = ddpx.hooks.QuantizedState()
        state2.load_state_dict(loaded["hook"])
    assert state2.bits == 2 and state2.iter == 3
    ddpx.register_comm_hook(ddp2, state2, ddpx.hooks.quantized_hook)
    resumed = _train(rank, ddp2, range(3, 6), opt=opt2)
    # Another rank's file is refused, with the way out in the message.
    other = torch.load(f"{path}.{(rank + 1) % world_size}", weights_only=False)["hook"]
    err = None if via_pickle else catch(lambda: ddpx.hooks.QuantizedState().load_state_dict(other))
    return original, resumed, err


@pytest.mark.parametrize("via_pickle", [False, True], ids=["state_dict", "pickle"])
def test_checkpoint_resumes_bit_for_bit(tmp_path, via_pickle):
    res = run_ranks(rank_resume, 2, args=(str(tmp_path / "ckpt"), via_pickle))
    for rank, (original, resumed, err) in enumerate(res):
        for step, (a, b) in enumerate(zip(original, resumed)):
            assert torch.equal(a, b), (rank, step)
        if not via_pickle:
            assert err is not None and err[0] == "ValueError" and "allow_reshard" in err[1], err


SEEDS = range(4)


def rank_converge(rank: int, world_size: int, bits: int):
    """Full-batch regression on a fixed teacher, 150 steps of SGD with momentum, for each of
    SEEDS (the rank's batch): the initial loss, and the mean of the last 30 steps' losses with
    allreduce and with the quantized hook, the same data and steps."""
    runs = []
    for seed in SEEDS:
        losses = {}
        for kind in ("allreduce", "ef"):
            dist._DEFAULT_FIRST_BUCKET_BYTES = dc.BUCKET_BYTES
            ddp = DDP(dc.make_model(), bucket_cap_mb=dc.BUCKET_BYTES / 2 ** 20)
            if kind != "allreduce":
                state = ddpx.hooks.QuantizedState(bits=bits, block_size=64, start_iter=5,
                                                  use_error_feedback=True)
                ddpx.register_comm_hook(ddp, state, ddpx.hooks.quantized_hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.2, momentum=0.9)
            x, y = dc.make_batch(rank, seed)
            with torch.no_grad():
                losses["initial"] = dc.loss_fn(ddp, x, y).item()
            tail = []
            for step in range(150):
                opt.zero_grad()
                loss = dc.loss_fn(ddp, x, y)
                loss.backward()
                opt.step()
                if step >= 120:
                    tail.append(loss.item())
            losses[kind] = sum(tail) / len(tail)
        runs.append(losses)
    return runs


@pytest.mark.parametrize("bits", [8, 4, 2, 1])
def test_training_converges_with_error_feedback(bits):
    res = run_ranks(rank_converge, 2, args=(bits,))
    runs = [losses for rank_runs in res for losses in rank_runs]
    if bits >= 2:
        # 8 and 4 bits within 2% of allreduce's loss, 2 bits within 5% (the accuracy
        # targets, on this small problem), in the median over the ranks and batches: near its
        # floor a run's loss moves by several percent, either way, with small perturbations of
        # the trajectory. Each run within four times that.
        # Without error feedback 2 bits end 60-160% above allreduce here.
        tol = 0.02 if bits >= 4 else 0.05
        ratios = sorted(r["ef"] / r["allreduce"] for r in runs)
        median = (ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2]) / 2
        assert median <= 1 + tol, ratios
        assert ratios[-1] <= 1 + 4 * tol, ratios
    else:
        # 1 bit trains: more than an order of magnitude below the start. (Whether error
        # feedback helps at a fixed small step count depends on the rank's batch here; the
        # C++ tests show what it guarantees: averages that converge to the mean.)
        for losses in runs:
            assert losses["ef"] <= losses["initial"] / 15, losses


def rank_api(rank: int, world_size: int):
    st = ddpx.hooks.QuantizedState()
    checks = {
        "repr": repr(st),
        "slots": list(type(st).__slots__),
        "no_dict": not hasattr(st, "__dict__"),
        "bits3": catch(lambda: ddpx.hooks.QuantizedState(bits=3)),
        "block12": catch(lambda: ddpx.hooks.QuantizedState(block_size=12)),
        "start": catch(lambda: ddpx.hooks.QuantizedState(start_iter=-1)),
        "str_bits": catch(lambda: ddpx.hooks.QuantizedState(bits="8")),
        "misspelt": catch(lambda: setattr(st, "bit", 4)),
        "exchange_bad": catch(lambda: ddpx.hooks.QuantizedState(exchange="ring")),
        "exchange_int": catch(lambda: ddpx.hooks.QuantizedState(exchange=2)),
        "exchange_allreduce": catch(lambda: ddpx.hooks.QuantizedState(exchange="allreduce")),
        "set_exchange_bad": catch(lambda: setattr(st, "exchange", "ring")),
        "rotation_bad": catch(lambda: ddpx.hooks.QuantizedState(rotation="givens")),
        "rotation_bool": catch(lambda: ddpx.hooks.QuantizedState(rotation=True)),
        "rotation_block": catch(lambda: ddpx.hooks.QuantizedState(rotation="hadamard",
                                                                  block_size=96)),
        "set_bad": catch(lambda: setattr(st, "bits", 5)),
        "wrong_state": catch(lambda: ddpx.register_comm_hook(
            DDP(dc.make_model()), dist.group.WORLD, ddpx.hooks.quantized_hook)),
    }
    st.bits = 4
    st.stochastic_rounding = True
    st.iter = 7
    st.exchange = "reduce_scatter"
    checks["after_set"] = (st.bits, st.stochastic_rounding, st.iter, st.state_dict()["bits"],
                           st.exchange, st.state_dict()["exchange"])
    st.rotation = "hadamard"
    checks["pickled_exchange"] = pickle.loads(pickle.dumps(st)).exchange
    checks["pickled_rotation"] = pickle.loads(pickle.dumps(st)).rotation
    old = st.state_dict()
    checks["saved_rotation"] = old["rotation"]
    del old["exchange"], old["rotation"]
    st.exchange = "allgather"
    st.load_state_dict(old)
    checks["older_checkpoint"] = (st.exchange, st.rotation)
    return checks


def test_state_api_follows_torchs_conventions():
    (c,) = run_ranks(rank_api, 1)
    params = inspect.signature(ddpx.hooks.QuantizedState).parameters
    assert list(params) == ["process_group", "bits", "block_size", "use_error_feedback",
                            "start_iter", "random_seed", "stochastic_rounding", "exchange",
                            "rotation"]
    assert [p.default for p in params.values()] == [None, 8, 256, True, 10, 0, False, "auto",
                                                    "auto"]
    assert c["slots"] == ["process_group", "bits", "block_size", "use_error_feedback",
                          "start_iter", "random_seed", "stochastic_rounding", "exchange",
                          "rotation", "iter"]
    assert c["no_dict"]
    assert "bits=8" in c["repr"]
    for key, kind, text in [("bits3", "ValueError", "bits must be 1, 2, 4 or 8, got 3"),
                            ("block12", "ValueError", "block_size must be a multiple of 8"),
                            ("start", "ValueError", "start_iter must be >= 0"),
                            ("str_bits", "TypeError", "bits must be an int"),
                            ("misspelt", "AttributeError", "bit"),
                            ("set_bad", "ValueError", "got 5"),
                            ("exchange_bad", "ValueError", "'allgather' or 'reduce_scatter'"),
                            ("exchange_int", "TypeError", "exchange must be a str"),
                            ("exchange_allreduce", "ValueError", "got 'allreduce'"),
                            ("set_exchange_bad", "ValueError", "got 'ring'"),
                            ("rotation_bad", "ValueError", "'hadamard' or 'none', got 'givens'"),
                            ("rotation_bool", "TypeError", "rotation must be a str"),
                            ("rotation_block", "ValueError", "power of two in [8, 8192], got 96"),
                            ("wrong_state", "TypeError", "QuantizedState")]:
        assert c[key] is not None and c[key][0] == kind and text in c[key][1], (key, c[key])
    assert c["after_set"] == (4, True, 7, 4, "reduce_scatter", "reduce_scatter")
    assert c["pickled_exchange"] == "reduce_scatter"
    assert c["pickled_rotation"] == c["saved_rotation"] == "hadamard"
    # A checkpoint from before the options resumes as it was taken: by reduce-scatter, unrotated.
    assert c["older_checkpoint"] == ("reduce_scatter", "none")
    assert list(inspect.signature(ddpx.hooks.quantized_hook).parameters) == ["state", "bucket"]


def rank_by_name(rank: int, world_size: int):
    """DDPCommHookType's quantized members register quantized_hook with a QuantizedState of
    their bits; the member's value takes the state's options, as torch's PowerSGD members do."""
    out = {}
    for kind in ("member", "explicit"):
        dist._DEFAULT_FIRST_BUCKET_BYTES = dc.BUCKET_BYTES
        ddp = DDP(dc.make_model(), bucket_cap_mb=dc.BUCKET_BYTES / 2 ** 20)
        if kind == "member":
            ddpx.hooks.DDPCommHookType.QUANTIZED_4BIT.value(model=ddp, state=None, start_iter=1)
        else:
            state = ddpx.hooks.QuantizedState(bits=4, start_iter=1)
            ddpx.register_comm_hook(ddp, state, ddpx.hooks.quantized_hook)
        out[kind] = _train(rank, ddp, range(3))
    dist._DEFAULT_FIRST_BUCKET_BYTES = dc.BUCKET_BYTES
    ddp = DDP(dc.make_model(), bucket_cap_mb=dc.BUCKET_BYTES / 2 ** 20)
    ddpx.hooks.register_ddp_comm_hook(ddpx.hooks.DDPCommHookType.QUANTIZED_1BIT, ddp)
    out["default"] = _train(rank, ddp, range(2))
    return out


def test_comm_hook_type_members():
    for r in run_ranks(rank_by_name, 2):
        for a, b in zip(r["member"], r["explicit"]):
            assert torch.equal(a, b)
        assert all(torch.isfinite(g).all() for g in r["default"])


# ---- edge cases ----------------------------------------------------------------------------------

class _Branchy(torch.nn.Module):
    """A layer `b` that the forward pass uses on even steps only, on every rank: DDP with
    find_unused_parameters hands the hook zeros for it on odd steps and discards the result."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, use_b: bool):
        h = torch.tanh(self.a(x))
        if use_b:
            h = h + torch.tanh(self.b(x))
        return self.head(h)


def rank_edges(rank: int, world_size: int, path: str):
    out = {}
    # A state pickled on rank 0 and unpickled on rank 1 is refused, as load_state_dict refuses
    # another rank's residuals (they were silently handed over).
    ddp = DDP(dc.make_model(), bucket_cap_mb=dc.BUCKET_BYTES / 2 ** 20)
    state = ddpx.hooks.QuantizedState(bits=4, block_size=32, start_iter=1)
    ddpx.register_comm_hook(ddp, state, ddpx.hooks.quantized_hook)
    _train(rank, ddp, range(3))
    out["stats"] = state.compression_stats()
    out["numel"] = sum(p.numel() for p in ddp.parameters())
    with open(f"{path}.{rank}", "wb") as f:
        pickle.dump(state, f)
    dist.barrier()
    with open(f"{path}.{(rank + 1) % world_size}", "rb") as f:
        blob = f.read()
    out["other_rank"] = catch(lambda: pickle.loads(blob))
    with open(f"{path}.{rank}", "rb") as f:
        out["own_rank_iter"] = pickle.load(f).iter
    # find_unused_parameters: layer b's residuals stay while no rank uses it, and go out with
    # its next gradient.
    for exchange in ("allgather", "reduce_scatter"):
        model = _Branchy()
        ddp = DDP(model, find_unused_parameters=True)
        state = ddpx.hooks.QuantizedState(bits=4, block_size=32, start_iter=0, exchange=exchange)
        ddpx.register_comm_hook(ddp, state, ddpx.hooks.quantized_hook)
        snapshots = []
        for step in range(4):
            ddp.zero_grad()
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * rank + step))
            ddp(x, use_b=step % 2 == 0).pow(2).mean().backward()
            snapshots.append({k: (v.clone(), state.server_residuals().get(k))
                              for k, v in state.worker_residuals().items()})
        out[exchange] = snapshots
    return out


def _changed(a, b):
    """The parameter keys whose residuals (rank or owner level) differ between two snapshots."""
    return [k for k in a if not torch.equal(a[k][0], b[k][0]) or (
        a[k][1] is not None and not torch.equal(a[k][1], b[k][1]))]


def test_edge_cases(tmp_path):
    res = run_ranks(rank_edges, 3, args=(str(tmp_path / "state"),))
    for rank, r in enumerate(res):
        err = r["other_rank"]
        assert err is not None and err[0] == "ValueError" and "allow_reshard" in err[1], err
        assert r["own_rank_iter"] == 3
        # Two quantized steps of the whole model at 4 bits, fp32 before: under 8x (a scale per
        # 32 values, every parameter's short last block and a message's padding cost bytes).
        rate, before, after = r["stats"]
        assert before == 2 * r["numel"] * 4
        assert 5.0 < rate < 8.0 and rate == pytest.approx(before / after), r["stats"]
        for exchange in ("allgather", "reduce_scatter"):
            snaps = r[exchange]
            # Step 1 (b unused): b's weight and bias keep their residuals, the rest move on.
            kept = [k for k in snaps[0] if k not in _changed(snaps[0], snaps[1])]
            assert len(kept) == 2, (exchange, rank, kept)
            # (A block this rank owns by reduce-scatter keeps its residual at the owner level.)
            assert all(snaps[0][k][0].abs().max() > 0 or (
                snaps[0][k][1] is not None and snaps[0][k][1].abs().max() > 0) for k in kept)
            # Step 2 (b used again): its residuals go out and are replaced.
            assert all(k in _changed(snaps[1], snaps[2]) for k in kept), (exchange, rank)
