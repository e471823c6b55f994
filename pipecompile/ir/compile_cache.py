"""One explicit, bounded cache of what compiling measures or derives, keyed by content.

Compiling measures this machine (the matmul rate, the cost of one pipeline action, the planning
probe) and derives symbolic block costs on fake tensors: seconds each. A `CompileCache` keeps
those results so that compiling one model again (another schedule, a lazy re-plan, a benchmark
grid) reuses them. Its keys are what a result depends on, never object identities: the graph's
code and shapes (`digest`), the tensors' shapes and dtypes (`layout`), a loss function's
qualified name and code (`function_key`). So what `compile` returns depends on its arguments
and on the cache it is given, not on what the process compiled before with another cache.

    cache = CompileCache(maxsize=16)
    pc.compile(model, (x,), devices=2, cache=cache)   # measures
    pc.compile(model, (x,), devices=2, cache=cache)   # reuses the measurements
    cache.clear()

`compile` uses `default_cache` unless given another; `cache=None` caches nothing.
"""

from __future__ import annotations

import hashlib
import types
from collections import OrderedDict
from typing import Any, Callable, Hashable, TypeVar

import torch

__all__ = ["CompileCache", "default_cache", "digest", "layout", "function_key"]

T = TypeVar("T")


class CompileCache:
    """At most `maxsize` results, the least recently used dropped first; `hits` and `misses`
    count the lookups (a miss computed the result). Apart from them, at most `captures`
    captured graphs (none by default), reused for a structurally identical model
    (capture/reuse.py); `capture_hits` counts the reuses."""

    def __init__(self, maxsize: int = 64, captures: int = 0) -> None:
        if maxsize < 1:
            raise ValueError(f"a CompileCache holds at least one entry, got maxsize={maxsize}")
        if captures < 0:
            raise ValueError(f"a CompileCache keeps 0 or more captures, got captures={captures}")
        self.maxsize = maxsize
        self.captures = captures
        self.hits = 0
        self.misses = 0
        self.capture_hits = 0
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._captures: OrderedDict[Hashable, Any] = OrderedDict()

    def kept_capture(self, key: Hashable) -> Any:
        """The capture template kept under `key`, or None."""
        if key not in self._captures:
            return None
        self.capture_hits += 1
        self._captures.move_to_end(key)
        return self._captures[key]

    def keep_capture(self, key: Hashable, template: Any) -> None:
        """Keep a capture template (the oldest goes past `captures` entries)."""
        self._captures[key] = template
        while len(self._captures) > self.captures:
            self._captures.popitem(last=False)

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        """The result stored under `key`, or `compute()`'s, stored (the oldest entry goes when
        the cache is full)."""
        if key in self._entries:
            self.hits += 1
            self._entries.move_to_end(key)
            return self._entries[key]
        self.misses += 1
        value = compute()
        self._entries[key] = value
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        """Forget every result and capture (the next compile measures again)."""
        self._entries.clear()
        self._captures.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __repr__(self) -> str:
        return (f"CompileCache({len(self)}/{self.maxsize} entries, {self.hits} hits, "
                f"{self.misses} misses, {len(self._captures)}/{self.captures} captures)")


default_cache = CompileCache()  # what `pipecompile.compile` uses unless given `cache=`


def digest(*parts: Any) -> str:
    """A short content hash of `parts` (strings, numbers, nested tuples: their repr)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def layout(value: Any) -> tuple:
    """Shapes and dtypes of the tensors in `value`, in order (what a timing depends on)."""
    leaves = torch.utils._pytree.tree_leaves(value)
    return tuple((tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor)
                 else type(x).__name__ for x in leaves)


def function_key(fn: Any) -> tuple | None:
    """What identifies a function by content: its qualified name and a hash of its code
    (constants included); a callable object by its type and repr. None for None."""
    if fn is None:
        return None
    code = getattr(fn, "__code__", None)
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
    if code is not None:
        return (name, digest(_code(code)))
    return (f"{type(fn).__module__}.{type(fn).__qualname__}", repr(fn))


def _code(code: types.CodeType) -> tuple:
    """A code object's content: its bytecode, names and constants (nested code too)."""
    consts = tuple(_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return (code.co_code, code.co_names, consts)
