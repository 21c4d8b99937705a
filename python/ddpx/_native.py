"""The machinery every ddpx hook shares: a hook function that DDP's ``register_comm_hook``
accepts (drop-in) and that carries the factory of its C++ object, the native hook objects built
from it, native registration into DDP's C++ Reducer, and the Python side of the native states.

The state protocol. A hook's state reaches its C++ object through :func:`native_state`, one
function for every hook:

* a process group (``state_type=dist.ProcessGroup``, the default hooks): None (the default
  group, as in torch) or a ``ProcessGroup``;
* a ddpx state class (``PowerSGDState``, ``PostLocalSGDState``): an instance of it, whose
  ``_ddpx_native_(self, hook_name)`` returns the ``_C`` state object. It is called when the
  native hook object is built: at :func:`register_comm_hook`, or at the first bucket of the
  drop-in path (once per hook and state; the object is cached on the state).
* ``object``: any state, passed on as it is (``noop_hook`` ignores it, the compress wrappers
  hand it to the hook they wrap).

and two optional callbacks of a state, called by this module whatever the hook (a wrapper
around a hook included):

* ``_ddpx_on_register_(self, ddp_model)``: by :func:`register_comm_hook`, once the native hook
  is built and before it goes into the Reducer;
* ``_ddpx_on_bucket_(self, bucket)``: by the drop-in hook, for every bucket, before the native
  hook runs it.
"""
import atexit
import functools
import logging
import sys
from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch
import torch.distributed as dist

from . import _compat
from ._groups import resolve_group
from ._loader import _C

HookFn = Callable[[Any, dist.GradBucket], torch.futures.Future]

# Native hook objects built for a given (hook, state): the drop-in path reuses them across
# buckets and iterations. The state is kept in the value so its id() stays unique.
_native_cache: Dict[Tuple[int, int], Tuple[Any, Any, "_C.CommHook"]] = {}

# The names of the hooks made for each state type, for the TypeError's wording.
_hooks_of_state: Dict[type, Set[str]] = {}


@atexit.register
def _clear_native_cache() -> None:
    _native_cache.clear()


# ---- the state protocol -----------------------------------------------------------------------

def native_state(state: Any, hook_name: str, state_type: type = dist.ProcessGroup) -> Any:
    """What the C++ hook ``hook_name`` is built on, from the ``state`` it was given (see the
    module's docstring); TypeError when ``state`` is not a ``state_type``."""
    if state_type is dist.ProcessGroup:
        return resolve_group(state, hook_name, arg="state")
    if not isinstance(state, state_type):
        name = state_type.__name__
        hint = ""
        if type(state).__name__ == name:
            needs = "hooks need" if len(_hooks_of_state.get(state_type, ())) > 1 else "hook needs"
            hint = f" (this is torch's {name}; ddpx's {needs} ddpx.hooks.{name})"
        raise TypeError(
            f"{hook_name}: state must be a ddpx.hooks.{name}, got {type(state).__name__}{hint}")
    native = getattr(state_type, "_ddpx_native_", None)
    return state if native is None else state._ddpx_native_(hook_name)


def _call_back(state: Any, callback: str, arg: Any) -> None:
    method = getattr(state, callback, None)
    if method is not None:
        method(arg)


# ---- hook functions ---------------------------------------------------------------------------

def _run(hook: HookFn, state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    if isinstance(bucket, tuple):  # DDP's python_reducer calls hooks with (grad, param)
        raise TypeError(f"{getattr(hook, '_ddpx_name', hook.__name__)}: "
                        f"{_compat.PYTHON_REDUCER_MESSAGE}")
    native = native_hook(hook, state)
    _call_back(state, "_ddpx_on_bucket_", bucket)
    # DDP's Python path expects the future to hold a Python object: `then` provides it.
    return native.run(bucket).then(_value)


def _hook_function(first_param: str) -> HookFn:
    """A hook function whose parameters are named as torch's: ``(first_param, bucket)`` (torch
    names the first one ``process_group`` in the default hooks, ``state`` in the stateful ones,
    ``_`` in noop_hook and ``hook_state`` in the hooks its compress wrappers return), so that
    calls by keyword and ``inspect.signature`` see torch's names."""
    if first_param == "process_group":
        def hook(process_group, bucket):
            return _run(hook, process_group, bucket)
    elif first_param == "hook_state":
        def hook(hook_state, bucket):
            return _run(hook, hook_state, bucket)
    elif first_param == "_":
        def hook(_, bucket):
            return _run(hook, _, bucket)
    elif first_param == "state":
        def hook(state, bucket):
            return _run(hook, state, bucket)
    else:
        raise ValueError(f"unknown hook parameter name {first_param!r}")
    return hook


def make_hook(name: str, build: Callable[[Any], "_C.CommHook"], doc: str,
              state_type: type = dist.ProcessGroup, first_param: str = "state", *,
              qualname: Optional[str] = None, module: Optional[str] = None) -> HookFn:
    """A ddpx hook function named ``name``: ``build(native_state(state, name, state_type))``
    makes its C++ object for a state. ``first_param``: the name of its state parameter (torch's,
    see :func:`_hook_function`).

    The hook pickles by reference, as torch's hook functions do: pickle records its
    ``__module__`` and ``__qualname__`` and finds the very same function there when it loads, so
    ``pickle.loads(pickle.dumps(hook)) is hook`` and a checkpoint holding the hook beside its
    state reloads. They are ``module`` (by default the module that calls make_hook) and
    ``qualname`` (by default ``name``): right for a hook assigned to the module-level name
    ``name`` (``powerSGD_hook = make_hook("powerSGD_hook", ...)``). A hook made elsewhere names
    where it can be found (the compress wrappers' results). DDP's logging data records the
    ``__qualname__`` as the hook's name, on both paths.
    """
    hook = _hook_function(first_param)

    # torch 1.13's DDP refuses any hook whose __name__ is bf16_compress_hook (or
    # bf16_compress_wrapper_hook) unless torch has CUDA and NCCL >= 2.10, before the hook runs.
    # ddpx's bf16 hooks work on Gloo and CPU, so their __name__ carries a ddpx_ prefix; DDP reads
    # only the __name__ for that check, so the __qualname__ keeps the attribute's name, by which
    # pickle finds the function.
    hook.__name__ = ("ddpx_" + name) if name.startswith("bf16") else name
    hook.__qualname__ = name if qualname is None else qualname
    # The caller's module, as namedtuple and enum's functional API find theirs.
    hook.__module__ = module if module is not None else sys._getframe(1).f_globals.get(
        "__name__", __name__)
    hook.__doc__ = doc
    hook._ddpx_factory = lambda state: build(native_state(state, name, state_type))  # type: ignore[attr-defined]
    hook._ddpx_name = name  # type: ignore[attr-defined]
    _hooks_of_state.setdefault(state_type, set()).add(name)
    return hook


def _value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()


def _bind_partial(hook: functools.partial) -> HookFn:
    """The ddpx hook function that ``functools.partial(ddpx_hook, **keywords)`` stands for
    (``quantization_perchannel_hook``'s ``bucket_size``): keyword arguments only."""
    bind = getattr(hook.func, "_ddpx_bind", None)
    if bind is None or hook.args:
        raise TypeError(
            "a functools.partial hook must bind keyword arguments of a ddpx hook that takes "
            "them (e.g. functools.partial(ddpx.hooks.quantization_perchannel_hook, "
            f"bucket_size=128)), got {hook!r}")
    return bind(**hook.keywords)


def native_hook(hook: HookFn, state: Any = None) -> "_C.CommHook":
    """Returns the C++ hook object behind a ddpx hook function for ``state`` (cached)."""
    if isinstance(hook, functools.partial):
        hook = _bind_partial(hook)
    factory = getattr(hook, "_ddpx_factory", None)
    if factory is None:
        raise TypeError(
            "expected a ddpx hook (one of ddpx.hooks.allreduce_hook, fp16_compress_hook, "
            "bf16_compress_hook, noop_hook, or a ddpx fp16/bf16_compress_wrapper), got "
            f"{getattr(hook, '__qualname__', repr(hook))}; Python hooks register with "
            "ddp_model.register_comm_hook instead"
        )
    # Stateful hooks (PowerSGDState, ...) keep their native objects on the state itself, so that
    # they (and the process group they hold) die with it; None / ProcessGroup states share a
    # module cache, emptied at exit before torch tears the process groups down.
    cache = None
    if isinstance(state, NativeState):
        cache = state._native_hooks()
    elif hasattr(state, "__dict__"):
        cache = state.__dict__.setdefault("_ddpx_native_hooks", {})
    if cache is not None:
        entry = cache.get(id(hook))
        if entry is None or entry[0] is not hook:
            entry = (hook, factory(state))
            cache[id(hook)] = entry
        return entry[1]
    # None means "the default group at call time": key by the group it resolves to now, so that a
    # re-initialised default group gets a fresh native hook.
    group = dist.group.WORLD if state is None and dist.is_initialized() else state
    key = (id(hook), id(group))
    entry = _native_cache.get(key)
    if entry is None or entry[0] is not hook or entry[1] is not group:
        entry = (hook, group, factory(state))
        _native_cache[key] = entry
    return entry[2]


def register_comm_hook(ddp_model: torch.nn.parallel.DistributedDataParallel, state: Any,
                       hook: HookFn) -> None:
    """Registers a ddpx hook natively: its C++ object goes straight into DDP's C++ Reducer, so
    no Python and no GIL run per bucket during backward.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` model.
        state: the hook's state, as for ``ddp_model.register_comm_hook`` (a ProcessGroup or
            None for the default group for the default hooks).
        hook: a ddpx hook, e.g. ``ddpx.hooks.fp16_compress_hook``, or a ``functools.partial``
            of one with keyword arguments (``quantization_perchannel_hook``'s ``bucket_size``).

    A DDP model takes one communication hook: registering a second one (by either path)
    raises RuntimeError, as in torch. So does a model built for torch.compile's
    ``optimize_ddp="python_reducer"``, which has no buckets (the default ``"ddp_optimizer"``
    works).
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            "register_comm_hook: ddp_model must be a torch.nn.parallel.DistributedDataParallel, "
            f"got {type(ddp_model).__name__}"
        )
    if _compat.uses_python_reducer(ddp_model):
        raise RuntimeError(f"register_comm_hook: {_compat.PYTHON_REDUCER_MESSAGE}")
    named = _bind_partial(hook) if isinstance(hook, functools.partial) else hook
    native = native_hook(named, state)
    _call_back(state, "_ddpx_on_register_", ddp_model)
    # The name DDP's logging data records for this hook: the same as on the drop-in path (DDP
    # logs a Python hook's __qualname__), so monitoring sees one name whichever path registered it.
    _compat.set_comm_hook_name(ddp_model, named.__qualname__)
    _C.register_comm_hook(_compat.reducer_of(ddp_model), native)
    _compat.record_comm_hook(ddp_model, hook, state)


# ---- the Python side of native states ---------------------------------------------------------

def check_int(who: str, name: str, value: Any) -> int:
    """``value`` if it is an int (not a bool), else TypeError naming ``who`` and ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{who}: {name} must be an int, got {type(value).__name__}")
    return value


def check_number(who: str, name: str, value: Any) -> float:
    """``value`` as a float if it is an int or a float (not a bool), else TypeError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{who}: {name} must be a number, got {type(value).__name__}")
    return float(value)


def native_property(name: str, check: Optional[Callable[[str, Any], Any]] = None,
                    doc: Optional[str] = None, *, readonly: bool = False, keep: bool = False,
                    get: Callable[[Any, str], Any] = getattr,
                    put: Callable[[Any, str, Any], None] = setattr) -> property:
    """A property ``name`` of a class whose native object is ``self._cpp``, read with
    ``get(self._cpp, name)`` and written with ``put(self._cpp, name, value)`` (by default the
    native object's attribute of the same name).

    Args:
        check: ``check(name, value)`` validates a value (TypeError) and returns what to write.
        readonly: no setter.
        keep: the value as given is kept in ``self._<name>`` and is what the property returns
            (process groups: None stays None for the user while C++ holds the group it resolves
            to); the class's ``__init__`` sets ``self._<name>``.
    """
    private = "_" + name

    def getter(self):
        return getattr(self, private) if keep else get(self._cpp, name)

    def setter(self, value):
        put(self._cpp, name, value if check is None else check(name, value))
        if keep:
            setattr(self, private, value)

    return property(getter, None if readonly else setter, doc=doc)


def declare_option_properties(cls: type, names: Tuple[str, ...],
                              convert: Callable[[str, Any], Any] = lambda name, value: value,
                              doc: str = "The ``{}`` option (settable).") -> None:
    """A property ``cls.<name>`` for each of ``names``, the fields of the native state's
    ``options`` (all of them): read from ``self._cpp.options``; written by building a fresh
    options object with the one field replaced (``convert(name, value)``, which raises TypeError
    for a value of the wrong type) and handing it to ``set_options``, which validates it (the
    native state is unchanged when it raises)."""
    def get(cpp: Any, name: str) -> Any:
        return getattr(cpp.options, name)

    def put(cpp: Any, name: str, value: Any) -> None:
        current = cpp.options
        opts = type(current)()
        for field in names:
            setattr(opts, field, getattr(current, field))
        setattr(opts, name, convert(name, value))
        cpp.set_options(opts)

    for name in names:
        setattr(cls, name, native_property(name, get=get, put=put, doc=doc.format(name)))


def process_group_property(who: str) -> property:
    """``process_group``: None (the default group) or a ProcessGroup, as given."""
    return native_property(
        "process_group", lambda name, group: resolve_group(group, who, arg=name), keep=True,
        doc="The group the hook averages over (None: the default group).")


class NativeState:
    """Base of the Python mirrors of the native hook states, whose C++ object is ``self._cpp``:
    the protocol's ``_ddpx_native_``, iteration counting, ``state_dict()`` /
    ``load_state_dict()`` and pickling. Subclasses define ``__setstate__`` (how to rebuild the
    native state) and log through their module's logger.

    Like torch's states, the ddpx ones have no ``__dict__`` (``__slots__``): assigning a
    misspelled attribute (``state.matrix_aproximation_rank = 4``) raises AttributeError instead
    of being silently ignored. Subclasses declare their own private slots, and set the class's
    ``__slots__`` to torch's list of names after the class is built (see
    :func:`declare_torch_slots`)."""

    __slots__ = ("_cpp", "_ddpx_native_hooks", "__weakref__")

    def _native_hooks(self) -> Dict[int, Any]:
        """The cache of native hook objects built on this state (see :func:`native_hook`)."""
        try:
            return self._ddpx_native_hooks
        except AttributeError:
            self._ddpx_native_hooks: Dict[int, Any] = {}
            return self._ddpx_native_hooks

    def _ddpx_native_(self, hook_name: str) -> Any:
        return self._cpp

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Counts one iteration when ``bucket`` is the last bucket of a step."""
        self._cpp.maybe_increase_iter(bucket.is_last())

    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to resume, without the process groups (not serialisable)."""
        return self._cpp.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s content."""
        self._cpp.load_state_dict(state_dict)

    def __getstate__(self) -> Dict[str, Any]:
        logging.getLogger(type(self).__module__).warning(
            "NOTE: Process group is not serializable and excluded from a saved state.")
        return self.state_dict()


def declare_torch_slots(cls: type, names: Tuple[str, ...]) -> None:
    """Sets ``cls.__slots__`` to torch's names for the same class, after the class is built.

    The instance layout comes from the private slots the class declared when it was built (torch's
    names are properties there, reading the native state, and a slot may not share a property's
    name); ``__slots__`` itself is then an ordinary class attribute, read by code that enumerates
    a state's fields as torch's own ``__getstate__`` does (``for slot in self.__slots__``)."""
    cls.__slots__ = list(names)  # type: ignore[attr-defined]
