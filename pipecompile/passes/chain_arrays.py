"""partition.py's placement DP on arrays: the same placement, bit for bit, 5-20x faster.

    min_max_then_even(problem, tol) -> bounds | None   (None: no placement fits in memory)

`partition` minimises the bottleneck stage time over the cut positions, then among placements
within a relative `tol` of it the sum of squared stage times (passes/partition.py's module
docstring gives the costs). In pure Python each (stage, end cut) scans its first cuts one at
a time; here the costs of every stage over a band of (first, end) cuts are one numpy array of
shape (p, band, n - p + 1), and each stage's step of the DP is one reduction. The band holds,
before each end cut, the first cuts whose blocks' compute alone is within a guess of the
bottleneck; a guess found too low grows (min_max_then_even's docstring says why the result is
the full DP's). Each element is the same IEEE expression as partition.py's `_time_costs`, on
the same prefix sums, in the same order, so the values are those of the Python DP exactly;
ties go to the latest cut as there (the band lists the latest first cut first, and `argmin`
keeps the first). A problem whose arrays would be large returns `NotImplemented` and
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

#: The largest p x band x (n - p + 1) done on arrays (8 MB an array); larger: the Python DP.
MAX_ELEMENTS = 1_000_000


def min_max_then_even(problem: Any, tol: float) -> tuple[int, ...] | None | Any:
    """The bounds of `problem` (a `PartitionProblem`) minimising the bottleneck, then among
    those within `tol` the sum of squared stage times, ties to the latest cut; None when no
    placement fits in memory; `NotImplemented` where the arrays would be too large or numpy
    is missing (the caller runs the Python DP).

    Only the stages whose compute alone is at most a guess G of the bottleneck are costed
    (a band of first cuts before each end cut): a stage outside it costs more than G, so
    where the optimum found is within G (its squares' threshold too), no stage outside the
    band could have been part of it or tied with it, and the result is the full DP's. Else
    G grows until the band holds every cut."""
    n, p = problem.num_blocks, problem.num_stages
    w = n - p + 1  # stage j's end cuts: b = j + 1 + c, c in [0, w)
    if np is None:
        return NotImplemented
    sums = _sums(problem)
    speeds = [d.speed for d in problem.devices]
    guess = 1.5 * max(sums[0][-1] / sum(speeds), max(problem.block_times) / max(speeds))
    guess += 2 * max(d.send_time(x) for d in set(problem.devices) for x in problem.cut_bytes)
    while True:
        height = _height(sums[0], n, guess * 1.01 * max(speeds), w)
        if p * height * w > MAX_ELEMENTS:
            return NotImplemented
        costs = _costs(problem, sums, n, p, w, height)
        best, _ = _dp(costs, n, p, w, height, additive=False, under=None)
        exact = height == w or best * (1 + tol) <= guess
        if exact:
            if best == math.inf:
                return None
            return _dp(costs, n, p, w, height, additive=True, under=best * (1 + tol))[1]
        guess = guess * 4 if guess > 0 else math.inf  # inf: every cut (height w)


def _height(t: Any, n: int, compute: float, w: int) -> int:
    """How many first cuts before an end cut hold at most `compute` of block time (the
    band's height; at most w, every cut)."""
    if not math.isfinite(compute):
        return w
    ends = np.arange(1, n + 1)
    low = np.searchsorted(t, t[ends] - compute, side="left")  # the earliest first cut in it
    return int(min(w, max(1, int((ends - low).max()))))


def _prefix(xs: Sequence[float]) -> Any:
    return np.array(list(accumulate(xs, initial=0.0)), dtype=np.float64)


def _sums(problem: Any) -> tuple[Any, ...]:
    return tuple(_prefix(x) for x in (problem.block_times, problem.static_bytes,
                                      problem.activation_bytes,
                                      problem.forward_times or (0.0,) * problem.num_blocks))


def _costs(problem: Any, sums: tuple[Any, ...], n: int, p: int, w: int, height: int) -> Any:
    """costs[j, r, c]: stage j's time holding blocks [a, b), b = j + 1 + c, a = b - 1 - r
    (the latest first cut first), inf where it does not fit in memory or a < j;
    partition.py's `_time_costs`, element by element."""
    t, s, act, f = sums
    cut = np.array(problem.cut_bytes, dtype=np.float64)
    rows: dict[Any, list[float]] = {}
    for d in problem.devices:
        if d not in rows:
            rows[d] = [d.send_time(x) for x in problem.cut_bytes]
    send = np.array([rows[d] for d in problem.devices], dtype=np.float64)  # [j, cut]
    j = np.arange(p)[:, None, None]
    r = np.arange(height)[None, :, None]
    c = np.arange(w)[None, None, :]
    b = j + 1 + c
    spans = r <= c  # a >= j: the stages before hold a block each
    a = np.maximum(b - 1 - r, 0)
    static, acts, time = s[b] - s[a], act[b] - act[a], t[b] - t[a]
    sends = send[j, a] + send[j, b]
    inflight = np.array(problem.inflight, dtype=np.float64)[:, None, None]
    memory = np.array([d.memory for d in problem.devices], dtype=np.float64)[:, None, None]
    speed = np.array([d.speed for d in problem.devices], dtype=np.float64)[:, None, None]
    modes = problem.recompute or (False,) * p
    plain = np.array([m is not True for m in modes])[:, None, None]  # may run without
    again = np.array([m is not False for m in modes])[:, None, None]  # may recompute
    out = np.full(sends.shape, np.inf)
    if again.any():
        fits = again & (static + inflight * cut[a] + acts <= memory) & spans
        out = np.where(fits, ((time + (f[b] - f[a])) / speed) + sends, out)
    fits = plain & (static + inflight * (acts + cut[a]) <= memory) & spans
    return np.where(fits, time / speed + sends, out)  # without recomputation where it fits


def _dp(costs: Any, n: int, p: int, w: int, height: int, *, additive: bool,
        under: float | None) -> tuple[float, tuple[int, ...] | None]:
    """partition.py's `_chain_dp` over `costs`: the least max (or with `additive`, sum) and
    its bounds; with `under`, each cost c counts as c^2 where c <= under, else inf."""
    if under is not None:
        costs = np.where(costs <= under, costs * costs, np.inf)
    columns = np.arange(w)
    rows = np.arange(height)[:, None]
    before = columns[None, :] - rows + height  # stage j-1's column c - r, shifted past pads
    pad = np.full(height, np.inf)
    best = np.where(columns < height, costs[0, np.minimum(columns, height - 1), columns],
                    np.inf)  # stage 0 starts at cut 0: r = c
    parents = []
    for j in range(1, p):
        prev = np.concatenate((pad, best))[before]
        value = prev + costs[j] if additive else np.maximum(prev, costs[j])
        r = value.argmin(axis=0)  # the first of equal values: the latest cut
        best = value[r, columns]
        parents.append(r)
    last = float(best[w - 1])
    if last == math.inf:
        return math.inf, None
    bounds, column = [n], w - 1
    for j in range(p - 1, 0, -1):
        column -= int(parents[j - 1][column])  # a = j + c - r: stage j-1's column a - j
        bounds.append(j + column)
    return last, (0, *reversed(bounds))
