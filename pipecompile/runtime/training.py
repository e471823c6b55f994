"""What a training loop around a pipeline needs from the runtime, apart from the schedule.

    AutocastState   the caller's `torch.autocast` state, captured when a step starts and
                    re-entered by each device thread around its compute actions (autocast is
                    thread-local: worker threads would otherwise run in float32)
    TiedCopies      copies of a tied parameter on other devices of this process follow their
                    owner after any optimizer updated it (an alias on the owner's device shares
                    its memory; the user's own optimizer sees only the owner,
                    `pipe.parameters()` lists a tied parameter once)
    clip_grad_norm  `torch.nn.utils.clip_grad_norm_` over every stage of every rank: partial
                    norms of this process's gradients, reduced over the pipeline's ranks (data-
                    parallel replicas hold identical reduced gradients), ties counted once

None of these costs anything when unused: no autocast context is entered when autocast is off,
and a tie is copied only when its owner changed (`Tensor._version`, bumped by in-place updates).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch.nn.utils import get_total_norm

from ..errors import ConfigError
from ..ir.tensors import local_tensor

__all__ = ["check_num_items", "AutocastState", "TiedCopies", "clip_grad_norm", "counted_parameters",
           "loss_scale_value", "stepping"]


@dataclass(frozen=True)
class AutocastState:
    """The autocast modes enabled in the calling thread: (device type, dtype) pairs."""

    modes: tuple[tuple[str, torch.dtype], ...]
    cache: bool

    @classmethod
    def current(cls, device_types: Iterable[str]) -> "AutocastState | None":
        """The calling thread's autocast for `device_types`; None when none is enabled."""
        modes = tuple((t, torch.get_autocast_dtype(t)) for t in device_types
                      if torch.is_autocast_enabled(t))
        return cls(modes, torch.is_autocast_cache_enabled()) if modes else None

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the body under these autocast modes (in whichever thread enters it)."""
        with contextlib.ExitStack() as stack:
            for device_type, dtype in self.modes:
                stack.enter_context(torch.autocast(device_type, dtype=dtype,
                                                   cache_enabled=self.cache))
            yield


class TiedCopies:
    """Tied parameters with several tensor objects in this process (stages on different
    devices, or an alias per stage on one): after the owner (the copy `pipe.parameters()`
    lists) was updated in place, by any optimizer, `follow()` copies it into the other copies;
    `route_to_owners()` sends the copies' gradients of a backward the caller runs to it."""

    def __init__(self, program: Any, own_stages: Sequence[int]):
        self.groups: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        for tie in program.ties:
            copies = program.held_copies(tie.names[0], own_stages)
            if len(copies) > 1:
                self.groups.append((copies[0], copies[1:]))
        # never seen: the first call copies, whatever wrote the owner before it (a checkpoint
        # load, init_weights after to_empty, the user)
        self.seen = [-1 for _ in self.groups]

    def follow(self) -> None:
        """Copy each owner that changed since the last call into its copies (an alias of the
        owner's own memory, a second stage's on its device, already sees the change), and
        give the copies the owner's `requires_grad` (the user may freeze it after compile)."""
        for i, (owner, copies) in enumerate(self.groups):
            for copy in copies:
                if copy.requires_grad != owner.requires_grad:
                    copy.requires_grad_(owner.requires_grad)
            if owner._version != self.seen[i]:
                with torch.no_grad():
                    for copy in copies:
                        if not _same_memory(owner, copy):
                            copy.copy_(owner.to(copy.device))
                self.seen[i] = owner._version

    def route_to_owners(self) -> None:
        """Before a forward whose backward the caller runs (`pipe(x)` with autograd on): as
        each copy's gradient accumulates, it moves into its owner's, as autograd accumulates
        a tensor read twice. Inside a step (`stepping`) the copies keep theirs: the step sums
        them in stage order (runtime/stage_steps.py)."""
        for owner, copies in self.groups:
            for copy in copies:
                copy.grad = None  # a step's sum, left with it: the owner holds that gradient
                hooks = copy._post_accumulate_grad_hooks or {}
                if not any(getattr(h, "func", None) is _to_owner for h in hooks.values()):
                    copy.register_post_accumulate_grad_hook(functools.partial(_to_owner, owner))


class _Steps:
    """How many steps run now in this process: each tie's copies then keep their gradients."""

    running = 0
    lock = threading.Lock()


@contextlib.contextmanager
def stepping() -> Iterator[None]:
    """Around a step's schedule: a copy's gradient stays with it, for the step to sum."""
    with _Steps.lock:
        _Steps.running += 1
    try:
        yield
    finally:
        with _Steps.lock:
            _Steps.running -= 1


def _to_owner(owner: torch.Tensor, copy: torch.Tensor) -> None:
    """A tie copy's gradient, just accumulated outside a step, added into its owner's."""
    grad = copy.grad
    if _Steps.running or grad is None:
        return
    copy.grad = None
    with torch.no_grad():
        moved = grad.to(owner.device)
        if owner.grad is None:
            owner.grad = moved
        else:
            owner.grad.add_(moved)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Are `a` and `b` the same real memory (not meta; a DTensor by its local part)?"""
    a, b = local_tensor(a), local_tensor(b)
    return (not a.is_meta and a.device == b.device and a.data_ptr() == b.data_ptr()
            and a.shape == b.shape and a.stride() == b.stride())


def counted_parameters(program: Any, own_stages: Sequence[int]) -> list[torch.Tensor]:
    """The parameters whose gradients this process counts in a global norm: each parameter
    once, by the process holding its first stage's copy (a tie's owner)."""
    counted: dict[int, torch.Tensor] = {}
    for name in program.captured.parameter_names:
        if program.owner_stage(name) in own_stages:
            tensor = program.held_copies(name, own_stages)[0]
            counted[id(tensor)] = tensor
    return list(counted.values())


def clip_grad_norm(counted: Sequence[torch.Tensor], held: Sequence[torch.Tensor],
                   max_norm: float, norm_type: float, *, device: torch.device,
                   group: Any = None, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of `held` (every copy this process holds) so that the global
    `norm_type`-norm of the gradients of `counted` over all processes of `group` (None: this
    process only) is at most `max_norm`; returns that total norm, as
    `torch.nn.utils.clip_grad_norm_` does on the unsplit model."""
    norm_type = float(norm_type)
    grads = [local_tensor(p.grad) for p in counted if p.grad is not None]  # a DTensor's shard
    # in float32 at least: a bf16 norm would depend on how the parameters are split over
    # stages and ranks (torchtitan PR 4312); float64 stays float64
    dtype = torch.promote_types(grads[0].dtype if grads else torch.get_default_dtype(),
                                torch.float32)
    partial = get_total_norm([g.to(dtype) for g in grads], norm_type).to(device)
    if group is not None:  # the global norm: max of the parts, or (sum of p-th powers)^(1/p)
        import torch.distributed as dist

        inf = math.isinf(norm_type)
        part = (partial if inf else partial.pow(norm_type)).reshape(1)
        dist.all_reduce(part, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        partial = part[0] if inf else part[0].pow(1.0 / norm_type)
    total = partial.to(dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise ConfigError(
            f"the total {norm_type}-norm of the gradients is {float(total)}; pass "
            f"error_if_nonfinite=False to clip_grad_norm_ to scale them anyway")
    # a gradient shared by several copies is scaled once; a DTensor's through its shard
    unique = {id(p.grad): local_tensor(p.grad) for p in held if p.grad is not None}
    # torch.nn.utils.clip_grads_with_norm_'s coefficient, applied to the local tensors
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for grad in unique.values():
            grad.mul_(coef.to(grad.device, grad.dtype))
    return total


def loss_scale_value(loss_scale: Any, device: torch.device) -> float | None:
    """The factor a step multiplies its loss by before backward: a number, a 0-dim tensor, or
    a `torch.amp.GradScaler` (its current scale, through `scaler.scale` so that the scaler
    knows it was used this iteration); None or 1 means no scaling."""
    if loss_scale is None:
        return None
    if isinstance(loss_scale, torch.amp.GradScaler):
        loss_scale = loss_scale.scale(torch.ones((), device=device))
    value = float(loss_scale)
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"loss_scale must be a positive finite number, got {value}")
    return None if value == 1.0 else value


def check_num_items(loss_fn: Any, num_items: Any) -> None:
    """`num_items_in_batch` needs a positive count and a loss function that takes it."""
    import inspect

    if loss_fn is None:
        raise ConfigError("num_items_in_batch= is given to loss_fn, but compile got no loss_fn; "
                          "pass loss_fn=lambda out, y, num_items_in_batch: ... to compile")
    count = num_items.item() if isinstance(num_items, torch.Tensor) else num_items
    if isinstance(count, bool) or not isinstance(count, (int, float)) or not count > 0:
        raise ConfigError(f"num_items_in_batch must be a positive count of items (tokens) in "
                          f"the global batch, got {num_items!r}")
    try:
        params = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    if "num_items_in_batch" not in params and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise ConfigError(
            f"num_items_in_batch= is passed to loss_fn as a keyword, but "
            f"{getattr(loss_fn, '__name__', 'loss_fn')}{inspect.signature(loss_fn)} does not "
            f"take it; add a num_items_in_batch parameter (sum the item losses and divide by "
            f"it) or leave num_items_in_batch out")
