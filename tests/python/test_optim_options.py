"""The typed optimizer protocol: the C++ options structs (``ddpx._C.SGDOptions``, ``AdamOptions``,
``AdagradOptions``, ``RMSpropOptions``), the one table of torch optimizers with a C++ form
(``ddpx.optim._options``) and the mapping of a torch ``param_group`` to a struct, which
ZeroRedundancyOptimizer's fused step and the RPC DistributedOptimizer share.

Differential against torch: a struct built from a torch optimizer's param_group holds that
group's values; the constructor-argument path (RPC) and the param_group path (ZeRO) agree; a
struct refuses what torch's constructor refuses, with torch's message.
"""
import inspect
import pickle

import pytest
import torch

import ddpx
from ddpx.optim import _options
from ddpx.optim.optimizer import _native_options

C = ddpx._C

_ADAM_HAS_DECOUPLING = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters

# (class, constructor arguments, the struct's fields they must give)
CASES = [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01,
                           maximize=True),
     dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False,
          maximize=True)),
    (torch.optim.SGD, dict(lr=0.01, momentum=0.5, nesterov=True),
     dict(lr=0.01, momentum=0.5, nesterov=True)),
    (torch.optim.Adam, dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, amsgrad=True),
     dict(lr=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, amsgrad=True,
          decoupled_weight_decay=False)),
    (torch.optim.AdamW, dict(lr=1e-3, maximize=True),
     dict(lr=1e-3, weight_decay=1e-2, maximize=True, decoupled_weight_decay=True)),
    (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, weight_decay=0.1,
                               initial_accumulator_value=0.1, eps=1e-8),
     dict(lr=0.05, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1, eps=1e-8)),
    (torch.optim.RMSprop, dict(lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.1, momentum=0.9,
                               centered=True),
     dict(lr=0.01, alpha=0.9, eps=1e-6, weight_decay=0.1, momentum=0.9, centered=True)),
]
if _ADAM_HAS_DECOUPLING:
    CASES.append((torch.optim.Adam, dict(lr=1e-2, weight_decay=0.3, decoupled_weight_decay=True),
                  dict(lr=1e-2, weight_decay=0.3, decoupled_weight_decay=True)))

STRUCTS = {torch.optim.SGD: C.SGDOptions, torch.optim.Adam: C.AdamOptions,
           torch.optim.AdamW: C.AdamOptions, torch.optim.Adagrad: C.AdagradOptions,
           torch.optim.RMSprop: C.RMSpropOptions}


def _param():
    return torch.zeros(2, requires_grad=True)


def _case_id(case):
    cls, kwargs, _ = case
    return f"{cls.__name__}-" + "-".join(f"{k}={v}" for k, v in kwargs.items())


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_param_group_and_constructor_arguments_give_the_same_struct(case):
    cls, kwargs, expected = case
    group = cls([_param()], **kwargs).param_groups[0]
    from_group, reason = _options.cpp_options(cls, group)
    assert reason == "" and type(from_group) is STRUCTS[cls]
    fields = from_group._asdict()
    for name, value in expected.items():
        assert fields[name] == value, (name, fields[name], value)
    # Every field the group has under torch's name carries the group's value.
    for name, value in fields.items():
        if name in group:
            assert value == group[name], name
    from_arguments, reason = _native_options(cls, (), kwargs)
    assert reason == "" and from_arguments == from_group
    # The kind C++ reads from the struct: AdamOptions with decoupling is AdamW.
    decoupled = fields.get("decoupled_weight_decay", False)
    assert decoupled == (cls is torch.optim.AdamW or kwargs.get("decoupled_weight_decay", False))


def test_the_table():
    names = _options.cpp_optimizer_names()
    assert names == ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "RAdam",
                     "Rprop")
    for name in names:
        assert _options.has_cpp_form(getattr(torch.optim, name))
        assert _options.is_elementwise(getattr(torch.optim, name))

    class MySGD(torch.optim.SGD):  # a subclass may change the step: no C++ form
        pass

    assert not _options.has_cpp_form(MySGD) and not _options.is_elementwise(MySGD)
    assert not _options.has_cpp_form(torch.optim.ASGD) and _options.is_elementwise(
        torch.optim.ASGD)
    assert not _options.is_elementwise(torch.optim.LBFGS)
    options, reason = _options.cpp_options(torch.optim.ASGD, {"lr": 0.1})
    assert options is None and "ASGD has no C++ form" in reason


def test_what_has_no_cpp_form_is_a_reason_not_an_error(monkeypatch):
    sgd = torch.optim.SGD
    group = dict(sgd([_param()], lr=0.1).param_groups[0])
    assert _options.cpp_options(sgd, {**group, "initial_lr": 0.1, "mine": "x"})[0] is not None
    options, reason = _options.cpp_options(sgd, {**group, "differentiable": True})
    assert options is None and "differentiable=True" in reason
    options, reason = _options.cpp_options(sgd, {**group, "lr": torch.tensor(0.1)})
    assert options is None and "tensor lr" in reason
    # The RPC path reads a one-element tensor once, at construction.
    options, reason = _options.cpp_options(sgd, {**group, "lr": torch.tensor(0.25)}, tensors=True)
    assert reason == "" and options.lr == 0.25
    with pytest.raises(ValueError, match="must be a number"):
        _options.cpp_options(sgd, {**group, "lr": torch.ones(2)}, tensors=True)
    if "fused" in inspect.signature(sgd).parameters:
        options, reason = _options.cpp_options(sgd, {**group, "fused": True})
        assert options is None and "fused=True" in reason
    # A key that is no argument of the class is another key (ignored, as torch's step ignores
    # it), even where another class takes it.
    options, reason = _options.cpp_options(torch.optim.RMSprop, {"lr": 0.1, "betas": (0.9, 0.9)})
    assert reason == "" and options.lr == 0.1
    options, reason = _options.cpp_options(sgd, {"lr": "fast"})
    assert options is None and "not a number" in reason
    # A constructor argument the struct lacks (as a newer torch's new argument would be): no C++
    # form, never silently dropped.
    fields = _options._FIELDS[C.SGDOptions]
    monkeypatch.setitem(_options._FIELDS, C.SGDOptions, fields - {"dampening"})
    options, reason = _options.cpp_options(sgd, group)
    assert options is None and "argument 'dampening' is not supported" in reason


def _number_in(message):
    head, _, tail = message.rpartition(": ")
    return head, float(tail)


BAD = [
    (torch.optim.SGD, dict(lr=-0.1)),
    (torch.optim.SGD, dict(lr=0.1, momentum=-1.0)),
    (torch.optim.SGD, dict(lr=0.1, weight_decay=-1.0)),
    (torch.optim.Adam, dict(lr=-1.0)),
    (torch.optim.Adam, dict(eps=-1e-3)),
    (torch.optim.Adam, dict(betas=(1.0, 0.9))),
    (torch.optim.Adam, dict(betas=(0.9, -0.5))),
    (torch.optim.Adam, dict(weight_decay=-0.5)),
    (torch.optim.Adagrad, dict(lr_decay=-1.0)),
    (torch.optim.Adagrad, dict(initial_accumulator_value=-1.0)),
    (torch.optim.RMSprop, dict(alpha=-0.5)),
    (torch.optim.RMSprop, dict(momentum=-0.5)),
]


@pytest.mark.parametrize("cls,kwargs", BAD, ids=[f"{c.__name__}-{kw}" for c, kw in BAD])
def test_structs_refuse_what_torch_refuses_with_its_message(cls, kwargs):
    with pytest.raises(ValueError) as theirs:
        cls([_param()], **kwargs)
    with pytest.raises(ValueError) as ours:
        STRUCTS[cls](**kwargs)
    # The same text; the number as C++ prints it (-1 for torch's -1.0).
    assert _number_in(str(ours.value)) == _number_in(str(theirs.value))


def test_nesterov_refusal_is_torchs():
    with pytest.raises(ValueError) as theirs:
        torch.optim.SGD([_param()], lr=0.1, nesterov=True)
    with pytest.raises(ValueError) as ours:
        C.SGDOptions(lr=0.1, nesterov=True)
    assert str(ours.value) == str(theirs.value)


def test_structs_are_typed_immutable_and_picklable():
    o = C.AdamOptions(lr=0.1, betas=(0.8, 0.9), amsgrad=True)
    assert o.betas == (0.8, 0.9) and o.beta1 == 0.8 and o.amsgrad is True
    assert o == pickle.loads(pickle.dumps(o))
    assert o != C.AdamOptions()
    assert repr(o).startswith("AdamOptions(lr=0.1, beta1=0.8, beta2=0.9,")
    with pytest.raises(AttributeError):
        o.lr = 1.0
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        C.SGDOptions(lr=0.1, colour=1)
    with pytest.raises(TypeError, match="lr must be a number, got str"):
        C.SGDOptions(lr="fast")
    with pytest.raises(TypeError, match="nesterov must be a bool"):
        C.SGDOptions(nesterov="yes")
    # Defaults are torch's (AdamW's are its own: weight decay 1e-2, decoupled).
    for cls, struct in STRUCTS.items():
        if cls is torch.optim.AdamW:
            continue
        defaults = {k: v for k, v in cls([_param()], lr=0.01).defaults.items()}
        fields = struct(lr=0.01)._asdict()
        for name, value in fields.items():
            if name in defaults:
                assert value == defaults[name], (cls.__name__, name)


def test_functional_optimizers_take_a_struct_or_its_fields():
    p1, p2 = torch.ones(3), torch.ones(3)
    a = C.FunctionalSGD([p1], options=C.SGDOptions(lr=0.5, momentum=0.9))
    b = C.FunctionalSGD([p2], lr=0.5, momentum=0.9)
    assert a.options == b.options
    for _ in range(2):
        a.step([torch.ones(3)])
        b.step([torch.ones(3)])
    assert torch.equal(p1, p2) and torch.allclose(p1, torch.full((3,), 1 - 0.5 - 0.95))
    with pytest.raises(TypeError, match="not both"):
        C.FunctionalSGD([p1], options=C.SGDOptions(), lr=0.1)
    with pytest.raises(TypeError, match="options must be a SGDOptions, got .*AdamOptions"):
        C.FunctionalSGD([p1], options=C.AdamOptions())


def test_zero_groups_are_named_and_typed():
    g = C.ZeroSGDGroup(params=[0, 2], grads=[torch.ones(1), None], momentum_buffers=[None, None],
                       options=C.SGDOptions(lr=0.1))
    assert g.params == [0, 2] and g.grads[1] is None and g.momentum_buffers == [None, None]
    assert g.options.lr == 0.1
    with pytest.raises(TypeError):  # keyword-only: no positional tuples
        C.ZeroSGDGroup([0], [torch.ones(1)], [None], C.SGDOptions())
    with pytest.raises(TypeError):
        C.ZeroAdamGroup(params=[0], grads=[torch.ones(1)], exp_avgs=[None], exp_avg_sqs=[None],
                        max_exp_avg_sqs=[], steps=[torch.zeros(())], options=C.SGDOptions())
    a = C.ZeroAdamGroup(params=[0], grads=[torch.ones(1)], exp_avgs=[torch.zeros(1)],
                        exp_avg_sqs=[torch.zeros(1)], max_exp_avg_sqs=[],
                        steps=[torch.zeros(())], options=C.AdamOptions(amsgrad=False))
    assert a.max_exp_avg_sqs == [] and a.options.amsgrad is False


# ---- the fused ZeRO step takes the structs ------------------------------------------------------

# (class, arguments, what _fused_step returned at each of the 3 steps)
FUSED_CASES = [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True), [True] * 3),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True), [True] * 3),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), [True] * 3),
    # The elementwise optimizers: torch's first step makes the state, ddpx's steps after it
    # (Adagrad's constructor makes it: ddpx's from the first step).
    (torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
     [True] * 3),
    (torch.optim.RMSprop, dict(lr=1e-2), [False, True, True]),
    (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.9, centered=True, weight_decay=0.1),
     [False, True, True]),
    (torch.optim.Adadelta, dict(lr=0.5, rho=0.8, weight_decay=0.1), [False, True, True]),
    (torch.optim.Adamax, dict(lr=1e-2, maximize=True), [False, True, True]),
    (torch.optim.RAdam, dict(lr=1e-2, weight_decay=0.1), [False, True, True]),
    (torch.optim.Rprop, dict(lr=1e-2, etas=(0.4, 1.3), foreach=True), [False, True, True]),
]
if _ADAM_HAS_DECOUPLING:
    FUSED_CASES.append((torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1,
                                               decoupled_weight_decay=True), [True] * 3))


def _train_alike(ref, plain, model, zero, steps=3):
    """``steps`` steps of the unsharded (ref, plain) and ZeRO (model, zero) pairs on the same
    batches. Returns what ZeRO's ``_fused_step`` returned at each step and the largest relative
    difference of the parameters."""
    took = []
    fused = zero._fused_step
    zero._fused_step = lambda *a, **k: took.append(fused(*a, **k)) or took[-1]
    for step in range(steps):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, plain), (model, zero)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    err = max(((a - b).abs().max() / b.abs().max()).item()
              for a, b in zip(model.parameters(), ref.parameters()))
    return took, err


def _fused_rank(rank, world_size):
    from ddpx.optim import ZeroRedundancyOptimizer
    out = []
    for cls, kwargs, _ in FUSED_CASES:
        torch.manual_seed(0)
        ref = torch.nn.Linear(8, 4)
        model = torch.nn.Linear(8, 4)
        model.load_state_dict(ref.state_dict())
        plain = cls(ref.parameters(), **kwargs)
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)
        took, err = _train_alike(ref, plain, model, zero)
        # This rank's state as the unsharded optimizer's, key for key (the step's type too).
        state_err = 0.0
        index = {p: i for i, p in enumerate(model.parameters())}
        refs = list(ref.parameters())
        for group in zero.optim.param_groups:
            for p in group["params"]:
                mine, theirs = zero.optim.state[p], plain.state[refs[index[p]]]
                assert mine.keys() == theirs.keys(), (cls.__name__, mine.keys(), theirs.keys())
                for k, v in theirs.items():
                    w = mine[k]
                    assert type(w) is type(v), (cls.__name__, k, type(w), type(v))
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        state_err = max(state_err, ((w - v).abs().max()
                                                    / v.abs().max().clamp_min(1e-30)).item())
                    else:
                        assert float(w) == float(v), (cls.__name__, k, w, v)
        out.append((took, err, state_err))
    return out


def test_fused_zero_step_takes_the_structs():
    from dist_utils import run_ranks
    for rank_out in run_ranks(_fused_rank, 2):
        for (cls, kwargs, fused), (took, err, state_err) in zip(FUSED_CASES, rank_out):
            assert took == fused, (cls.__name__, kwargs, took)
            assert err <= 1e-6, (cls.__name__, kwargs, err)
            assert state_err <= 1e-6, (cls.__name__, kwargs, state_err)


def test_elementwise_step_refusal_is_the_steps_own_checks():
    """``<kind>_step_refusal`` answers with the message ``<kind>_step`` would raise, and changes
    nothing; ZeRO asks it before stepping any group."""
    p, g = torch.ones(4), torch.full((4,), 0.5)
    state = {"exp_avg": [torch.zeros(4)], "exp_inf": [torch.zeros(4)]}
    assert C.adamax_step_refusal([p], [g], state, [1], options=C.AdamaxOptions()) is None
    cases = [
        (([p.half()], [g.half()], state, [1]), "only float32 and float64"),
        (([torch.ones(4, 2).t()], [torch.ones(2, 4)], {k: [torch.zeros(2, 4)] for k in state},
          [1]), "must be contiguous"),
        (([p], [g], {"exp_avg": [torch.zeros(3)], "exp_inf": [torch.zeros(4)]}, [1]),
         "has shape"),
        (([p], [g.double()], state, [1]), "has dtype"),
        (([p], [g], {"exp_avg": [torch.zeros(4)], "exp_inf": [None]}, [1]), "part of its state"),
        (([p], [g], {"exp_avg": [None], "exp_inf": [None]}, [2]), "but no state"),
        (([p], [g.to_sparse()], state, [1]), "must be dense"),
    ]
    for args, message in cases:
        before = [t.clone() for t in args[2]["exp_avg"] if t is not None]
        got = C.adamax_step_refusal(*args, options=C.AdamaxOptions())
        assert got is not None and message in got, (message, got)
        with pytest.raises((RuntimeError, ValueError), match=message):
            C.adamax_step(*args, options=C.AdamaxOptions())
        after = [t for t in args[2]["exp_avg"] if t is not None]
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert torch.equal(p, torch.ones(4))


def _refused_rank(rank, world_size):
    from ddpx.optim import ZeroRedundancyOptimizer
    torch.manual_seed(0)
    ref, model = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    model.load_state_dict(ref.state_dict())
    for m in (ref, model):  # a transposed weight: torch's state follows its layout
        m.weight.data = m.weight.data.t().contiguous().t()
    plain = torch.optim.Adamax(ref.parameters(), lr=1e-2)
    zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adamax,
                                   lr=1e-2)
    return _train_alike(ref, plain, model, zero)


def test_elementwise_zero_step_falls_back_where_the_kernels_refuse():
    """A non-contiguous parameter (and so torch's state of it): ZeRO's elementwise step is
    refused on the rank that owns it, torch's own step runs there, and the result is torch's."""
    from dist_utils import run_ranks
    results = run_ranks(_refused_rank, 2)
    assert any(took == [False] * 3 for took, _ in results), results
    for took, err in results:
        assert err <= 1e-6, (took, err)
