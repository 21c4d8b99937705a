"""Fidelity audit: ddpx's public surface against torch's, read from the installed torch.

For every torch class and function ddpx replaces, torch's public surface is enumerated at test
time (module members, class members, instance attributes from ``vars()`` / ``__slots__``,
``inspect.signature`` of constructors, hooks and methods, log records, warnings, errors of the
constructors, ``state_dict()`` keys) and ddpx's must provide the same: a name torch has that ddpx
lacks fails. Where ddpx deliberately differs or extends, the difference is in one of the
allow-lists below, each entry with its reason; a ddpx extra that is not listed fails too, so
extensions stay deliberate.

Nothing here names a torch version: the tests compare with whatever torch is installed (pip's
2.11 and Debian's 1.13 at present). Instance-level checks run on 2 Gloo ranks (the states and
averagers need a process group); signatures are read in the test process.
"""
import functools
import importlib
import inspect
import logging
import pickle
import warnings
from collections import OrderedDict
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist

import ddpx
import ddpx.hooks.default_hooks
import ddpx.hooks.post_localSGD_hook
import ddpx.hooks.powerSGD_hook
import ddpx.model_averaging
import ddpx.optim
from dist_utils import catch, run_ranks

_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks"
_AVG = "torch.distributed.algorithms.model_averaging"

# torch's module -> the ddpx module holding its replacements.
MODULES = [
    (f"{_HOOKS}.default_hooks", "ddpx.hooks.default_hooks"),
    (f"{_HOOKS}.debugging_hooks", "ddpx.hooks.default_hooks"),
    (f"{_HOOKS}.powerSGD_hook", "ddpx.hooks.powerSGD_hook"),
    (f"{_HOOKS}.post_localSGD_hook", "ddpx.hooks.post_localSGD_hook"),
    (f"{_AVG}.averagers", "ddpx.model_averaging"),
    (f"{_AVG}.hierarchical_model_averager", "ddpx.model_averaging"),
    (f"{_AVG}.utils", "ddpx.model_averaging"),
    ("torch.distributed.optim.post_localSGD_optimizer", "ddpx.optim"),
    ("torch.distributed.optim.zero_redundancy_optimizer", "ddpx.optim"),
    ("torch.distributed.optim.optimizer", "ddpx.optim"),
    (f"{_HOOKS}.ddp_zero_hook", "ddpx.hooks.ddp_zero_hook"),
    (_HOOKS, "ddpx.hooks"),  # DDPCommHookType, register_ddp_comm_hook
]

# ---- allow-lists: every deliberate difference, with its reason -------------------------------

# Extra parameters ddpx's callables take, after all of torch's and with defaults (so every call
# written for torch works unchanged).
EXTRA_PARAMS: Dict[str, Dict[str, str]] = {
    "average_parameters": {
        "bucket_cap_mb": "ddpx averages in place in bounded staging buckets; their size"},
    "average_parameters_or_parameter_groups": {
        "bucket_cap_mb": "as average_parameters"},
    "PeriodicModelAverager": {"bucket_cap_mb": "as average_parameters"},
    "HierarchicalModelAverager": {"bucket_cap_mb": "as average_parameters"},
    "PowerSGDState.load_state_dict": {
        "strict": "ddpx-only checkpoint API: strict=False drops error memories of other sizes",
        "allow_reshard": "ddpx-only checkpoint API: error memories saved by another rank are "
                         "refused unless a reshard is deliberate"},
    "ZeroRedundancyOptimizer": {
        "partition": "keyword only, default torch's partition: 'balanced' splits large tensors "
                     "so every rank holds an even share (torch has no such option)"},
    "PostLocalSGDOptimizer.step": {
        "closure": "torch.optim.Optimizer's step(closure) protocol, passed to the local optimizer"},
}

# Public names ddpx's classes have beyond torch's.
EXTRA_MEMBERS: Dict[str, Dict[str, str]] = {
    "PowerSGDState": {
        "state_dict": "checkpoints keyed per parameter (torch's state can only be pickled)",
        "load_state_dict": "as state_dict",
        "clear_memories": "the way out after a step with NaN/Inf gradients (torch: none)",
        "random_seed": "the constructor's argument stays readable (torch keeps only rng); it is "
                       "recorded in state_dict() and reprs, and does not reseed rng",
    },
    "PostLocalSGDState": {
        "state_dict": "checkpoints keep iter, so a resumed job does not redo the warm-up",
        "load_state_dict": "as state_dict",
    },
    "ModelAverager": {
        "last_stats": "counters of what the last native average_parameters call did",
        "warmup_steps": "on the base class so the warm-up check against post_localSGD_hook "
                        "works for both averagers (torch sets it in each subclass)",
    },
    "PeriodicModelAverager": {"last_stats": "as ModelAverager"},
    "HierarchicalModelAverager": {"last_stats": "as ModelAverager"},
    "DDPCommHookType": {
        f"QUANTIZED_{b}BIT": "ddpx's quantized_hook with QuantizedState(bits=" + str(b) + "): a "
                             "hook torch does not have, by name as torch's members"
        for b in (8, 4, 2, 1)
    },
    "PostLocalSGDOptimizer": {
        "defaults": "the wrapped optimizer's, read through (torch's wrapper has none, so tools "
                    "reading optimizer.defaults fail on it)",
    },
    "ZeroRedundancyOptimizer": {
        "bucket_cap_bytes": "the exchange packs small parameters into broadcasts of at most this "
                            "many bytes (torch: one broadcast per tensor); a class attribute, so "
                            "the constructor keeps torch's signature",
    },
}

# torch attributes that ddpx exposes read-only (torch's are plain attributes).
READONLY: Dict[str, Dict[str, str]] = {
    "PowerSGDState": {
        "error_dict": "views of the native memories, keyed per parameter; clear_memories() is "
                      "the supported way to reset them",
        "p_memory_dict": "as error_dict",
        "q_memory_dict": "as error_dict",
        "total_numel_before_compression": "counters kept by the native hook",
        "total_numel_after_compression": "counters kept by the native hook",
        "next_stats_report": "kept by the native hook",
    },
}

# Values of torch's attributes ddpx reports differently, per (class, attribute).
VALUE_DIFFERENCES: Dict[Tuple[str, str], str] = {}

# Error texts of older torches that ddpx words as the newest torch does: (old text, new text,
# reason), applied to torch's message before comparing.
TORCH_MESSAGE_FIXES: List[Tuple[str, str, str]] = [
    ("The last value in arg ``period_process_group_dict``",
     "The last value in arg ``period_group_size_dict``",
     "HierarchicalModelAverager: torch < 2.15 names an argument that does not exist; 2.15 "
     "names period_group_size_dict, and so does ddpx on every torch"),
]


def _torch_error(error: Any) -> Any:
    """torch's (type, message) with TORCH_MESSAGE_FIXES applied."""
    if not error:
        return error
    kind, message = error[0], error[1]
    for old, new, _ in TORCH_MESSAGE_FIXES:
        message = message.replace(old, new)
    return type(error)([kind, message, *error[2:]])


# Function names ddpx gives its hooks: DDP records a Python hook's __qualname__ in its logging
# data, and torch 1.13's DDP refuses any hook *named* bf16_compress_hook unless torch has CUDA
# and NCCL >= 2.10 (ddpx's bf16 hooks run on Gloo and CPU), hence the ddpx_ prefix.
HOOK_NAME_PREFIX = {"bf16_compress_hook": "ddpx_", "bf16_compress_wrapper_hook": "ddpx_"}

# Members of torch's classes whose names start with "_" but that code outside torch reads
# (torch's own tests, user schedulers).
PRIVATE_BUT_READ = {"HierarchicalModelAverager": ["_find_process_group", "_periods"]}


# ---- enumerating torch's surface ---------------------------------------------------------------

def _public_members(module) -> Dict[str, Any]:
    """Public functions and classes defined in a torch module."""
    return {n: v for n, v in vars(module).items()
            if not n.startswith("_") and callable(v)
            and getattr(v, "__module__", None) == module.__name__}


def torch_pairs() -> List[Tuple[str, Any, Any]]:
    """(name, torch object, ddpx object or None) for every public member of torch's modules."""
    out = []
    for tname, dname in MODULES:
        tmod, dmod = importlib.import_module(tname), importlib.import_module(dname)
        for name, obj in _public_members(tmod).items():
            out.append((name, obj, getattr(dmod, name, None)))
    return out


PAIRS = torch_pairs()
CLASSES = [(n, t, d) for n, t, d in PAIRS if inspect.isclass(t)]
FUNCTIONS = [(n, t, d) for n, t, d in PAIRS if not inspect.isclass(t)]


def _params(fn) -> List[Tuple[str, str, Any]]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        default = "<required>" if p.default is inspect.Parameter.empty else p.default
        # No caller can name *args / **kwargs (torch itself renamed ZeRO's join_hook(**kwargs)
        # to **_kwargs in 2.x): only their kind counts.
        var = p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        out.append(("*" if var else p.name, p.kind.name, default))
    return out


def check_signature(key: str, torch_fn, ddpx_fn) -> None:
    """torch's parameters, in order, with their kinds and defaults; then only allow-listed
    extras with defaults."""
    theirs, ours = _params(torch_fn), _params(ddpx_fn)
    # A **kwargs stays last: ddpx's keyword-only extras go before it, and are compared as if
    # after torch's parameters.
    var_kw = [p for p in theirs if p[1] == "VAR_KEYWORD"]
    assert var_kw == [p for p in ours if p[1] == "VAR_KEYWORD"], \
        f"{key}: ddpx {ours} vs torch {theirs}"
    theirs = [p for p in theirs if p[1] != "VAR_KEYWORD"]
    ours = [p for p in ours if p[1] != "VAR_KEYWORD"]
    assert ours[:len(theirs)] == theirs, f"{key}: ddpx {ours} vs torch {theirs}"
    extra = ours[len(theirs):]
    allowed = EXTRA_PARAMS.get(key, {})
    for name, _kind, default in extra:
        assert name in allowed, f"{key}: ddpx parameter {name!r} is not in torch's signature"
        assert default != "<required>", f"{key}: extra parameter {name!r} needs a default"


def _methods(cls) -> Dict[str, Any]:
    """Public methods (and private ones code reads) a torch class defines itself or inherits from
    torch classes other than object and torch.optim.Optimizer."""
    out = {}
    for klass in reversed(cls.__mro__):
        if klass in (object, torch.optim.Optimizer) or klass.__module__ == "abc":
            continue
        for name, value in vars(klass).items():
            public = not name.startswith("_") or name in PRIVATE_BUT_READ.get(cls.__name__, [])
            if public and inspect.isfunction(value):
                out[name] = value
    return out


# ---- module and signature checks (in the test process) ---------------------------------------

@pytest.mark.parametrize("name,theirs,ours", PAIRS, ids=[p[0] for p in PAIRS])
def test_every_torch_member_has_a_ddpx_counterpart(name, theirs, ours):
    assert ours is not None, f"ddpx lacks torch's {theirs.__module__}.{name}"
    assert inspect.isclass(ours) == inspect.isclass(theirs)


@pytest.mark.parametrize("name,theirs,ours", FUNCTIONS, ids=[p[0] for p in FUNCTIONS])
def test_function_signatures(name, theirs, ours):
    check_signature(name, theirs, ours)
    if name.endswith("_hook"):
        assert ours.__name__ == HOOK_NAME_PREFIX.get(name, "") + theirs.__name__


@pytest.mark.parametrize("wrapper", ["fp16_compress_wrapper", "bf16_compress_wrapper"])
def test_wrapped_hook_signature_and_name(wrapper):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as td
    theirs = getattr(td, wrapper)(td.allreduce_hook)
    ours = getattr(ddpx.hooks, wrapper)(ddpx.hooks.allreduce_hook)
    check_signature(wrapper + "(hook)", theirs, ours)
    assert ours.__name__ == HOOK_NAME_PREFIX.get(theirs.__name__, "") + theirs.__name__


@pytest.mark.parametrize("name,theirs,ours", CLASSES, ids=[p[0] for p in CLASSES])
def test_class_constructor_and_method_signatures(name, theirs, ours):
    check_signature(name, theirs, ours)
    for method, fn in _methods(theirs).items():
        mine = getattr(ours, method, None)
        assert mine is not None, f"ddpx's {name} lacks torch's method {method}"
        check_signature(f"{name}.{method}", fn, mine)


@pytest.mark.parametrize("name,theirs,ours", CLASSES, ids=[p[0] for p in CLASSES])
def test_class_members_and_declared_extras(name, theirs, ours):
    """Every public name of torch's class is on ddpx's, and ddpx's own extras are allow-listed
    (names inherited from torch.optim.Optimizer by both wrappers are torch's)."""
    def public(cls):
        names = {n for n in dir(cls) if not n.startswith("_")}
        return names | set(PRIVATE_BUT_READ.get(name, []))
    # Attributes torch sets in __init__ are not on its class: they are checked on instances
    # (test_instance_attributes_like_torch), and are no ddpx extras.
    # (DistributedOptimizer needs RPC workers, which the audit does not start: test_dist_optim.py
    # compares its instances' attributes with torch's.)
    audited = audit()["classes"]
    instance = set(audited[name]["torch"]["attrs"]) if name in audited else set()
    theirs_names = (public(theirs) | set(declared_slots(theirs) or ())) - instance
    missing = sorted(n for n in theirs_names if not hasattr(ours, n))
    assert not missing, f"ddpx's {name} lacks torch's {missing}"
    extras = sorted(n for n in public(ours) - theirs_names - instance
                    if n not in EXTRA_MEMBERS.get(name, {}))
    assert not extras, f"ddpx's {name} has undeclared extras {extras}"


@pytest.mark.parametrize("name,theirs,ours", CLASSES, ids=[p[0] for p in CLASSES])
def test_slots_like_torch(name, theirs, ours):
    """A torch class with __slots__ (the states): ddpx's lists the same names, so code reading
    __slots__ (torch's own __getstate__ pattern) sees them."""
    slots = declared_slots(theirs)
    if slots is None:
        return
    assert list(getattr(ours, "__slots__", ())) == list(slots)


# ---- instance-level audit (2 ranks) ------------------------------------------------------------

class FakeBucket:
    """What maybe_increase_iter reads of a bucket."""

    def __init__(self, last: bool):
        self._last = last

    def is_last(self) -> bool:
        return self._last


def describe(value: Any) -> Any:
    """A picklable, comparable description of an attribute value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return (type(value).__name__, value)
    if isinstance(value, dist.ProcessGroup):
        return ("ProcessGroup",
                "WORLD" if value is dist.group.WORLD else dist.get_world_size(value))
    if isinstance(value, dict):
        return (type(value).__name__, [(describe(k), describe(v)) for k, v in value.items()])
    if type(value).__name__ == "RandomState":
        kind, key, pos = value.get_state()[:3]
        return ("RandomState", kind, [int(k) for k in key[:4]], int(pos))
    if callable(value):
        return ("callable",)
    return (type(value).__name__,)


class Capture:
    """Log records (torch.* and ddpx.* loggers) and warnings while active."""

    def __enter__(self):
        self.records: List[Tuple[str, str]] = []
        capture = self

        class Keep(logging.Handler):
            def emit(self, record):
                capture.records.append((record.levelname, record.getMessage()))

        self._handler = Keep(level=logging.DEBUG)
        self._loggers = []
        for name in ("torch.distributed.algorithms", "torch.distributed.optim", "ddpx"):
            lg = logging.getLogger(name)
            self._loggers.append((lg, lg.level))
            lg.setLevel(logging.DEBUG)
            lg.addHandler(self._handler)
        self._warn = warnings.catch_warnings(record=True)
        self.warned = self._warn.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._warn.__exit__(*exc)
        for lg, level in self._loggers:
            lg.removeHandler(self._handler)
            lg.setLevel(level)

    def warnings(self) -> List[Tuple[str, str]]:
        return [(w.category.__name__, str(w.message)) for w in self.warned]


def declared_slots(cls: type):
    """The __slots__ a class declares itself (abc.ABC's empty one, inherited by torch's
    averagers, does not count: their instances have a __dict__)."""
    return vars(cls).get("__slots__")


def _instance(obj: Any, torch_cls: type) -> Dict[str, Any]:
    """__slots__ behaviour of an instance: vars() and a misspelled attribute."""
    return {"vars_raises": catch(lambda: vars(obj)) is not None,
            "typo": catch(lambda: setattr(obj, "matrix_aproximation_rank", 4))}


def _attrs(torch_obj: Any, ddpx_obj: Any, torch_cls: type) -> Tuple[Dict, Dict]:
    """Per attribute torch's instance has: its described value and what assigning it back does,
    on each side."""
    slots = declared_slots(torch_cls)
    names = list(slots) if slots is not None else list(vars(torch_obj))
    read = PRIVATE_BUT_READ.get(torch_cls.__name__, [])
    names = [n for n in names if not n.startswith("_") or n in read]
    out = ({}, {})
    for side, obj in enumerate((torch_obj, ddpx_obj)):
        for n in names:
            try:
                value = getattr(obj, n)
            except Exception as exc:  # noqa: BLE001 - recorded
                out[side][n] = {"value": ("missing", type(exc).__name__, str(exc)), "set": None}
                continue
            out[side][n] = {"value": describe(value),
                            "set": catch(lambda: setattr(obj, n, value))}
    return out


def _states(rank: int) -> Dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as tpl
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp

    out: Dict[str, Any] = {}
    kw = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, min_compression_rate=2.0,
              orthogonalization_epsilon=1e-8, compression_stats_logging_frequency=0,
              random_seed=7)
    pairs = {
        "PowerSGDState": (tp.PowerSGDState, ddpx.hooks.PowerSGDState, (None,), kw),
        "PostLocalSGDState": (tpl.PostLocalSGDState, ddpx.hooks.PostLocalSGDState,
                              (None, None, 2), {}),
    }
    for name, (tcls, dcls, args, kwargs) in pairs.items():
        res = {}
        objs = []
        for side, cls in (("torch", tcls), ("ddpx", dcls)):
            with Capture() as cap:
                obj = cls(*args, **kwargs)
                for last in (False, True, False, True, False, True):
                    obj.maybe_increase_iter(FakeBucket(last))
            res[side] = {"records": cap.records, "warnings": cap.warnings(),
                         **_instance(obj, tcls)}
            objs.append(cls(*args, **kwargs))
        res["torch"]["attrs"], res["ddpx"]["attrs"] = _attrs(objs[0], objs[1], tcls)
        out[name] = res
    return out


def _averagers(rank: int, world_size: int) -> Dict[str, Any]:
    from torch.distributed.algorithms.model_averaging import averagers as ta
    from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as th
    ma = ddpx.model_averaging
    out: Dict[str, Any] = {}
    levels = OrderedDict([(2, world_size), (4, world_size)])
    pairs = {
        "PeriodicModelAverager": (ta.PeriodicModelAverager, ma.PeriodicModelAverager,
                                  (), dict(period=4, warmup_steps=3)),
        "HierarchicalModelAverager": (th.HierarchicalModelAverager, ma.HierarchicalModelAverager,
                                      (), dict(period_group_size_dict=levels, warmup_steps=3)),
    }
    # The bases are abstract: a custom averager, as users write them, on each.
    class TorchConcrete(ta.ModelAverager):
        def average_parameters(self, params):
            self.step += 1

    class DdpxConcrete(ma.ModelAverager):
        def average_parameters(self, params):
            self.step += 1

    pairs["ModelAverager"] = (TorchConcrete, DdpxConcrete, (), {})
    for name, (tcls, dcls, args, kwargs) in pairs.items():
        res = {}
        objs = []
        for side, cls in (("torch", tcls), ("ddpx", dcls)):
            with Capture() as cap:
                objs.append(cls(*args, **kwargs))
            res[side] = {"records": cap.records, "warnings": cap.warnings(),
                         **_instance(objs[-1], tcls)}
        res["torch"]["attrs"], res["ddpx"]["attrs"] = _attrs(objs[0], objs[1], tcls)
        out[name] = res
    return out


def _optimizers(rank: int) -> Dict[str, Any]:
    from torch.distributed.algorithms.model_averaging import averagers as ta
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchOpt
    res = {}
    objs = []
    for side, cls, avg in (("torch", TorchOpt, ta.PeriodicModelAverager),
                           ("ddpx", ddpx.optim.PostLocalSGDOptimizer,
                            ddpx.model_averaging.PeriodicModelAverager)):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = cls(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), avg(period=2))
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        sd = opt.state_dict()
        with Capture() as cap:
            opt.load_state_dict({k: v for k, v in sd.items() if k != "step"})
        res[side] = {"state_dict": sorted((k, type(v).__name__) for k, v in sd.items()),
                     "load_warnings": cap.warnings(), "load_records": cap.records,
                     "repr": repr(opt), **_instance(opt, TorchOpt)}
        objs.append(opt)
    res["torch"]["attrs"], res["ddpx"]["attrs"] = _attrs(objs[0], objs[1], TorchOpt)
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    zres, zobjs = {}, []
    for side, cls in (("torch", TorchZero), ("ddpx", ddpx.optim.ZeroRedundancyOptimizer)):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = cls(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        zres[side] = {"repr": repr(opt), **_instance(opt, TorchZero)}
        zobjs.append(opt)
    zres["torch"]["attrs"], zres["ddpx"]["attrs"] = _attrs(zobjs[0], zobjs[1], TorchZero)
    return {"PostLocalSGDOptimizer": res, "ZeroRedundancyOptimizer": zres}


def _constructor_cases(world_size: int):
    """(case, torch call, ddpx call): bad arguments and arguments torch warns about."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tp
    from torch.distributed.algorithms.model_averaging import averagers as ta
    from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as th
    ma = ddpx.model_averaging
    P, TP = ddpx.hooks.PowerSGDState, tp.PowerSGDState
    cases = []
    for ef, ws in ((True, True), (True, False), (False, True)):
        for start in (1, 0, -1):
            kw = dict(start_powerSGD_iter=start, use_error_feedback=ef, warm_start=ws)
            cases.append((f"powersgd_start{start}_ef{ef}_ws{ws}",
                          lambda kw=kw: TP(None, **kw), lambda kw=kw: P(None, **kw)))
    for kw in (dict(period=1), dict(period=0), dict(period=2, warmup_steps=-1)):
        cases.append((f"periodic_{kw}", lambda kw=kw: ta.PeriodicModelAverager(**kw),
                      lambda kw=kw: ma.PeriodicModelAverager(**kw)))
    for levels, warmup in (([(1, world_size)], 0), ([], 0), ([(0, 1), (2, world_size)], 0),
                           ([(2, world_size + 1)], 0), ([(2, world_size)], -1)):
        kw = dict(period_group_size_dict=OrderedDict(levels), warmup_steps=warmup)
        cases.append((f"hierarchical_{levels}_{warmup}",
                      lambda kw=kw: th.HierarchicalModelAverager(**kw),
                      lambda kw=kw: ma.HierarchicalModelAverager(**kw)))
    return cases


def rank_audit(rank: int, world_size: int) -> Dict[str, Any]:
    out: Dict[str, Any] = {"classes": {}}
    out["classes"].update(_states(rank))
    out["classes"].update(_averagers(rank, world_size))
    out["classes"].update(_optimizers(rank))
    out["constructors"] = {}
    for case, theirs, ours in _constructor_cases(world_size):
        got = {}
        for side, make in (("torch", theirs), ("ddpx", ours)):
            with Capture() as cap:
                error = catch(make)
            got[side] = {"error": error, "warnings": cap.warnings()}
        out["constructors"][case] = got
    return out


@functools.lru_cache(maxsize=None)
def audit() -> Dict[str, Any]:
    res = run_ranks(rank_audit, 2)
    return res[0]


INSTANCE_CLASSES = ["PowerSGDState", "PostLocalSGDState", "ModelAverager", "PeriodicModelAverager",
                    "HierarchicalModelAverager", "PostLocalSGDOptimizer",
                    "ZeroRedundancyOptimizer"]


@pytest.mark.parametrize("name", INSTANCE_CLASSES)
def test_instance_attributes_like_torch(name):
    """Every attribute of torch's instance exists on ddpx's with the same value (type and
    content), and can be assigned unless allow-listed read-only."""
    got = audit()["classes"][name]
    theirs, ours = got["torch"]["attrs"], got["ddpx"]["attrs"]
    for attr, t in theirs.items():
        o = ours[attr]
        assert o["value"][0] != "missing", f"{name}.{attr}: {o['value']}"
        if (name, attr) not in VALUE_DIFFERENCES:
            assert o["value"] == t["value"], f"{name}.{attr}: ddpx {o['value']} torch {t['value']}"
        if attr in READONLY.get(name, {}):
            continue
        assert o["set"] == t["set"], f"{name}.{attr} assignment: ddpx {o['set']} torch {t['set']}"


@pytest.mark.parametrize("name", INSTANCE_CLASSES)
def test_slots_behaviour_like_torch(name):
    """A class with __slots__ in torch: vars() fails and a misspelled attribute raises
    AttributeError (a typo is not silently accepted); ddpx's must do the same."""
    got = audit()["classes"][name]
    assert got["ddpx"]["vars_raises"] == got["torch"]["vars_raises"]
    theirs, ours = got["torch"]["typo"], got["ddpx"]["typo"]
    assert (ours is None) == (theirs is None), f"typo assignment: ddpx {ours} torch {theirs}"
    if theirs is not None:
        assert ours[0] == theirs[0]


@pytest.mark.parametrize("name", ["PowerSGDState", "PostLocalSGDState", "PeriodicModelAverager",
                                  "HierarchicalModelAverager"])
def test_log_records_and_warnings_like_torch(name):
    """Construction (and, for the states, iterations past the start) logs what torch logs, at
    the same levels, and warns as torch does."""
    got = audit()["classes"][name]
    assert got["ddpx"]["records"] == got["torch"]["records"]
    assert got["ddpx"]["warnings"] == got["torch"]["warnings"]


def test_optimizer_state_dict_and_load_warning_like_torch():
    got = audit()["classes"]["PostLocalSGDOptimizer"]
    for key in ("state_dict", "load_warnings", "load_records", "repr"):
        assert got["ddpx"][key] == got["torch"][key], key


def test_constructor_errors_and_warnings_like_torch():
    """Bad arguments raise torch's exception with torch's message; arguments torch warns about
    give torch's warning."""
    for case, got in audit()["constructors"].items():
        assert got["ddpx"]["error"] == _torch_error(got["torch"]["error"]), case
        assert got["ddpx"]["warnings"] == got["torch"]["warnings"], case


# ---- PowerSGDState.rng: the generator the hooks draw Q seeds from ---------------------------

def rank_rng(rank: int, world_size: int) -> Dict[str, Any]:
    """PowerSGD without warm start (a fresh Q seed per bucket per compressed step), torch against
    ddpx (native and drop-in), with state.rng reseeded or replaced after construction: the
    gradients and the generator's state after training must be torch's."""
    import numpy as np

    import powersgd_cases as pc
    out: Dict[str, Any] = {}
    opts = dict(start_powerSGD_iter=2, warm_start=False, min_compression_rate=0.5)
    for how in ("seed", "replace"):
        for impl, mode in (("torch", None), ("ddpx", "native"), ("ddpx", "dropin")):
            cfg = {"impl": impl, "hook": "powerSGD", "mode": mode, "opts": opts}
            ddp = pc.wrap_ddp(pc.make_model())
            state = pc.make_state(cfg)
            if how == "seed":
                state.rng.seed(1234)
            else:
                state.rng = np.random.RandomState(99)
            pc.register(ddp, cfg, state)
            grads = []
            for step in range(4):
                ddp.zero_grad()
                pc.loss_fn(ddp, *pc.make_batch(rank, step)).backward()
                grads.append(pc.flat_grad(ddp))
            key = f"{how}_{impl}_{mode}"
            out[key] = {"grads": torch.stack(grads), "rng": describe(state.rng)}
            if impl == "ddpx":
                # Pickling and state_dict carry the generator; the restored one continues it.
                before = state.rng.get_state()
                restored = pickle.loads(pickle.dumps(state))
                fresh = ddpx.hooks.PowerSGDState(None, **opts)
                fresh.load_state_dict(state.state_dict())
                ref = np.random.RandomState()
                ref.set_state(before)
                expect = ref.randint(1_000_000_000)
                out[key]["restored"] = [
                    (type(s.rng).__name__, bool(np.array_equal(s.rng.get_state()[1], before[1])),
                     s.rng.get_state()[2] == before[2], s.rng.randint(1_000_000_000) == expect)
                    for s in (restored, fresh)]
    return out


@functools.lru_cache(maxsize=None)
def rng_run() -> Dict[str, Any]:
    res = run_ranks(rank_rng, 2)
    return res[0]


@pytest.mark.parametrize("how", ["seed", "replace"])
def test_rng_is_the_generator_the_hook_draws_from(how):
    """Same generator state after training as torch's (as many draws, from the reseeded or
    replaced generator), and torch's gradients (to rounding: ddpx's products are not torch's
    bit for bit), while the other generator gives other compressed gradients."""
    res = rng_run()
    theirs = res[f"{how}_torch_None"]
    other = res[f"{'replace' if how == 'seed' else 'seed'}_torch_None"]
    for mode in ("native", "dropin"):
        ours = res[f"{how}_ddpx_{mode}"]
        assert ours["rng"] == theirs["rng"], mode
        torch.testing.assert_close(ours["grads"], theirs["grads"], rtol=1e-4, atol=1e-6)
        assert not torch.allclose(ours["grads"][2:], other["grads"][2:], rtol=1e-3, atol=1e-4)


def test_rng_survives_pickle_and_state_dict():
    for how in ("seed", "replace"):
        for mode in ("native", "dropin"):
            for restored in rng_run()[f"{how}_ddpx_{mode}"]["restored"]:
                assert restored == ("RandomState", True, True, True)
