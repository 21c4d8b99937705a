"""``ddpx.optim.ZeroRedundancyOptimizer``: torch's ``ZeroRedundancyOptimizer`` (ZeRO stage 1) over
ddpx's C++ engine (``ddpx/optim/zero.h``: partition, bucket views, parameter exchange, bulk state
gather), its fused SGD / Adam / AdamW kernels and the elementwise optimizers' kernels."""
import copy
import logging
import pickle
from itertools import chain
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from .. import _compat
from .._loader import _C
from ._options import cpp_options, is_elementwise

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)

# Exchange granularity (see ZeroRedundancyOptimizer.bucket_cap_bytes).
_DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024

_PARTITIONS = ("sorted_greedy", "balanced")
# Cuts of the balanced partition fall on multiples of this many elements within a parameter.
_BALANCED_ALIGN = 32


class _ZeROJoinHook(JoinHook):
    """Shadows the collectives of :meth:`ZeroRedundancyOptimizer.step` for a rank that has run out
    of inputs: it keeps stepping (its shard, with the gradients it has) and exchanging."""

    def __init__(self, zero: "ZeroRedundancyOptimizer"):
        if not isinstance(zero, ZeroRedundancyOptimizer):
            raise TypeError("the ZeRO join hook needs a ddpx ZeroRedundancyOptimizer, got "
                            f"{type(zero).__name__}")
        self.zero = zero
        super().__init__()

    def main_hook(self) -> None:
        self.zero.step()


class _TensorSlot:
    """Stands for the i-th tensor of a state dict while its skeleton travels pickled."""
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _map_tensors(obj: Any, fn: Callable[[Any], Any], leaf: type = torch.Tensor) -> Any:
    """``obj`` with every ``leaf`` instance replaced by ``fn(it)``; dicts, lists and tuples
    rebuilt, anything else kept."""
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn, leaf) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(v, fn, leaf) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _split_tensors(obj: Any, tensors: List[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a :class:`_TensorSlot` (appended to ``tensors``)."""
    def slot(t: torch.Tensor) -> _TensorSlot:
        tensors.append(t.detach())
        return _TensorSlot(len(tensors) - 1)
    return _map_tensors(obj, slot)


def _join_tensors(obj: Any, tensors: List[torch.Tensor]) -> Any:
    return _map_tensors(obj, lambda s: tensors[s.index], leaf=_TensorSlot)


def _to_cpu(obj: Any) -> Any:
    """Tensors moved to the CPU (no copy for CPU tensors, as torch's ZeRO), containers rebuilt."""
    return _map_tensors(obj, lambda t: t.cpu())


def _is_trainable(param: torch.Tensor) -> bool:
    return param.requires_grad


def _scalar_step(value: float = 0.0) -> torch.Tensor:
    """A new 0-dim ``step`` as torch.optim's Adam makes it on the CPU (float64 when that is the
    default dtype, float32 otherwise)."""
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(value, dtype=dtype)


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    r"""Wraps any :class:`torch.optim.Optimizer` and shards its state across the ranks of a group
    (`ZeRO <https://arxiv.org/abs/1910.02054>`_ stage 1): torch's
    :class:`~torch.distributed.optim.ZeroRedundancyOptimizer`, same arguments, methods, partition
    and results, on ddpx's C++ engine.

    Each rank owns the parameters torch's sorted-greedy partition gives it (whole tensors), keeps
    the local optimizer's state for those only (``self.optim``), updates them in :meth:`step` and
    broadcasts them to the other ranks. Where ddpx differs from torch's class:

    * the exchange is bucketed: small parameters travel packed (at most
      :attr:`bucket_cap_bytes` per broadcast) and large ones in their own storage, instead of one
      broadcast per tensor;
    * with ``optimizer_class`` ``torch.optim.SGD``, ``Adam`` or ``AdamW`` (fp32/fp64, dense,
      no ``fused``/``capturable``/``differentiable``, no closure, no step hooks), the shard's
      update runs in ddpx's fused C++ kernels chunk by chunk, and each chunk's broadcast starts
      as soon as it is updated (overlapping the rest of the update). Results equal torch.optim's to
      1e-6 relative (bit for bit on torch 1.13); the state stays in ``self.optim.state`` in
      torch's layout. Any other optimizer (or option) runs its own ``step`` first, then the
      exchange;
    * :meth:`consolidate_state_dict` sends each shard straight to the target rank in one buffer
      (no pickling of tensors, nothing sent to or through other ranks);
    * :meth:`load_state_dict` copies this rank's shard of the state into the local optimizer and
      keeps nothing else (torch keeps a second copy), and leaves the caller's dict unchanged.

    Args:
        params: an iterable of tensors or of parameter-group dicts (all of one dense type).
        optimizer_class: the local optimizer's class (any :class:`torch.optim.Optimizer`).
        process_group: the group to shard across (default: the default group).
        parameters_as_bucket_view: pack each rank's parameters into one flat tensor and make
            every ``param.data`` a view of it.
        overlap_with_ddp: run the step inside DDP's backward pass, through a comm hook made by
            :func:`ddpx.hooks.hook_with_zero_step` or
            :func:`ddpx.hooks.hook_with_zero_step_interleaved` (``step()`` then does nothing).
            ``optimizer_class`` must have a functional form in torch, as torch requires.
        partition: (keyword only; ddpx's) ``"sorted_greedy"`` (default): torch's partition,
            whole tensors, results identical to torch's class. ``"balanced"``: each parameter
            group's elements are laid end to end and cut into equal shares, so a large tensor is
            split between ranks (each rank's share of it is a slice of its flattened values, with
            its own state) and every rank holds an even share of the state (within 32 elements
            per cut). For optimizers whose update is elementwise only (SGD, Adam, AdamW, Adagrad,
            Adadelta, Adamax, ASGD, NAdam, RAdam, RMSprop, Rprop); checkpoints keep torch's
            per-parameter layout, so they load at any world size and into either partition.
        **defaults: forwarded to ``optimizer_class``.

    Example::
        >>> zero = ddpx.optim.ZeroRedundancyOptimizer(ddp_model.parameters(),
        ...                                           optimizer_class=torch.optim.Adam, lr=1e-3)
        >>> loss_fn(ddp_model(x), y).backward(); zero.step()
        >>> zero.consolidate_state_dict(to=0)
        >>> if rank == 0: torch.save(zero.state_dict(), "ckpt.pt")
    """

    #: Bytes of small parameters packed per broadcast (a contiguous parameter of 256 KiB or more,
    #: or a quarter of this if less, travels in its own storage). Read when the exchange is
    #: planned (construction, add_param_group, a trainability change).
    bucket_cap_bytes: int = _DEFAULT_BUCKET_CAP_BYTES

    def __init__(self, params, optimizer_class: Any, process_group: Any = None,
                 parameters_as_bucket_view: bool = False, overlap_with_ddp: bool = False,
                 *, partition: str = "sorted_greedy", **defaults: Any):
        params = self._verify_and_init_params(params)
        self._verify_same_dense_param_type()
        self._check_optimizer_class(optimizer_class, overlap_with_ddp)
        optimizer_class = self._local_optimizer_class(optimizer_class, overlap_with_ddp)
        self._check_partition(partition, optimizer_class)
        #: "sorted_greedy" (torch's) or "balanced" (see the class documentation).
        self.partition: str = partition
        if overlap_with_ddp and parameters_as_bucket_view:
            logger.warning("`parameters_as_bucket_view=True` will be ignored since "
                           "`overlap_with_ddp=True`; instead, a different bucketing strategy "
                           "will be used")
        # Optimizer.__init__ calls add_param_group, which behaves differently once initialized.
        self.initialized = False
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)

        self._param_to_rank_cache: Dict[torch.Tensor, int] = {}
        self._param_to_index_cache: Dict[torch.Tensor, int] = {}
        self._partition_parameters_cache: List[List[dict]] = []
        self._index_to_param_cache: List[torch.Tensor] = []
        # Per parameter, its pieces as (unit, begin, end, owner): the unit is the tensor the local
        # optimizer and the engine see (the parameter itself, or a slice of its flattened values
        # under the balanced partition), as the C++ ZeroLayout made them. A group's pieces, once
        # made, are kept (add_param_group leaves the earlier groups' partition alone).
        self._pieces: Dict[torch.Tensor, List[tuple]] = {}
        self._units_cache: List[torch.Tensor] = []
        self._unit_index_cache: Dict[torch.Tensor, int] = {}
        self._unit_owners: List[int] = []
        self._unit_params: List[torch.Tensor] = []
        self._is_trainable_mask = self._get_is_trainable_mask()
        self._default_device = self._all_params[0].device

        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size: int = dist.get_world_size(self.process_group)
        self.rank: int = dist.get_rank(self.process_group)
        self.global_rank: int = dist.distributed_c10d.get_global_rank(self.process_group,
                                                                      self.rank)
        self._overlap_with_ddp = overlap_with_ddp
        self._optim_defaults = defaults
        self._optim_constructor = optimizer_class
        self.parameters_as_bucket_view = parameters_as_bucket_view
        # The partition, in C++ (shared with the C++ class). partition="balanced" with
        # parameters_as_bucket_view: each group's parameters (per device) become views of one
        # flat tensor (flat_buffers) when the layout takes the group.
        self._layout = _C.ZeroLayout(self.world_size, self.rank, partition,
                                     flatten=self._balanced_bucket_view(), align=_BALANCED_ALIGN)
        self._init_local_optimizer()
        self._shards = None
        self._build_shards()
        # The consolidated state, on the target rank of consolidate_state_dict() only.
        self._all_state_dicts: List[Dict[str, Any]] = []
        self.initialized = True

    # ---- construction ---------------------------------------------------------------------

    def _verify_and_init_params(self, params: Any) -> list:
        if isinstance(params, torch.Tensor):
            raise TypeError("`params` argument should be an iterable of Tensors, but got "
                            f"{torch.typename(params)}")
        try:
            all_params = list(params)
        except TypeError as e:
            raise TypeError("`params` argument should be an iterable of Tensors or dicts, but "
                            f"got {torch.typename(params)}") from e
        if not all_params:
            raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
        if all(isinstance(p, torch.Tensor) for p in all_params):
            self._all_params = list(all_params)
        elif all(isinstance(p, dict) for p in all_params):
            self._all_params = []
            for group in all_params:
                if "params" not in group:
                    raise ValueError("Each parameter group passed-in via `params` must have a "
                                     "'params' key mapping to the parameters in the group")
                group_params = group["params"]
                if isinstance(group_params, torch.Tensor):
                    group_params = [group_params]
                else:
                    group_params = list(group_params)
                    group["params"] = group_params
                self._all_params.extend(group_params)
            if not all(isinstance(p, torch.Tensor) for p in self._all_params):
                raise TypeError("`params` argument should be an iterable of Tensors or dicts: "
                                "a parameter group holds something that is not a tensor")
        else:
            raise TypeError("`params` argument should be an iterable of Tensors or dicts")
        return all_params

    def _verify_same_dense_param_type(self) -> None:
        first = self._all_params[0]
        typename = torch.typename(first)
        if first.is_sparse or first.layout != torch.strided:
            raise ValueError("ZeroRedundancyOptimizer only supports using the same dense type "
                             f"for all parameters but got {typename} (sparse)")
        for param in self._all_params[1:]:
            other = torch.typename(param)
            if other != typename or param.layout != torch.strided:
                raise ValueError("ZeroRedundancyOptimizer only supports using the same dense "
                                 f"type for all parameters but got both {typename} and {other}")

    @staticmethod
    def _check_optimizer_class(optimizer_class: Any, overlap_with_ddp: bool) -> None:
        if not callable(optimizer_class):
            raise TypeError("ZeroRedundancyOptimizer: optimizer_class must be a torch.optim."
                            "Optimizer class (e.g. torch.optim.Adam), got "
                            f"{type(optimizer_class).__name__} {optimizer_class!r}")
        if not overlap_with_ddp and optimizer_class in _compat.functional_optimizer_classes():
            raise ValueError(f"Passing in a functional optimizer {optimizer_class} when "
                             "`overlap_with_ddp=False`")

    @staticmethod
    def _local_optimizer_class(optimizer_class: Any, overlap_with_ddp: bool) -> Any:
        """The class of the local optimizer. With ``overlap_with_ddp`` the optimizer must have a
        functional form in torch (``torch.distributed.optim.utils.functional_optim_map``), as
        torch requires; ddpx steps the shard with the ``torch.optim`` class itself (its fused
        kernels for SGD / Adam / AdamW), so a functional class passed in is mapped back to it."""
        if not overlap_with_ddp:
            return optimizer_class
        mapping = _compat.functional_optimizer_map()
        if optimizer_class in mapping:
            return optimizer_class
        for optim_class, functional in mapping.items():
            if optimizer_class is functional:
                return optim_class
        raise ValueError("Using `ddp_with_overlap=True` requires using a functional optimizer, "
                         "but there is no supported functional optimizer equivalent for "
                         f"{optimizer_class}")

    @staticmethod
    def _check_partition(partition: Any, optimizer_class: Any) -> None:
        if partition not in _PARTITIONS:
            raise ValueError(f"ZeroRedundancyOptimizer: partition must be one of {_PARTITIONS}, "
                             f"got {partition!r}")
        if partition == "balanced" and not is_elementwise(optimizer_class):
            raise ValueError(
                "ZeroRedundancyOptimizer: partition='balanced' splits parameters between ranks, "
                "which only an elementwise update allows (SGD, Adam, AdamW, Adagrad, Adadelta, "
                "Adamax, ASGD, NAdam, RAdam, RMSprop, Rprop); "
                f"{getattr(optimizer_class, '__name__', optimizer_class)} is not one of them: "
                "use partition='sorted_greedy'")

    def _balanced_bucket_view(self) -> bool:
        return (self.partition == "balanced" and self.parameters_as_bucket_view and
                not self._overlap_with_ddp)

    def _get_is_trainable_mask(self) -> List[bool]:
        return [_is_trainable(p) for p in self._all_params]

    def _init_local_optimizer(self) -> None:
        # Groups (not tensors) bypass the optimizer's empty-list check for a rank owning nothing.
        groups = self._partition_parameters()[self.rank]
        optim = self._optim_constructor(groups, **self._optim_defaults)
        if not isinstance(optim, Optimizer):
            raise TypeError("ZeroRedundancyOptimizer: optimizer_class must build a torch.optim."
                            f"Optimizer, but {self._optim_constructor!r} built a "
                            f"{type(optim).__name__}")
        self.optim: Optimizer = optim
        self._sync_param_groups(self.optim.param_groups, self.param_groups)

    def _build_shards(self) -> None:
        """(Re)builds the C++ engine for the current partition and trainability (bucket views are
        rebuilt from the parameters' current values). The engine's parameters are the units."""
        units = self._units
        self._shards = _C.ZeroShards(
            units, list(self._unit_owners), self._unit_trainable(), self.process_group,
            parameters_as_bucket_view=self.parameters_as_bucket_view and not
            self._overlap_with_ddp and self.partition != "balanced",
            bucket_cap_bytes=int(self.bucket_cap_bytes))

    def _unit_trainable(self) -> List[bool]:
        _ = self._units
        return [_is_trainable(p) for p in self._unit_params]

    @property
    def _buckets(self) -> List[List[torch.Tensor]]:
        """torch's name: ``_buckets[d][r]`` is rank r's flat bucket on the d-th device."""
        return self._shards.buckets if self._shards is not None else []

    # ---- partition ------------------------------------------------------------------------

    def _clear_cache(self) -> None:
        self._partition_parameters_cache.clear()
        self._param_to_rank_cache.clear()
        self._index_to_param_cache.clear()
        self._param_to_index_cache.clear()
        self._units_cache.clear()
        self._unit_index_cache.clear()

    def _partition_parameters(self, params_per_rank: Optional[List[List[torch.Tensor]]] = None
                              ) -> List[List[dict]]:
        """Per rank, its parameter groups of units (``ddpx._C.ZeroLayout``): torch's
        sorted-greedy partition, the balanced one, or ``params_per_rank`` (one group only)."""
        if params_per_rank is not None:
            if self.partition == "balanced":
                raise RuntimeError("Specifying `params_per_rank` is not possible with "
                                   "partition='balanced' (it makes its own pieces)")
            if self._partition_parameters_cache:
                raise RuntimeError("Specifying `params_per_rank` should only be done when the "
                                   "parameters have not been partitioned yet")
            if len(self.param_groups) != 1:
                raise RuntimeError("Specifying `params_per_rank` only supports a single "
                                   "parameter group")
            if len(params_per_rank) != self.world_size:
                raise ValueError("`params_per_rank` must have length equal to the world size")
            index = {p: i for i, p in enumerate(self.param_groups[0]["params"])}
            for rank_params in params_per_rank:
                for p in rank_params:
                    if p not in index:
                        raise ValueError("Passing a new parameter in `params_per_rank` that was "
                                         "not passed into the ZeroRedundancyOptimizer constructor")
            self._sync_layout()
            self._layout.assign([[index[p] for p in rank_params]
                                 for rank_params in params_per_rank])
            self._units_cache.clear()
        if not self._partition_parameters_cache:
            units = self._units
            cache: List[List[dict]] = [[] for _ in range(self.world_size)]
            for rank in range(self.world_size):
                for group, local in zip(self.param_groups, self._layout.local_units(rank)):
                    rank_group = copy.copy(group)
                    rank_group["params"] = [units[i] for i in local]
                    cache[rank].append(rank_group)
            self._partition_parameters_cache = cache
        return self._partition_parameters_cache

    def _sync_layout(self) -> None:
        """Gives the layout the parameter groups it does not have yet (construction,
        add_param_group)."""
        for group in self.param_groups[self._layout.num_groups:]:
            self._layout.add_group(group["params"])

    @property
    def _units(self) -> List[torch.Tensor]:
        """What the engine exchanges and the local optimizers step, in global order: the
        parameters, or their pieces under partition='balanced'."""
        if not self._units_cache:
            self._sync_layout()
            layout = self._layout
            units = layout.units
            self._units_cache = units
            self._unit_owners = list(layout.unit_owners)
            self._unit_params = [self._index_to_param[i] for i in layout.unit_params]
            self._pieces = {}
            k = 0
            for i, p in enumerate(self._index_to_param):
                pieces = []
                for b, e, owner in layout.pieces(i):
                    pieces.append((units[k], b, e, owner))
                    k += 1
                self._pieces[p] = pieces
            self._unit_index_cache = {u: i for i, u in enumerate(units)}
        return self._units_cache

    @property
    def _unit_index(self) -> Dict[torch.Tensor, int]:
        _ = self._units
        return self._unit_index_cache

    def _owner_ranges(self, param: torch.Tensor) -> List[tuple]:
        """``param``'s pieces as (begin, end, owner) over its flattened elements: one covering it
        under torch's partition."""
        _ = self._units
        return [(b, e, owner) for _, b, e, owner in self._pieces[param]]

    def _bind_piece_grads(self) -> List[torch.Tensor]:
        """Gives this rank's pieces of split parameters the matching slices of their parameter's
        gradient; returns the pieces, whose ``.grad`` :meth:`_unbind_piece_grads` drops after the
        step."""
        units = self._units
        return [units[i] for i in self._layout.bind_piece_grads()]

    def _unbind_piece_grads(self) -> None:
        self._layout.unbind_piece_grads()

    @property
    def _param_to_rank(self) -> Dict[torch.Tensor, int]:
        """Each parameter's owner (under partition='balanced', the owner of its first piece)."""
        if not self._param_to_rank_cache:
            _ = self._units
            for p in self._index_to_param:
                self._param_to_rank_cache[p] = self._pieces[p][0][3]
        return self._param_to_rank_cache

    @property
    def _param_to_index(self) -> Dict[torch.Tensor, int]:
        if not self._param_to_index_cache:
            self._param_to_index_cache = {
                p: i for i, p in enumerate(chain.from_iterable(g["params"]
                                                               for g in self.param_groups))}
        return self._param_to_index_cache

    @property
    def _index_to_param(self) -> List[torch.Tensor]:
        if not self._index_to_param_cache:
            self._index_to_param_cache = list(
                chain.from_iterable(g["params"] for g in self.param_groups))
        return self._index_to_param_cache

    @staticmethod
    def _sync_param_groups(src_param_groups: List[dict], dst_param_groups: List[dict]) -> None:
        """Copies every option except ``params`` from each source group to its destination."""
        if len(src_param_groups) != len(dst_param_groups):
            raise RuntimeError("Mismatch between number of source and destination parameter "
                               f"groups ({len(src_param_groups)} vs {len(dst_param_groups)})")
        for src, dst in zip(src_param_groups, dst_param_groups):
            for key, value in src.items():
                if key != "params":
                    dst[key] = value

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Adds a parameter group (on every rank: the partition and the exchange are rebuilt).
        Parameters of earlier groups keep their owners, so the local optimizer keeps its state."""
        if self.initialized and self._overlap_with_ddp:
            raise RuntimeError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` only "
                               "supports a single parameter group")
        super().add_param_group(param_group)
        if not self.initialized:
            return
        new_params = self.param_groups[-1]["params"]
        if new_params:
            typename = torch.typename(self._all_params[0])
            for p in new_params:
                if torch.typename(p) != typename or p.layout != torch.strided:
                    self.param_groups.pop()
                    raise ValueError("ZeroRedundancyOptimizer only supports using the same dense "
                                     f"type for all parameters but got both {typename} and "
                                     f"{torch.typename(p)}")
        self._all_params.extend(new_params)
        self._is_trainable_mask = self._get_is_trainable_mask()
        self._clear_cache()
        local_groups = self._partition_parameters()[self.rank]
        if len(local_groups) == len(self.optim.param_groups) + 1:
            self.optim.add_param_group(local_groups[-1])
        self._build_shards()

    # ---- step -----------------------------------------------------------------------------

    def step(self, closure: Optional[Callable[[], float]] = None, **kwargs: Any
             ) -> Optional[float]:
        """This rank's shard of the update, then every parameter's exchange from its owner.
        Extra keyword arguments go to the local optimizer's ``step``. Returns the closure's loss.
        Every rank must call it."""
        if self._overlap_with_ddp:
            logger.warning("`step()` should not be included in the training loop when "
                           "`overlap_with_ddp=True`")
            return None
        Join.notify_join_context(self)
        mask = self._get_is_trainable_mask()
        if mask != self._is_trainable_mask:
            logger.warning("ZeroRedundancyOptimizer detected that the trainable parameters "
                           "changed; rebuilding the parameter buckets if enabled")
            self._shards.rebuild(self._unit_trainable())
            self._is_trainable_mask = mask
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        bound = self._bind_piece_grads()
        try:
            if closure is None and not kwargs and self._fused_step():
                loss = None
            else:
                if closure is None:
                    loss = self.optim.step(**kwargs)
                else:
                    # The closure recomputes the parameters' gradients: the pieces take them.
                    def piece_closure():
                        result = closure()
                        self._bind_piece_grads()
                        return result
                    loss = self.optim.step(closure=piece_closure if bound else closure,
                                           **kwargs)
                self._shards.exchange()
        finally:
            self._unbind_piece_grads()
        self._sync_param_groups(self.optim.param_groups, self.param_groups)
        return loss

    def _fused_step(self, subset: Optional[List[int]] = None) -> bool:
        """The fused update-and-exchange for SGD / Adam / AdamW, and ddpx's step then the exchange
        for the elementwise optimizers (Adadelta, Adagrad, Adamax, RAdam, RMSprop, Rprop). False,
        having done nothing, where the local optimizer's own step must run: another class, an
        option the kernels lack (``fused``, ``capturable``, ``differentiable``, a tensor
        hyper-parameter), a step hook, or tensors they cannot take (dtype, layout, shapes)."""
        optim = self.optim
        if _compat.optimizer_has_step_hooks(optim):
            return False
        if self._default_device.type != "cpu" and not _C.with_cuda:
            return False
        options = []
        for group in optim.param_groups:
            o, _ = cpp_options(type(optim), group)
            if o is None:
                return False
            options.append(o)
        if isinstance(options[0], _C.SGDOptions):
            return self._fused_sgd(options, subset)
        if isinstance(options[0], _C.AdamOptions):
            return self._fused_adam(options, subset)
        if hasattr(options[0], "step_function"):  # an elementwise optimizer's traits
            return self._elementwise_step(options, subset)
        return False

    def _elementwise_step(self, options: list, subset: Optional[List[int]]) -> bool:
        """ddpx's step of an elementwise optimizer (its traits: the options' ``state_names`` and
        ``step_function``) on torch's state, in place, then the exchange. Torch's own step runs
        while any parameter has no state yet, so that the state is made as that torch version
        makes it (its ``step``'s type included, which is kept), and where the C++ step would
        refuse any group's tensors (``<kind>_step_refusal``: dtype, device, layout, shapes),
        asked for every group before any is stepped."""
        optim = self.optim
        step = getattr(_C, type(options[0]).step_function)
        refusal = getattr(_C, type(options[0]).step_function + "_refusal")
        work = []
        for group, o in zip(optim.param_groups, options):
            params = [p for p in group["params"] if p.grad is not None]
            states = [optim.state[p] for p in params]
            if not params:
                continue
            names = o.state_names  # the states this group's options keep (RMSprop: momentum...)
            if any("step" not in st or not all(isinstance(st.get(k), torch.Tensor)
                                               for k in names) for st in states):
                return False
            args = (params, [p.grad for p in params],
                    {k: [st[k] for st in states] for k in names},
                    [int(v.item()) if isinstance(v, torch.Tensor) else int(v)
                     for v in (st["step"] for st in states)])
            if refusal(*args, options=o) is not None:
                return False
            work.append((states, args, o))
        for states, args, o in work:
            old = [st["step"] for st in states]
            # The state tensors (all present: checked above) are updated in place.
            _, counts = step(*args, options=o)
            for st, v, n in zip(states, old, counts):
                if isinstance(v, torch.Tensor):
                    v.fill_(n)
                else:
                    st["step"] = type(v)(n)
        self._shards.exchange(subset)
        return True

    def _fused_sgd(self, options: list, subset: Optional[List[int]]) -> bool:
        state = self.optim.state
        index = self._unit_index
        groups, stepped = [], []
        for group, o in zip(self.optim.param_groups, options):
            params = [p for p in group["params"] if p.grad is not None]
            stepped.append((group, params))
            groups.append(_C.ZeroSGDGroup(
                params=[index[p] for p in params], grads=[p.grad for p in params],
                momentum_buffers=[state[p].get("momentum_buffer") for p in params], options=o))
        if self._shards.step_sgd(groups, subset) is None:
            return False
        store_none = _compat.sgd_stores_none_momentum_buffer()
        for (group, params), g in zip(stepped, groups):
            if group["momentum"] == 0 and not store_none:
                continue
            for p, buf in zip(params, g.momentum_buffers):
                state[p]["momentum_buffer"] = buf
        return True

    def _fused_adam(self, options: list, subset: Optional[List[int]]) -> bool:
        state = self.optim.state
        index = self._unit_index
        groups = []
        for group, o in zip(self.optim.param_groups, options):
            amsgrad = o.amsgrad
            params = [p for p in group["params"] if p.grad is not None]
            states = []
            for p in params:
                s = state[p]
                if len(s) == 0:  # torch's lazy initialisation, in its layout
                    s["step"] = _scalar_step()
                    s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if amsgrad:
                        s["max_exp_avg_sq"] = torch.zeros_like(
                            p, memory_format=torch.preserve_format)
                states.append(s)
            try:
                m1 = [s["exp_avg"] for s in states]
                m2 = [s["exp_avg_sq"] for s in states]
                mx = [s["max_exp_avg_sq"] for s in states] if amsgrad else []
                steps = [s["step"] for s in states]
            except KeyError:  # a state the kernels do not know: the optimizer's own step
                return False
            if not all(isinstance(t, torch.Tensor) for t in steps):
                return False
            groups.append(_C.ZeroAdamGroup(
                params=[index[p] for p in params], grads=[p.grad for p in params], exp_avgs=m1,
                exp_avg_sqs=m2, max_exp_avg_sqs=mx, steps=steps, options=o))
        return self._shards.step_adam(groups, subset) is not None

    def _step_params(self, params: List[torch.Tensor], grads: List[torch.Tensor]) -> None:
        """The overlap with DDP (``ddpx.hooks.hook_with_zero_step*``): steps this rank's share of
        ``params`` (one or more DDP buckets' parameters, the same list on every rank) with
        ``grads`` (their reduced gradients), then exchanges those parameters. Called from the
        comm hook, so the collectives go out in bucket order on every rank."""
        if self._get_is_trainable_mask() != self._is_trainable_mask:
            raise RuntimeError("ZeroRedundancyOptimizer with `overlap_with_ddp=True` does not "
                               "support changing parameter trainability at run time")
        index = self._unit_index
        subset = [index[unit] for p in params for unit, _, _, _ in self._pieces[p]]
        local = [u for group in self.optim.param_groups for u in group["params"]]
        saved = [u.grad for u in local]
        try:
            # The local step sees exactly these gradients: only this rank's units of the
            # bucket's parameters are stepped.
            for u in local:
                u.grad = None
            for p, g in zip(params, grads):
                if not p.requires_grad:
                    continue
                for unit, b, e, owner in self._pieces[p]:
                    if owner != self.rank:
                        continue
                    unit.grad = g.view_as(p) if unit is p else g.reshape(-1)[b:e]
            self._sync_param_groups(self.param_groups, self.optim.param_groups)
            if not self._fused_step(subset):
                self.optim.step()
                self._shards.exchange(subset)
            self._sync_param_groups(self.optim.param_groups, self.param_groups)
        finally:
            for u, g in zip(local, saved):
                u.grad = g

    # ---- Join ----------------------------------------------------------------------------

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that keeps a rank out of inputs stepping and exchanging (no keyword
        arguments are used)."""
        return _ZeROJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._default_device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    # ---- checkpoints ---------------------------------------------------------------------

    def _check_overlap_initialized(self) -> None:
        """torch's check that its delayed ``overlap_with_ddp`` initialisation happened (torch
        waits for DDP's rebuilt buckets before it can partition). ddpx's partition does not
        depend on DDP's buckets, so it is always initialized: checkpoints work from the start."""

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers every rank's shard of the optimizer state to group rank ``to`` (on the CPU), so
        that :meth:`state_dict` works there. Each other rank sends its shard to ``to`` in one
        buffer; no rank but ``to`` receives anything. Every rank must call it."""
        self._check_overlap_initialized()
        if not isinstance(to, int) or not 0 <= to < self.world_size:
            raise ValueError(f"consolidate_state_dict: to={to!r} is not a rank of this group "
                             f"(world size {self.world_size})")
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        local = self.optim.state_dict()
        # reduce_scatter_hook's error-feedback residuals (quantized messages): each rank's own,
        # gathered with its shard and kept by rank in state_dict().
        hook_state = getattr(self, "_reduce_scatter_state", None)
        if hook_state is not None and hook_state.residuals():
            local = dict(local, ddpx_reduce_scatter=hook_state.state_dict())
        self._all_state_dicts = []
        if self.rank == to:
            payload: List[torch.Tensor] = []
        else:
            tensors: List[torch.Tensor] = []
            skeleton = _split_tensors(local, tensors)
            blob = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
            payload = [torch.frombuffer(bytearray(blob), dtype=torch.uint8)] + tensors
        received = self._shards.gather(to, payload, self._comm_device())
        if self.rank != to:
            return
        for rank in range(self.world_size):
            if rank == to:
                self._all_state_dicts.append(_to_cpu(local))
                continue
            blob, *tensors = received[rank]
            skeleton = pickle.loads(blob.cpu().numpy().tobytes())
            self._all_state_dicts.append(_join_tensors(skeleton, [t.cpu() for t in tensors]))

    def _comm_device(self) -> torch.device:
        """Where point-to-point bytes travel: the parameters' device when the group runs it on
        NCCL (any of torch's NCCL classes; GPU tensors only), else the CPU (Gloo's send/recv take
        CPU tensors)."""
        if self._default_device.type == "cpu":
            return self._default_device
        if _compat.is_nccl(self.process_group, self._default_device):
            return self._default_device
        return torch.device("cpu")

    def state_dict(self) -> Dict[str, Any]:
        """The whole optimizer state (global parameter indices) as last consolidated to this
        rank by :meth:`consolidate_state_dict`; RuntimeError on a rank it was not consolidated
        to."""
        self._check_overlap_initialized()
        if not self._all_state_dicts:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant "
                "to save the global state.")
        state_dict = super().state_dict()
        partition = self._partition_parameters()
        index = self._param_to_index
        where = {unit: (param, b, e) for param, pieces in self._pieces.items()
                 for unit, b, e, _ in pieces}
        piece_states: Dict[int, List[tuple]] = {}
        for rank, local in enumerate(self._all_state_dicts):
            local_groups = local["param_groups"]
            global_groups = partition[rank]
            if len(local_groups) != len(global_groups):
                raise RuntimeError(f"the state consolidated from rank {rank} has "
                                   f"{len(local_groups)} parameter groups, the partition "
                                   f"{len(global_groups)}: consolidate again after "
                                   "add_param_group")
            for local_group, global_group in zip(local_groups, global_groups):
                for local_index, unit in zip(local_group["params"], global_group["params"]):
                    if local_index in local["state"]:
                        param, b, e = where[unit]
                        piece_states.setdefault(index[param], []).append(
                            (b, e, local["state"][local_index]))
        for i, items in piece_states.items():
            merged = self._merge_piece_states(self._index_to_param[i], items)
            if merged is not None:
                state_dict["state"][i] = merged
        state_dict["state"] = dict(sorted(state_dict["state"].items()))
        # Copies: a rank's residuals arrived as views of one received buffer, beside state of
        # other dtypes, which torch.save refuses to write as views of one storage.
        residuals = [_map_tensors(local.get("ddpx_reduce_scatter"), torch.clone)
                     for local in self._all_state_dicts]
        if any(r is not None for r in residuals):
            state_dict["ddpx_reduce_scatter"] = residuals
        return state_dict

    def _merge_piece_states(self, param: torch.Tensor, items: List[tuple]) -> Any:
        """One parameter's state in torch's layout from its pieces' states ((begin, end, state)
        from their owners): elementwise tensors (one element per element of the piece) are
        concatenated into the parameter's shape, anything else (the step count, ...) is taken
        from the first piece. None (with a warning) when some piece has no state."""
        pieces = self._pieces[param]
        if len(pieces) == 1:
            return items[0][2]
        if len(items) != len(pieces):
            logger.warning("ZeroRedundancyOptimizer: parameter %d is split between ranks and only "
                           "%d of its %d pieces have optimizer state; its state is left out of "
                           "the state dict", self._param_to_index[param], len(items), len(pieces))
            return None
        items = sorted(items, key=lambda item: item[0])
        first = items[0][2]
        merged = {}
        for key, value in first.items():
            values = [state.get(key) for _, _, state in items]
            if all(isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == e - b
                   for v, (b, e, _) in zip(values, items)):
                merged[key] = torch.cat(values).view(param.shape)
            else:
                merged[key] = value
        return merged

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads this rank's shard of ``state_dict`` (from :meth:`state_dict`, saved at any world
        size) into the local optimizer, as copies, and the groups' options; the caller's dict is
        not modified and nothing of the other ranks' shards is kept."""
        self._check_overlap_initialized()
        if not isinstance(state_dict, dict) or "state" not in state_dict or \
                "param_groups" not in state_dict:
            raise ValueError("ZeroRedundancyOptimizer.load_state_dict expects a dict with 'state' "
                             "and 'param_groups' (from state_dict())")
        # The base class validates the groups and takes their options; the state is loaded here.
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        params = self._index_to_param
        _ = self._units
        for index, value in state_dict["state"].items():
            if not isinstance(index, int) or not 0 <= index < len(params):
                raise ValueError(f"load_state_dict: state index {index!r} does not name one of "
                                 f"this optimizer's {len(params)} parameters")
            param = params[index]
            for unit, b, e, owner in self._pieces[param]:
                if owner == self.rank:
                    piece = None if unit is param else (b, e)
                    self.optim.state[unit] = self._param_state_copy(value, param, piece)
        self._sync_param_groups(state_dict["param_groups"], self.param_groups)
        self._sync_param_groups(self.param_groups, self.optim.param_groups)
        self._load_reduce_scatter_residuals(state_dict.get("ddpx_reduce_scatter"))

    def _load_reduce_scatter_residuals(self, per_rank: Optional[List[Any]]) -> None:
        """This rank's reduce_scatter_hook residuals from a checkpoint's ``"ddpx_reduce_scatter"``
        (one entry per rank of the saving group): loaded now, or when the hook first runs. Saved
        at another world size, they restart from zero (they belong to another partition)."""
        if per_rank is None:
            return
        if len(per_rank) != self.world_size:
            logger.warning(
                "ZeroRedundancyOptimizer.load_state_dict: the reduce_scatter_hook residuals were "
                "saved by %d ranks and this group has %d: they restart from zero",
                len(per_rank), self.world_size)
            return
        entry = per_rank[self.rank]
        if entry is None:
            return
        hook_state = getattr(self, "_reduce_scatter_state", None)
        if hook_state is None:
            self._reduce_scatter_pending = entry
        else:
            hook_state.load_state_dict(entry)

    @staticmethod
    def _param_state_copy(value: Any, param: torch.Tensor, piece: Optional[tuple] = None) -> Any:
        """A parameter's state as the local optimizer keeps it: tensors copied onto the
        parameter's device (floating ones in its dtype, as torch.optim casts them), 0-dim ones
        (``step``) on the CPU, as torch's ZeRO keeps them. With ``piece`` (begin, end), the
        state of that slice of the parameter's flattened elements: tensors of the parameter's
        shape are sliced alike."""
        if not isinstance(value, dict):
            return copy.deepcopy(value)
        out = {}
        for key, v in value.items():
            if isinstance(v, torch.Tensor):
                if piece is not None and v.dim() > 0 and v.shape == param.shape:
                    v = v.reshape(-1)[piece[0]:piece[1]]
                if v.dim() == 0 or key == "step":
                    out[key] = v.detach().to("cpu", copy=True)
                elif v.is_floating_point() and param.is_floating_point():
                    out[key] = v.detach().to(device=param.device, dtype=param.dtype, copy=True)
                else:
                    out[key] = v.detach().to(device=param.device, copy=True)
            else:
                out[key] = copy.deepcopy(v)
        return out
