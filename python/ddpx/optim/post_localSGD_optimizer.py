"""``ddpx.optim.PostLocalSGDOptimizer``: torch's ``PostLocalSGDOptimizer`` over ddpx's native
model averagers (``ddpx.model_averaging``)."""
import inspect
import warnings
from typing import Any, Callable, Dict, Optional

import torch

__all__ = ["PostLocalSGDOptimizer"]


def _torch_zero_grad_default() -> bool:
    """The default of torch's ``PostLocalSGDOptimizer.zero_grad(set_to_none=...)`` (False in torch
    1.13, True in 2.x), which it passes to the wrapped optimizer whatever that one's default."""
    try:
        from torch.distributed.optim import PostLocalSGDOptimizer as TorchWrapper
        fn = TorchWrapper.zero_grad
    except ImportError:  # pragma: no cover - torch without distributed
        fn = torch.optim.Optimizer.zero_grad
    default = inspect.signature(fn).parameters["set_to_none"].default
    return bool(default) if isinstance(default, bool) else True


_ZERO_GRAD_DEFAULT = _torch_zero_grad_default()


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    r"""Wraps any :class:`torch.optim.Optimizer` and runs post-local SGD: every :meth:`step`
    runs the local optimizer, then the model averager on its parameter groups. Same behaviour as
    torch's :class:`~torch.distributed.optim.PostLocalSGDOptimizer`: ``param_groups`` and
    ``state`` are the wrapped optimizer's, read through (so LR schedulers work, also after
    :meth:`load_state_dict`, where torch's wrapper keeps stale groups), :meth:`state_dict` adds the
    averager's ``step``, :meth:`load_state_dict` restores it (warning and starting at 0 if the
    checkpoint has none). ``step`` also takes a closure, passed to the local optimizer.

    Args:
        optim: the local optimizer.
        averager: a model averager, e.g. :class:`ddpx.model_averaging.PeriodicModelAverager`
            (torch's averagers work too).

    Example::
        >>> state = ddpx.hooks.PostLocalSGDState(process_group=None, subgroup=None,
        ...                                      start_localSGD_iter=100)
        >>> ddpx.register_comm_hook(ddp_model, state, ddpx.hooks.post_localSGD_hook)
        >>> opt = ddpx.optim.PostLocalSGDOptimizer(
        ...     optim=torch.optim.SGD(ddp_model.parameters(), lr=0.01),
        ...     averager=ddpx.model_averaging.PeriodicModelAverager(period=4, warmup_steps=100))
        >>> for step in range(200):
        ...     opt.zero_grad(); loss_fn(ddp_model(x), y).backward(); opt.step()
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: Any):
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(
                f"PostLocalSGDOptimizer: optim must be a torch.optim.Optimizer, got "
                f"{type(optim).__name__}")
        if not callable(getattr(averager, "average_parameters", None)) or not hasattr(
                averager, "step"):
            raise TypeError(
                "PostLocalSGDOptimizer: averager must be a model averager (with "
                f"average_parameters() and step), got {type(averager).__name__}")
        # Deliberately no Optimizer.__init__: the wrapped optimizer owns groups and state.
        self.optim = optim
        self.averager = averager

    @property
    def param_groups(self):  # type: ignore[override]
        """The wrapped optimizer's parameter groups, read through: its ``load_state_dict``
        replaces them with new dicts, and an LR scheduler on this wrapper must see those (torch's
        wrapper binds them once, so a resumed scheduler stops reaching the optimizer)."""
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, groups) -> None:
        self.optim.param_groups = groups

    @property
    def state(self):  # type: ignore[override]
        """The wrapped optimizer's ``state``, the same object (no copy)."""
        return self.optim.state

    @property
    def defaults(self):  # type: ignore[override]
        """The wrapped optimizer's ``defaults``, the same object (no copy)."""
        return self.optim.defaults

    def __repr__(self) -> str:
        return self.optim.__repr__()

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict plus ``'step'``, the averager's step."""
        optim_state_dict = self.optim.state_dict()
        optim_state_dict["step"] = self.averager.step
        return optim_state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads the wrapped optimizer's state and restores the averager's step (0, with a
        warning, if ``state_dict`` has no ``'step'``)."""
        self.optim.load_state_dict(state_dict)
        if "step" in state_dict:
            self.averager.step = state_dict["step"]
        else:
            warnings.warn(  # noqa: B028  (torch's warning, raised as torch raises it)
                "Loaded state dict does not contain a step counter for an averager. "
                "Setting step counter to 0.")
            self.averager.step = 0

    def step(self, closure: Optional[Callable[[], float]] = None):  # type: ignore[override]
        """Runs the local optimizer's step, then model averaging. Returns the closure's loss."""
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        self.averager.average_parameters(params=self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = _ZERO_GRAD_DEFAULT) -> None:  # type: ignore[override]
        """The wrapped optimizer's ``zero_grad(set_to_none=set_to_none)``; the default is torch's
        wrapper's (read from the installed torch: True in 2.x, False in 1.13)."""
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)
