"""Which torch optimizers ddpx runs in C++, and the options a torch parameter group stands for.

One table (``_FORMS``) says, for each ``torch.optim`` class ddpx knows, whether its update is
elementwise (ZeRO's balanced partition may then split its parameters) and which C++ options
struct its hyper-parameters become (``ddpx._C.SGDOptions``, ``AdamOptions``, ``AdagradOptions``,
``RMSpropOptions``; None: no C++ form). ``cpp_options`` maps a ``param_group`` (or an optimizer's
constructor arguments, as the RPC ``DistributedOptimizer`` receives them) to that struct, which
validates its values once, with torch's errors. ``ZeroRedundancyOptimizer``'s fused step and the
RPC ``DistributedOptimizer`` both go through it: the structs, not positional tuples or dicts of
numbers, are what crosses into C++.

torch's own table of functional optimizers (``torch.distributed.optim.utils.functional_optim_map``,
read by ``ddpx._compat``) is another matter: it is torch's rule for which optimizers
``overlap_with_ddp=True`` accepts, kept as torch has it.
"""
import inspect
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

import torch

from .._loader import _C

__all__ = ["cpp_options", "has_cpp_form", "is_elementwise", "cpp_optimizer_names"]


class _Form(NamedTuple):
    elementwise: bool  # an element's update reads only that element and per-parameter scalars
    options: Optional[type]  # the C++ options struct; None: no C++ form
    fixed: Tuple[Tuple[str, Any], ...] = ()  # what the class sets itself (AdamW: decoupled)


# Not elementwise: LBFGS (a global line search), SparseAdam (sparse), Adafactor (row and
# column factors).
_TABLE = {
    "SGD": _Form(True, _C.SGDOptions),
    "Adam": _Form(True, _C.AdamOptions),
    "AdamW": _Form(True, _C.AdamOptions, (("decoupled_weight_decay", True),)),
    "Adagrad": _Form(True, _C.AdagradOptions),
    "RMSprop": _Form(True, _C.RMSpropOptions),
    "Adadelta": _Form(True, _C.AdadeltaOptions),
    "Adamax": _Form(True, _C.AdamaxOptions),
    "ASGD": _Form(True, None),
    "NAdam": _Form(True, None),
    "RAdam": _Form(True, _C.RAdamOptions),
    "Rprop": _Form(True, _C.RpropOptions),
    "LBFGS": _Form(False, None),
    "SparseAdam": _Form(False, None),
    "Adafactor": _Form(False, None),
}
# By class (this torch's classes only); exact classes: a subclass may change the step.
_FORMS: Dict[type, _Form] = {getattr(torch.optim, name): form for name, form in _TABLE.items()
                             if hasattr(torch.optim, name)}

# Constructor arguments that only choose torch's implementation (the result is the same): ignored
# at these values; another value (fused, differentiable, capturable) has no C++ form.
_IMPLEMENTATION_ONLY = {"foreach": (None, False, True), "fused": (None, False),
                        "differentiable": (False,), "capturable": (False,)}


def is_elementwise(optimizer_class: Any) -> bool:
    """Whether ``optimizer_class``'s update of an element depends only on that element (and on
    per-parameter scalars such as the step count)."""
    form = _FORMS.get(optimizer_class)
    return form is not None and form.elementwise


def has_cpp_form(optimizer_class: Any) -> bool:
    """Whether ``optimizer_class`` (exactly; not a subclass) has a C++ form in ddpx."""
    form = _FORMS.get(optimizer_class)
    return form is not None and form.options is not None


def cpp_optimizer_names() -> Tuple[str, ...]:
    """The names of the torch.optim classes with a C++ form, for messages and docs."""
    return tuple(name for name, form in _TABLE.items() if form.options is not None)


# torch's pair arguments and the two fields each is in the structs (which take the pair too).
_PAIRS = {"betas": ("beta1", "beta2"), "etas": ("etaminus", "etaplus"),
          "step_sizes": ("step_size_min", "step_size_max")}


def _field_names(options_class: type) -> frozenset:
    names = set(options_class()._asdict())
    names.update(pair for pair, (first, _) in _PAIRS.items() if first in names)
    return frozenset(names)


_FIELDS = {form.options: _field_names(form.options) for form in _TABLE.values() if form.options}


def _arguments(optimizer_class: type) -> frozenset:
    """The names of ``optimizer_class``'s constructor arguments, but ``params``."""
    names = list(inspect.signature(optimizer_class).parameters)[1:]
    return frozenset(names)


def _number(name: str, value: Any, tensors: bool) -> Tuple[Any, str]:
    """(value for the struct, "") or (None, why it has no C++ form)."""
    if isinstance(value, torch.Tensor):
        if not tensors:
            return None, f"a tensor {name} is not supported by ddpx's C++ optimizers"
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number, got a tensor of {value.numel()} elements")
        return value.item(), ""
    if type(value).__name__ == "_RequiredParameter":  # torch 1.13's `required` (lr of SGD)
        return None, f"{name} is required"
    if isinstance(value, (bool, int, float)):
        return value, ""
    return None, f"{name}={value!r} is not a number"


def cpp_options(optimizer_class: Any, group: Mapping[str, Any], *,
                tensors: bool = False) -> Tuple[Optional[Any], str]:
    """The C++ options for ``group`` (a ``param_group`` of ``optimizer_class``, or its
    constructor arguments by name): ``(options, "")``, or ``(None, reason)`` where ddpx has no C++
    form for it (the class, an argument the struct lacks, ``fused=True``, a tensor value unless
    ``tensors`` allows one-element tensors). Keys that are not constructor arguments of the class
    (a scheduler's ``initial_lr``, a user's own) are ignored, as torch's step ignores them. Values
    torch refuses raise torch's ValueError (the struct validates them)."""
    form = _FORMS.get(optimizer_class)
    name = getattr(optimizer_class, "__qualname__", repr(optimizer_class))
    if form is None or form.options is None:
        return None, f"{name} has no C++ form in ddpx"
    arguments, fields = _arguments(optimizer_class), _FIELDS[form.options]
    values: Dict[str, Any] = {}
    for key, value in group.items():
        if key not in arguments:
            continue
        if key in _IMPLEMENTATION_ONLY:
            if not any(value is v or value == v for v in _IMPLEMENTATION_ONLY[key]):
                return None, f"{key}={value!r} is not supported by ddpx's C++ {name}"
            continue
        if key not in fields:
            return None, f"argument {key!r} is not supported by ddpx's C++ {name}"
        if key in _PAIRS:
            pair = []
            for i, item in enumerate(value):
                number, reason = _number(f"{key}[{i}]", item, tensors)
                if reason:
                    return None, reason
                pair.append(number)
            values[key] = tuple(pair)
            continue
        number, reason = _number(key, value, tensors)
        if reason:
            return None, reason
        values[key] = number
    values.update(form.fixed)
    return form.options(**values), ""
