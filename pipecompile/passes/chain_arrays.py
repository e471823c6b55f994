"""partition.py's placement DP on arrays: the same placement, bit for bit, about 3-6x faster.

    min_max_then_even(problem, tol) -> bounds | None   (None: no placement fits in memory)

`partition` minimises the bottleneck stage time over the cut positions, then among placements
within a relative `tol` of it the sum of squared stage times (passes/partition.py's module
docstring gives the costs). In pure Python each (stage, end cut) scans its first cuts one at
a time; here every stage's costs over its window of (first, end) cuts are one numpy array of
shape (p, n - p + 1, n - p + 1), and each stage's step of the DP is one reduction. Each
element is the same IEEE expression as partition.py's `_time_costs`, on the same prefix sums,
in the same order, so the values are those of the Python DP exactly; ties go to the latest
cut as there (the first cuts are laid out latest first, and `argmin` keeps the first). A
problem whose arrays would be large (many blocks and stages) returns `NotImplemented` and
partition.py runs its Python DP; so does a Python without numpy.
"""

from __future__ import annotations

import math
from itertools import accumulate
from typing import Any, Sequence

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy comes with torch in every supported install
    np = None  # type: ignore[assignment]

__all__ = ["min_max_then_even", "MAX_ELEMENTS"]

#: The largest p x (n - p + 1)^2 done on arrays (about 8 MB an array); larger: the Python DP.
MAX_ELEMENTS = 1_000_000


def min_max_then_even(problem: Any, tol: float) -> tuple[int, ...] | None | Any:
    """The bounds of `problem` (a `PartitionProblem`) minimising the bottleneck, then among
    those within `tol` the sum of squared stage times, ties to the latest cut; None when no
    placement fits in memory; `NotImplemented` where the arrays would be too large or numpy
    is missing (the caller runs the Python DP)."""
    n, p = problem.num_blocks, problem.num_stages
    w = n - p + 1  # each stage's cuts: first in [j, j + w), end in [j + 1, j + 1 + w)
    if np is None or p * w * w > MAX_ELEMENTS:
        return NotImplemented
    costs = _costs(problem, n, p, w)
    best, _ = _dp(costs, n, p, w, additive=False, under=None)
    if best == math.inf:
        return None
    return _dp(costs, n, p, w, additive=True, under=best * (1 + tol))[1]


def _prefix(xs: Sequence[float]) -> Any:
    return np.array(list(accumulate(xs, initial=0.0)), dtype=np.float64)


def _costs(problem: Any, n: int, p: int, w: int) -> Any:
    """costs[j, r, c]: stage j's time holding blocks [a, b), a = j + w - 1 - r (latest first),
    b = j + 1 + c (the last stage: b = n), inf where it does not fit in memory or a >= b;
    partition.py's `_time_costs`, element by element."""
    t, s, act = (_prefix(x) for x in (problem.block_times, problem.static_bytes,
                                      problem.activation_bytes))
    cut = np.array(problem.cut_bytes, dtype=np.float64)
    rows: dict[Any, list[float]] = {}
    for d in problem.devices:
        if d not in rows:
            rows[d] = [d.send_time(x) for x in problem.cut_bytes]
    send = np.array([rows[d] for d in problem.devices], dtype=np.float64)  # [j, cut]
    j = np.arange(p)[:, None, None]
    a = j + (w - 1) - np.arange(w)[None, :, None]  # latest first cut first
    b = np.broadcast_to(j + 1 + np.arange(w)[None, None, :], (p, 1, w)).copy()
    b[p - 1] = n  # the last stage ends at the model's output
    spans = a < b
    static, acts, time = s[b] - s[a], act[b] - act[a], t[b] - t[a]
    sends = send[j, a] + send[j, b]
    inflight = np.array(problem.inflight, dtype=np.float64)[:, None, None]
    memory = np.array([d.memory for d in problem.devices], dtype=np.float64)[:, None, None]
    speed = np.array([d.speed for d in problem.devices], dtype=np.float64)[:, None, None]
    modes = problem.recompute or (False,) * p
    plain = np.array([m is not True for m in modes])[:, None, None]  # may run without
    again = np.array([m is not False for m in modes])[:, None, None]  # may recompute
    out = np.full(np.broadcast_shapes(time.shape, sends.shape), np.inf)
    if again.any():
        f = _prefix(problem.forward_times or (0.0,) * n)
        fits = again & (static + inflight * cut[a] + acts <= memory) & spans
        out = np.where(fits, ((time + (f[b] - f[a])) / speed) + sends, out)
    fits = plain & (static + inflight * (acts + cut[a]) <= memory) & spans
    return np.where(fits, time / speed + sends, out)  # without recomputation where it fits


def _dp(costs: Any, n: int, p: int, w: int, *, additive: bool, under: float | None
        ) -> tuple[float, tuple[int, ...] | None]:
    """partition.py's `_chain_dp` over `costs`: the least max (or with `additive`, sum) and
    its bounds; with `under`, each cost c counts as c^2 where c <= under, else inf."""
    if under is not None:
        costs = np.where(costs <= under, costs * costs, np.inf)
    columns = np.arange(w)
    best = costs[0, w - 1, :]  # stage 0 starts at cut 0: its row of a = 0
    parents = []
    for j in range(1, p):
        # stage j's first cut a = j + w - 1 - r is stage j-1's end cut, its column w - 1 - r
        before = best[::-1][:, None]
        value = before + costs[j] if additive else np.maximum(before, costs[j])
        r = value.argmin(axis=0)  # the first of equal values: the latest cut
        best = value[r, columns]
        parents.append(r)
    last = float(best[w - 1])
    if last == math.inf:
        return math.inf, None
    bounds, column = [n], w - 1
    for j in range(p - 1, 0, -1):
        a = j + (w - 1) - int(parents[j - 1][column])
        bounds.append(a)
        column = a - j  # stage j-1 ends at a: its column a - (j - 1) - 1
    return last, (0, *reversed(bounds))
