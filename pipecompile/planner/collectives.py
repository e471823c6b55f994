"""Collectives priced by an alpha-beta model per link level.

A group of n = g x k devices, g on each of k nodes (a data-parallel group as the layout
places it, `layout.Group`), runs NCCL's hierarchical algorithms (ring inside a node over
`intra`, ring between nodes over `inter`, every device using its own NIC as in DGX nodes):

    reduce_scatter(S)  (g-1)/g * S / B_intra + (k-1)/k * S/g / B_inter
                       + (g-1) a_intra + (k-1) a_inter + a_0
    all_gather(S)      the same volumes and steps (S: the gathered, full bytes)
    all_reduce(S)      reduce-scatter + all-gather: twice each term but a_0

a: a link's seconds per ring step (`Link.step_latency`), a_0 the fixed cost of one collective,
both NCCL's own cost model of its ring (src/graph/tuning.cc, Ring / Simple: 8.4 us per
collective, 3.4 us per step over NVLink; planner/hardware.py RING_BASE, RING_STEP).

(Patarasuk and Yuan 2009: a ring moves (n-1)/n of the data per device, bandwidth-optimal;
Thakur et al. 2005 for the alpha-beta form; NCCL's multi-node collectives run the inter-node
phase on S/g per device, one NIC per GPU.) With g = 1 or k = 1 one level remains. Seconds; S
in bytes. Pure.

    >>> from pipecompile.planner.cluster import Link
    >>> nv, ib = Link("nvlink", 360e9, 10e-6, 3.4e-6), Link("infiniband", 40e9, 20e-6)
    >>> round(all_reduce(1e9, Group(8, 1), nv, ib) * 1e3, 3)   # 1 GB in one node of 8
    4.917
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import Link
from .hardware import RING_BASE

__all__ = ["Group", "reduce_scatter", "all_gather", "all_reduce"]


@dataclass(frozen=True)
class Group:
    """The shape of a communicating group: `per_node` of its devices on each of `nodes`."""

    per_node: int
    nodes: int

    @property
    def size(self) -> int:
        return self.per_node * self.nodes


def _ring(nbytes: float, group: Group, intra: Link, inter: Link, passes: int) -> float:
    """Seconds of `passes` ring passes (reduce-scatter, all-gather) over `group`, one
    collective (module docstring)."""
    g, k = group.per_node, group.nodes
    if g * k <= 1 or nbytes <= 0:
        return 0.0
    inside = (g - 1) / g * nbytes / intra.bandwidth + (g - 1) * intra.step_latency
    between = (k - 1) / k * (nbytes / g) / inter.bandwidth + (k - 1) * inter.step_latency
    return passes * (inside + between) + RING_BASE


def reduce_scatter(nbytes: float, group: Group, intra: Link, inter: Link) -> float:
    """Seconds to reduce-scatter `nbytes` (the full tensor) over `group` (module docstring)."""
    return _ring(nbytes, group, intra, inter, 1)


def all_gather(nbytes: float, group: Group, intra: Link, inter: Link) -> float:
    """Seconds to all-gather `nbytes` (the gathered size) over `group`: a reduce-scatter's
    volumes and steps in reverse."""
    return reduce_scatter(nbytes, group, intra, inter)


def all_reduce(nbytes: float, group: Group, intra: Link, inter: Link) -> float:
    """Seconds to all-reduce `nbytes` over `group`: reduce-scatter then all-gather, one
    collective."""
    return _ring(nbytes, group, intra, inter, 2)
