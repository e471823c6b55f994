"""Counting a step's saved activations as it runs (the report over them is
`outputs/memory_report.py`).

Saved activations are counted by a `torch.autograd.graph.saved_tensors_hooks` pack hook around
each stage's forward (`SavedActivations`): it records the byte span of every tensor autograd
saves for backward, without copying or holding it. A micro-batch's spans are merged per storage
(a tensor saved twice, or as views, counts once; parameters and buffers are excluded) when its
forward ends; the stage holds those bytes until its backward (zero-bubble: its W) frees them.
The hook costs about 9 % of a small GPT's one-stage gpipe step (163 vs 149 ms),
so a forward whose layout was counted before (`record(..., layout=key)`: the same graph, input
shapes and strides, autocast and trainable parameters) reuses that count without the hook; the
stage graphs are static, so the count is the same. `pipe.memory_stats()` always describes the
last step without a mode to switch on first.

On CUDA the allocator's peak statistics are reset once per step (`step_started`).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import torch


__all__ = ["SavedActivations", "inputs_layout", "storage_keys", "step_started"]

_MAX_LAYOUTS = 64  # layouts whose counts one stage keeps
_ORDER = itertools.count()  # orders the events of stages that share a device (one thread)
_Span = tuple[int, int, int, int]  # (storage key, start byte, end byte, storage bytes)


def _spans(tensors: Iterable[Any], exclude: frozenset[int]) -> list[_Span]:
    """Byte spans of the tensors' storages that `tensors` cover (excluded storages skipped)."""
    spans = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            continue
        numel, size = t.numel(), t.element_size()
        try:
            storage = t.untyped_storage()
            key, total = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # no storage (e.g. a tensor subclass)
            spans.append((id(t), 0, numel * size, numel * size))
            continue
        if key in exclude or not numel:
            continue
        start = int(t.storage_offset()) * size
        if t.is_contiguous():
            extent = numel
        else:  # the last element's offset + 1 (a transpose, a slice with gaps, an expand)
            extent = 1 + sum((int(n) - 1) * abs(int(s)) for n, s in zip(t.shape, t.stride()))
        spans.append((key, start, min(total, start + extent * size), total))
    return spans


def _union_bytes(spans: Iterable[_Span]) -> int:
    """Bytes covered by `spans`, each storage's overlapping spans merged."""
    by_storage: dict[int, list[tuple[int, int]]] = {}
    for key, start, end, _ in spans:
        by_storage.setdefault(key, []).append((start, end))
    covered = 0
    for intervals in by_storage.values():
        reach = -1
        for start, end in sorted(intervals):
            start = max(start, reach)
            if end > start:
                covered += end - start
            reach = max(reach, end)
    return covered


def storage_keys(tensors: Iterable[Any]) -> frozenset[int]:
    """The storages of `tensors`, as what `SavedActivations` excludes (parameters, buffers)."""
    keys = set()
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            with contextlib.suppress(RuntimeError, NotImplementedError):
                keys.add(t.untyped_storage().data_ptr())
    return frozenset(keys)


@dataclass
class SavedActivations:
    """The bytes one stage keeps for backward: per micro-batch held, and their peak sum.

    `record(mb, exclude)` counts what autograd saves inside it; `hold(mb, tensors)` counts
    tensors kept by the stage itself (a checkpointed forward's inputs); `release(mb)` frees a
    micro-batch. `events` (order, change) lets stages that share a device combine their peaks.
    """

    held: dict[int, int] = field(default_factory=dict)  # micro-batch -> bytes held now
    spans: dict[int, list[_Span]] = field(default_factory=dict)  # micro-batch -> what it holds
    microbatch: dict[int, int] = field(default_factory=dict)  # most each micro-batch held
    peak: int = 0  # the most bytes held at once since `reset`
    events: list[tuple[int, int]] = field(default_factory=list)
    counted: dict[Any, int] = field(default_factory=dict)  # layout key -> bytes its forward saves

    def reset(self) -> None:
        """Start a step: nothing held, no peak."""
        self.held.clear()
        self.spans.clear()
        self.microbatch.clear()
        self.events.clear()
        self.peak = 0

    @contextlib.contextmanager
    def record(self, mb: int, excluded: frozenset[int], layout: Any = None) -> Iterator[None]:
        """Add to micro-batch `mb` what autograd saves for backward in the body, except the
        storages `excluded` (parameters and buffers: `storage_keys`). With a `layout` key (a
        fresh micro-batch whose body saves the same tensors whenever the key is the same),
        the bytes are counted on the key's first body and reused after."""
        known = self.known(layout)
        if known is not None:
            yield
            self.add_known(mb, known)
            return
        spans: list[_Span] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            spans.extend(_spans((t,), excluded))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield
        if layout is not None and len(self.counted) < _MAX_LAYOUTS:  # bounded: a scalar
            self.counted[layout] = _union_bytes(spans)  # input may differ on every step
        self._add(mb, spans)

    def known(self, layout: Any) -> int | None:
        """The bytes a forward of `layout` saves, if one was counted (see `record`)."""
        return self.counted.get(layout) if layout is not None else None

    def add_known(self, mb: int, nbytes: int) -> None:
        """Micro-batch `mb` holds `nbytes` counted before under its layout (`known`)."""
        self._add(mb, [(-1 - mb, 0, nbytes, nbytes)])  # a span of its own: not merged

    def hold(self, mb: int, tensors: Iterable[Any], excluded: frozenset[int] = frozenset()
             ) -> None:
        """Add tensors the stage keeps itself for micro-batch `mb` (storages counted once)."""
        self._add(mb, _spans(tensors, excluded))

    def release(self, mb: int) -> None:
        """Micro-batch `mb`'s backward is done: its saved tensors are freed."""
        self.spans.pop(mb, None)
        freed = self.held.pop(mb, 0)
        if freed:
            self.events.append((next(_ORDER), -freed))

    def _add(self, mb: int, spans: list[_Span]) -> None:
        # a micro-batch's spans are merged together: a checkpointed stage's kept input is
        # saved again by the recomputed forward, and is one tensor
        self.spans.setdefault(mb, []).extend(spans)
        before = self.held.get(mb, 0)
        self.held[mb] = _union_bytes(self.spans[mb])
        self.microbatch[mb] = max(self.microbatch.get(mb, 0), self.held[mb])
        self.peak = max(self.peak, sum(self.held.values()))
        self.events.append((next(_ORDER), self.held[mb] - before))


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


_resets: dict[str, int] = {}  # accelerator device -> the step its peak statistics began
_resets_lock = threading.Lock()


def step_started(devices: Iterable[torch.device], step: int) -> None:
    """Reset the allocator's peak statistics of each CUDA device in `devices` once per step
    (the first stage on a device to begin step `step` does it)."""
    for device in devices:
        if device.type != "cuda":
            continue
        with _resets_lock:
            if _resets.get(str(device)) == step:
                continue
            _resets[str(device)] = step
        torch.cuda.reset_peak_memory_stats(device)


_SCALARS = (int, float, bool, str, type(None))


def _value_layout(value: Any) -> Any:
    """What decides the tensors a graph saves for `value`: a tensor's shape, strides, dtype,
    device and whether it needs a gradient; a scalar itself. None: no simple layout."""
    if isinstance(value, torch.Tensor):
        return (value.shape, value.stride(), value.dtype, value.device, value.requires_grad)
    if isinstance(value, _SCALARS):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        parts = tuple(_value_layout(v) for v in value)
        return None if None in parts else (type(value), parts)
    return None


def inputs_layout(inputs: Mapping[str, Any], target: Any) -> Any:
    """The per-forward part of a layout key (`StageCall.layout`: what `SavedActivations.record`
    reuses a count by): each input's layout, the inputs that share a storage, and the target's
    layout; None when one is not plain."""
    values = []
    storages: dict[int, int] = {}
    for name, value in inputs.items():
        layout = _value_layout(value)
        if layout is None:
            return None
        if isinstance(value, torch.Tensor):
            shared = storages.setdefault(value.untyped_storage().data_ptr(), len(storages))
            layout = (*layout, shared)
        values.append((name, layout))
    aim = _value_layout(target)
    if aim is None and target is not None:
        return None
    return (tuple(values), aim, torch.is_grad_enabled())
