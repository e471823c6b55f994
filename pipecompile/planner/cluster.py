"""A cluster of absent accelerators: nodes of devices joined by two link levels.

    cluster("h100", nodes=8, per_node=8)   -> Cluster: 64 `DeviceSpec`s, NVLink inside a node
                                              (450 GB/s per direction, 10 us a message, 3.4 us
                                              a ring step: NCCL's model), InfiniBand between
                                              nodes (50 GB/s per GPU, 20 us), each at 0.8 sustained

A `Cluster` is a sequence of its devices, so `compile(..., devices=cluster)` reads it like a
list of specs; the planner also reads its `intra` and `inter` links (`Link`: sustained bytes/s
per direction per device, seconds per message) to place pipeline neighbours and data-parallel
groups (layout.py) and to price their collectives (collectives.py). Device i is on node
i // per_node. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Sequence, overload

from ..errors import ConfigError
from .hardware import LATENCY, RING_STEP, _accelerator
from ..ir.devices import DeviceSpec

__all__ = ["Link", "Cluster", "cluster", "is_cluster"]


@dataclass(frozen=True)
class Link:
    """One level of the interconnect: sustained bytes/s per direction per device, the
    seconds one message costs on top, and those one step of a ring collective costs (`step`;
    None: `latency`)."""

    name: str
    bandwidth: float
    latency: float
    step: float | None = None

    @property
    def step_latency(self) -> float:
        """Seconds one step of a ring collective costs over this link."""
        return self.latency if self.step is None else self.step

    def send(self, nbytes: float) -> float:
        """Seconds to move `nbytes` from one device to another over this link."""
        return 0.0 if nbytes <= 0 else nbytes / self.bandwidth + self.latency


@dataclass(frozen=True)
class Cluster(Sequence[DeviceSpec]):
    """`nodes` x `per_node` identical devices: `device` (its link set to `intra`, the link a
    pipeline neighbour in the same node uses), `intra` inside a node, `inter` between nodes."""

    device: DeviceSpec
    nodes: int
    per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        for name in ("nodes", "per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"cluster: {name} must be a positive int, got {value!r}")

    @overload
    def __getitem__(self, index: int) -> DeviceSpec: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[DeviceSpec]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.device] * len(range(*index.indices(len(self))))
        if not -len(self) <= index < len(self):
            raise IndexError(f"cluster device {index} out of range ({len(self)} devices)")
        return self.device

    def __len__(self) -> int:
        return self.nodes * self.per_node

    def __iter__(self) -> Iterator[DeviceSpec]:
        return iter([self.device] * len(self))

    def node_of(self, device: int) -> int:
        """The node of device `device` (devices are numbered node by node)."""
        return device // self.per_node

    def link(self, a: int, b: int) -> Link:
        """The link between devices `a` and `b`: `intra` on one node, else `inter`."""
        return self.intra if self.node_of(a) == self.node_of(b) else self.inter

    def spec_sending(self, link: Link) -> DeviceSpec:
        """The device spec whose messages go over `link` (what a pipeline stage sends over)."""
        return replace(self.device, bandwidth=link.bandwidth, latency=link.latency)

    def __str__(self) -> str:
        return (f"{self.nodes} x {self.per_node} {self.device.hardware or self.device.name} "
                f"({self.intra.name} {self.intra.bandwidth / 1e9:.0f} GB/s inside a node, "
                f"{self.inter.name} {self.inter.bandwidth / 1e9:.0f} GB/s per device between)")


def cluster(name: str, *, nodes: int = 1, per_node: int = 8, intra: str = "nvlink",
            inter: str = "infiniband", efficiency: float | None = None) -> Cluster:
    """`nodes` nodes of `per_node` accelerators of preset `name` ("h100", "a100"), `intra`
    links inside a node and `inter` between nodes (one NIC per device, as in DGX H100/A100).
    An unknown preset or link is a `ConfigError` naming those that exist."""
    accelerator = _accelerator(name)
    links = (Link(intra, accelerator.link(intra), LATENCY[intra], RING_STEP.get(intra)),
             Link(inter, accelerator.link(inter), LATENCY[inter], RING_STEP.get(inter)))
    device = accelerator.spec(efficiency=efficiency, link=intra)
    return Cluster(device, nodes, per_node, *links)


def is_cluster(devices: object) -> bool:
    """Whether `devices` (compile's argument) is a `Cluster`."""
    return isinstance(devices, Cluster)
