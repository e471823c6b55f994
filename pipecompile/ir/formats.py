"""The number formats every report and error message uses: bytes, counts, stage lists."""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["format_bytes", "format_count", "format_stages"]


def format_count(x: float, unit: str = "") -> str:
    """1234567 -> '1.23M' (decimal prefixes, for parameters and FLOPs)."""
    for factor, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f}{suffix}{unit}"
    return f"{x:.0f}{unit}"


def format_stages(stages: Sequence[int], *, limit: int = 8) -> str:
    """[0, 2, 3] as a list; more than `limit` as runs: [0-26, 28, 30-31]."""
    if len(stages) <= limit:
        return str(list(stages))
    runs: list[list[int]] = []
    for s in stages:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return "[" + ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) + "]"


def format_bytes(num: float) -> str:
    """Binary prefixes, two decimals, rounded up so the text never understates a requirement;
    every report (memory errors, stage tables, cut values) prints bytes this way.

    >>> format_bytes(4096), format_bytes(2**30 + 1), format_bytes(100)
    ('4.00 KiB', '1.01 GiB', '100 B')
    """
    if not math.isfinite(num):
        return str(num)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= scale:
            return f"{math.ceil(num / scale * 100) / 100:.2f} {unit}"
    return f"{math.ceil(num)} B"
