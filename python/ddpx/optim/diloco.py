"""``ddpx.optim.DiLoCo``: DiLoCo and Streaming DiLoCo over any torch optimizers, the
synchronization native (``ddpx::optim::DiLoCoSync``)."""
from typing import Any, Callable, Dict, List, Optional

import torch

from .._groups import resolve_group
from .._loader import _C

__all__ = ["DiLoCo"]

_FORMAT = "ddpx.optim.DiLoCo/1"


class DiLoCo(torch.optim.Optimizer):
    r"""DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (Douillard et al. 2025) as an
    optimizer. Each replica trains with its own ``inner_optimizer``; every ``sync_every`` inner
    steps the outer gradient (the global parameters minus the local ones) is averaged over
    ``process_group`` and applied to the global parameters by ``outer_optimizer``; every
    replica continues from the new global parameters (bit-identical on every rank).

    Call :meth:`step` after each backward: it runs the inner step and, when due, the outer
    synchronization. ``param_groups`` and ``state`` are the inner optimizer's (LR schedulers
    work on this object); :meth:`state_dict` holds the inner and outer optimizers' states, the
    global parameters, this rank's residuals and the fragments in flight, and resumes bit for
    bit.

    Args:
        inner_optimizer: the local optimizer (AdamW in the paper) over the replicated
            parameters.
        sync_every: H, the inner steps between two synchronizations (of each fragment).
        outer_optimizer: any torch optimizer over the same parameters; None means
            ``torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)``. SGD (this one or
            yours, one parameter group, no ``foreach``/``fused`` requirement) steps in C++,
            reading its ``param_groups`` at every outer step and keeping its
            ``momentum_buffer`` in its ``state``, as torch's.
        process_group: the group of replicas (None: the default group). With islands (DDP
            inside each node), pass the group of the ranks that hold the same shard: one rank
            per island.
        fragments: P, contiguous groups of parameters of about equal size synchronized at
            staggered steps: fragment f at steps ``(f + 1) * H // P + k * H``.
        fragment_sync_delay: tau, inner steps a fragment's exchange stays in flight before its
            outer step (0 <= tau < H).
        fragment_update_alpha: alpha in [0, 1]; after a fragment's outer step its parameters
            become ``alpha * local + (1 - alpha) * global``.
        bits: the outer gradients travel as fp32 (32), bf16 (16), or quantized with error
            feedback (8, 4, 2, 1: :func:`ddpx.hooks.quantized_hook`'s codecs, a residual per
            rank, reduce-scatter style from three ranks on).
        block_size: values per scale of the quantized outer gradients.
        use_error_feedback: keep each rank's quantization error for the fragment's next
            synchronization.
        bucket_cap_mb: outer gradients travel in buckets of about this size (whole parameters).

    Example::
        >>> inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
        >>> opt = ddpx.optim.DiLoCo(inner, sync_every=32, bits=4)
        >>> for x, y in data:
        ...     opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    """

    def __init__(self, inner_optimizer: torch.optim.Optimizer, sync_every: int,
                 outer_optimizer: Optional[torch.optim.Optimizer] = None,
                 process_group: Any = None, fragments: int = 1, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0, bits: int = 32, block_size: int = 256,
                 use_error_feedback: bool = True, bucket_cap_mb: float = 25.0):
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError("DiLoCo: inner_optimizer must be a torch.optim.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        for name, value in (("sync_every", sync_every), ("fragments", fragments),
                            ("fragment_sync_delay", fragment_sync_delay), ("bits", bits),
                            ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"DiLoCo: {name} must be an int, got {type(value).__name__}")
        if not isinstance(use_error_feedback, bool):
            raise TypeError("DiLoCo: use_error_feedback must be a bool, got "
                            f"{type(use_error_feedback).__name__}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"DiLoCo: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        params = [p for g in inner_optimizer.param_groups for p in g["params"]]
        if outer_optimizer is None:
            outer_optimizer = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
        elif not isinstance(outer_optimizer, torch.optim.Optimizer):
            raise TypeError("DiLoCo: outer_optimizer must be a torch.optim.Optimizer or None, "
                            f"got {type(outer_optimizer).__name__}")
        outer_params = [p for g in outer_optimizer.param_groups for p in g["params"]]
        if {id(p) for p in outer_params} != {id(p) for p in params}:
            raise ValueError("DiLoCo: outer_optimizer must be over the inner optimizer's "
                             "parameters (the same tensors)")
        group = resolve_group(process_group, "DiLoCo")
        # Deliberately no Optimizer.__init__: the inner optimizer owns groups and state.
        self.inner_optimizer = inner_optimizer
        self.outer_optimizer = outer_optimizer
        self.process_group = group
        self._params = params
        self._sync_every = sync_every
        self._sync = _C.DiLoCoSync(params, group, sync_every, fragments, fragment_sync_delay,
                                   float(fragment_update_alpha), bits, block_size,
                                   use_error_feedback, int(bucket_cap_mb * 1024 * 1024))

    # --- torch.optim.Optimizer's surface, read through to the inner optimizer ---

    @property
    def param_groups(self):  # type: ignore[override]
        """The inner optimizer's parameter groups, read through."""
        return self.inner_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups) -> None:
        self.inner_optimizer.param_groups = groups

    @property
    def state(self):  # type: ignore[override]
        """The inner optimizer's ``state``, the same object."""
        return self.inner_optimizer.state

    @property
    def defaults(self):  # type: ignore[override]
        """The inner optimizer's ``defaults``, the same object."""
        return self.inner_optimizer.defaults

    def __repr__(self) -> str:
        return (f"DiLoCo(sync_every={self.sync_every}, fragments={len(self.fragment_ranges)}, "
                f"inner={self.inner_optimizer!r}, outer={self.outer_optimizer!r})")

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise NotImplementedError("DiLoCo: parameters are fixed at construction (the global "
                                  "parameters and fragments are laid out over them)")

    # --- DiLoCo ---

    @property
    def sync_every(self) -> int:
        """H, the inner steps between two synchronizations of each fragment."""
        return self._sync_every

    @property
    def fragment_ranges(self) -> List[tuple]:
        """Parameter index ranges ``[begin, end)`` of the fragments."""
        return list(self._sync.fragment_ranges)

    @property
    def local_step(self) -> int:
        """Inner steps taken so far."""
        return self._sync.step

    @property
    def message_bytes(self) -> int:
        """Bytes of the outer-gradient messages this rank has made so far (fp32: 4 per value,
        bf16: 2, quantized: codes and scales)."""
        return self._sync.message_bytes

    @property
    def global_params(self) -> List[torch.Tensor]:
        """The global parameters (the values after each fragment's last outer step)."""
        return self._sync.global_params

    def _native_sgd(self) -> Optional[Dict[str, Any]]:
        """The outer SGD's hyper-parameters where C++ can step it (one group, plain SGD)."""
        outer = self.outer_optimizer
        if type(outer) is not torch.optim.SGD or len(outer.param_groups) != 1:
            return None
        g = outer.param_groups[0]
        if g.get("differentiable", False) or g.get("fused", False):
            return None
        if isinstance(g["lr"], torch.Tensor):
            return None
        return g

    def _outer_step(self, fragment: int) -> None:
        g = self._native_sgd()
        if g is not None:
            lo, hi = self._sync.fragment_ranges[fragment]
            state = self.outer_optimizer.state
            buffers = [state[p].get("momentum_buffer") if p in state else None
                       for p in self._params]
            options = _C.SGDOptions(
                lr=float(g["lr"]), momentum=float(g["momentum"]),
                dampening=float(g["dampening"]), weight_decay=float(g["weight_decay"]),
                nesterov=bool(g["nesterov"]), maximize=bool(g.get("maximize", False)))
            buffers = self._sync.outer_sgd_step(fragment, options, buffers)
            for p, b in zip(self._params[lo:hi], buffers[lo:hi]):
                if b is not None:
                    state[p]["momentum_buffer"] = b
            return
        self._sync.begin_outer(fragment)
        try:
            self.outer_optimizer.step()
        finally:
            self._sync.end_outer(fragment)

    def step(self, closure: Optional[Callable[[], float]] = None):  # type: ignore[override]
        """The inner step (with ``closure``, if any), then the outer steps due. Returns the
        closure's loss."""
        loss = (self.inner_optimizer.step() if closure is None
                else self.inner_optimizer.step(closure))
        for fragment in self._sync.after_inner_step():
            self._outer_step(fragment)
        return loss

    def state_dict(self) -> Dict[str, Any]:
        """``{"inner", "outer", "diloco"}``: the two optimizers' state dicts and the
        synchronization's (global parameters, this rank's residuals, fragments in flight, the
        step). Per rank: each rank saves and loads its own."""
        return {"format": _FORMAT, "inner": self.inner_optimizer.state_dict(),
                "outer": self.outer_optimizer.state_dict(), "diloco": self._sync.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any],
                        allow_reshard: bool = False) -> None:  # type: ignore[override]
        """Restores :meth:`state_dict`'s content. Another rank's residuals (or another world
        size's) are a ValueError unless ``allow_reshard`` (they then restart from zero, with a
        warning)."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != _FORMAT:
            raise ValueError("DiLoCo.load_state_dict: not a ddpx.optim.DiLoCo state dict")
        self._sync.load_state_dict(state_dict["diloco"], allow_reshard)
        self.inner_optimizer.load_state_dict(state_dict["inner"])
        self.outer_optimizer.load_state_dict(state_dict["outer"])
