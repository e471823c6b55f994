"""Named accelerators for planning on hardware that is not here: datasheet figures, and the
fraction of them a training step sustains.

    preset("h100")                        -> DeviceSpec(name="cuda", memory=80e9, flops=..., ...)
    preset("A100", link="infiniband")     -> the A100 80GB SXM behind an InfiniBand HCA

A preset is an *absolute* `DeviceSpec`: compile plans for it analytically (block time = FLOPs
at the sustained rate of the model's dtype + bytes at the sustained memory bandwidth + a fixed
cost per op), prices a message at bytes / link bandwidth + latency and charges a fixed cost per
pipeline action, measuring nothing on this machine. The figures (docs/hardware.md has the
table and the reasoning):

    peak        NVIDIA datasheets, dense (the datasheets' tensor-core figures are "with
                sparsity", twice the dense rate): H100 SXM5 BF16 989.4 TFLOP/s, FP32 66.9;
                A100 SXM4 BF16 312, FP32 19.5. HBM: H100 80 GB at 3.35 TB/s, A100 80 GB at
                2.039 TB/s. NVLink per direction: H100 450 GB/s (900 both ways), A100 300 GB/s
                (600). InfiniBand per GPU: H100 NDR 400 Gb/s = 50 GB/s (ConnectX-7), A100 HDR
                200 Gb/s = 25 GB/s (ConnectX-6), as in DGX H100 / DGX A100.
    sustained   per kernel, as the device runs it, from published kernel measurements
                (passes/kernel_prices.py holds every constant, CHIPS; docs/hardware.md the
                sources): GEMMs by tile and wave quantisation under a ceiling (A100: the MAMF
                finder's best cuBLAS GEMM, 0.859 of peak, times 0.887, the typical-over-best ratio
                measured on an H200: 0.761; H100 and H200: 0.71, the median of
                published layers' GEMMs measured on an H200), fused attention by sequence,
                causal mask and head dimension (A100: FlashAttention-2, forward up to 0.73 of
                peak, backward 0.63; H100 and H200: torch's default, cuDNN's, measured at 0.54
                and 0.49), memory-bound kernels at 0.62 of HBM bandwidth (eager kernels as
                FlashAttention's Figure 2 measured them on the A100; the H200's GELU,
                LayerNorm and dropout: 0.52-0.68), at least 4 us per kernel (7 us on the H100,
                measured); links at LINK_EFFICIENCY = 0.8 (nccl-tests reach 0.8-0.9). A spec's
                `flops` is the GEMM ceiling's rate.
    memory      the datasheet's 80 GB as 80e9 bytes: the devices report about 85.5e9 (81,559
                MiB on an H100, 81,920 MiB on an A100); the difference is left for the CUDA
                context, NCCL buffers and allocator fragmentation.
    latency     LATENCY per message: 10 us on NVLink, 20 us over InfiniBand (the order of
                nccl-tests' small-message send/recv times; an assumption, not a datasheet); a
                ring collective's steps as NCCL's own cost model prices them (RING_BASE,
                RING_STEP: 8.4 us per collective and 3.4 us per step over NVLink).
    overheads   OP_OVERHEAD = 4 us, the shortest a kernel lasts (CHIPS' `launch`) and ACTION_OVERHEAD = 50 us per pipeline action or message (Python
                dispatch, autograd set-up, an NCCL call): assumptions for a GPU runtime, used in
                place of `measure.rates.action_overhead`, which would time this machine.

This module is pure: it imports neither torch nor a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import ConfigError
from ..ir.devices import DeviceSpec
from ..passes.kernel_prices import CHIPS, Chip

__all__ = ["describe_devices", "Accelerator", "ACCELERATORS", "preset", "accelerator_of", "MEMORY_EFFICIENCY",
           "LINK_EFFICIENCY", "LATENCY", "RING_BASE", "RING_STEP", "OP_OVERHEAD",
           "ACTION_OVERHEAD"]

# the kernel-level constants (GEMM ceiling, attention, HBM fraction, launch) live in one
# place, passes/kernel_prices.CHIPS; these are their spec-level views
MEMORY_EFFICIENCY = CHIPS["h100"].memory_efficiency  # sustained / peak HBM bandwidth
LINK_EFFICIENCY = 0.8  # sustained / peak link bandwidth, per direction
LATENCY = {"nvlink": 10e-6, "infiniband": 20e-6}  # seconds per message
#: NCCL's own cost model of a ring collective (src/graph/tuning.cc, `baseLat` and `hwLat`,
#: Ring / Simple protocol): a fixed RING_BASE per collective plus RING_STEP per ring step over
#: NVLink inside a node; a link not named here prices a step at its LATENCY (InfiniBand: NCCL
#: gives 9.6 us a step, x 1.9 for a multi-node all-reduce, 18 us: the 20 us kept)
RING_BASE = 8.4e-6
RING_STEP = {"nvlink": 3.4e-6}
OP_OVERHEAD = CHIPS["h100"].launch  # seconds a kernel lasts at least on a GPU
ACTION_OVERHEAD = 50e-6  # seconds per pipeline action or message on a GPU runtime

TERA = 1e12
GIGA = 1e9


@dataclass(frozen=True)
class Accelerator:
    """Datasheet figures of one accelerator (peak, dense; bytes and bytes/s)."""

    title: str
    peak_flops: tuple[tuple[str, float], ...]  # by torch dtype name; the first is the default
    memory: float
    memory_bandwidth: float
    links: tuple[tuple[str, float], ...]  # bytes/s per direction, by link name
    matmul: float = 0.75  # sustained / peak FLOP/s of the best GEMM (the chip's ceiling)
    attention: float = 0.5  # sustained / peak FLOP/s of fused attention, forward + backward
    chip: Chip | None = None  # kernel-level figures: every kernel priced by its shape

    def peak(self, dtype: str | None = None) -> float:
        """Dense peak FLOP/s in `dtype` (the first listed, bfloat16, when not listed)."""
        return dict(self.peak_flops).get(dtype or "", self.peak_flops[0][1])

    def spec(self, *, efficiency: float | None = None, link: str = "nvlink",
             device: str = "cuda") -> DeviceSpec:
        """The `DeviceSpec` of this accelerator whose matmuls sustain `efficiency` of its peak
        FLOP/s (None: its `matmul` fraction), sending over `link`, as torch device `device`."""
        efficiency = self.matmul if efficiency is None else efficiency
        if not 0 < efficiency <= 1:
            raise ConfigError(f"efficiency must be in (0, 1] (sustained / peak FLOP/s), "
                              f"got {efficiency}")
        links = dict(self.links)
        if link not in links:
            raise ConfigError(f"{self.title} has no link {link!r}; use one of "
                              f"{', '.join(links)}")
        rates = tuple((dtype, efficiency * peak) for dtype, peak in self.peak_flops)
        return DeviceSpec(
            name=device, memory=self.memory, bandwidth=LINK_EFFICIENCY * links[link],
            flops=rates[0][1], latency=LATENCY[link],
            memory_bandwidth=(self.chip.memory_efficiency if self.chip else MEMORY_EFFICIENCY)
            * self.memory_bandwidth,
            op_overhead=self.chip.launch if self.chip else OP_OVERHEAD, action_overhead=ACTION_OVERHEAD,
            hardware=f"{self.title} ({efficiency:.3g} of peak, {link})", dtype_flops=rates)

    def link(self, name: str) -> float:
        """Sustained bytes/s per direction of link `name` ("nvlink", "infiniband")."""
        links = dict(self.links)
        if name not in links:
            raise ConfigError(f"{self.title} has no link {name!r}; use one of "
                              f"{', '.join(links)}")
        return LINK_EFFICIENCY * links[name]


def _of_chip(chip: Chip, links: tuple[tuple[str, float], ...], memory: float = 80 * GIGA
             ) -> Accelerator:
    """The accelerator of `chip`: its datasheet figures, its best GEMM as the matmul rate and
    fused attention forward + backward (2.5x the forward's FLOPs) as one fraction."""
    fused = 3.5 / (1 / chip.attention.forward + 2.5 / chip.attention.backward)
    return Accelerator(title=chip.title, peak_flops=chip.peak_flops, memory=memory,
                       memory_bandwidth=chip.memory_bandwidth, links=links,
                       matmul=chip.ceiling, attention=fused, chip=chip)


ACCELERATORS: dict[str, Accelerator] = {
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5 column (dense = half the sparse figure);
    # one ConnectX-7 NDR 400 Gb/s per GPU (DGX H100)
    "h100": _of_chip(CHIPS["h100"], (("nvlink", 450 * GIGA), ("infiniband", 50 * GIGA))),
    # NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM column; ConnectX-6 HDR 200 Gb/s
    "a100": _of_chip(CHIPS["a100"], (("nvlink", 300 * GIGA), ("infiniband", 25 * GIGA))),
    # NVIDIA H200 datasheet, SXM column: 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; an HGX
    # H200 node has one 400 Gb/s NIC per GPU as the DGX H100
    "h200": _of_chip(CHIPS["h200"], (("nvlink", 450 * GIGA), ("infiniband", 50 * GIGA)),
                     memory=141 * GIGA),
}

_NOISE = ("nvidia", "sxm5", "sxm4", "sxm", "141gb", "80gb", "tensorcore", "gpu")


def preset(name: str, *, efficiency: float | None = None, link: str = "nvlink",
           device: str = "cuda") -> DeviceSpec:
    """The `DeviceSpec` of a named accelerator: "h100", "h200" or "a100" (any case; "H100 80GB
    SXM", "a100-sxm4-80gb", "NVIDIA H200" too). `efficiency`: sustained / peak FLOP/s; `link`: "nvlink" (within a
    node) or "infiniband" (across nodes); `device`: the torch device its stages run on when
    this machine has it ("cuda" is numbered per pipeline device when enough GPUs are here).
    `efficiency`: sustained / peak FLOP/s of the best GEMM (None: the accelerator's own,
    0.71 for the H100 and H200 (measured on an H200: the median GEMM of published runs'
    layers), 0.761 for the A100 (the MAMF finder's best cuBLAS GEMM, 0.859, times that
    typical-over-best ratio, 0.887)).

    Sources (dense peaks; the datasheets' tensor-core figures are "with sparsity", 2x dense):
    NVIDIA H100 datasheet, SXM5: BF16/FP16 989.4 TFLOP/s, FP32 66.9, 80 GB HBM3 at 3.35 TB/s,
    NVLink 900 GB/s (450 per direction); NVIDIA A100 datasheet, 80GB SXM: BF16/FP16 312,
    FP32 19.5, 80 GB HBM2e at 2.039 TB/s, NVLink 600 GB/s (300 per direction); DGX H100 / A100:
    one ConnectX-7 NDR 400 Gb/s (50 GB/s) / ConnectX-6 HDR 200 Gb/s (25 GB/s) per GPU.
    Kernel constants (passes/kernel_prices.CHIPS): the GEMM ceiling, fused attention's
    efficiencies, 0.62 of HBM bandwidth, 4 us (H100: 7 us) per kernel at least; assumed: 0.8 of link
    bandwidth, 10/20 us per NVLink/InfiniBand message, 50 us per pipeline action (the module
    docstring and docs/hardware.md give the sources and reasons)."""
    return _accelerator(name).spec(efficiency=efficiency, link=link, device=device)


def _accelerator(name: str) -> Accelerator:
    key = "".join(ch for ch in name.lower() if ch.isalnum())
    for noise in _NOISE:
        key = key.replace(noise, "")
    if key not in ACCELERATORS:
        raise ConfigError(f"no device preset named {name!r}; presets: "
                          f"{', '.join(ACCELERATORS)} (or give DeviceSpec(flops=..., "
                          f"memory=..., bandwidth=..., latency=...) yourself)")
    return ACCELERATORS[key]


def accelerator_of(spec: DeviceSpec) -> Accelerator | None:
    """The preset `spec` was made from (by its `hardware` title), None for another spec: its
    dense peak is what MFU divides by, its attention fraction what fused attention runs at."""
    for accelerator in ACCELERATORS.values():
        if spec.hardware.startswith(accelerator.title + " ("):
            return accelerator
    return None


def describe_devices(specs: Sequence[DeviceSpec], dtype: str | None) -> str:
    """What analytic costs assume about absolute devices, for `explain()`: "costs analytic for
    32 x NVIDIA H100 80GB SXM (...): bfloat16 at 494.7 TFLOP/s, ...; nothing measured here"."""
    kinds: dict[str, int] = {}
    for s in specs:
        kinds[s.hardware or s.name] = kinds.get(s.hardware or s.name, 0) + 1
    first = specs[0]
    figures = [f"{dtype or 'default dtype'} at {first.rate(dtype) / 1e12:.1f} TFLOP/s"]
    if first.memory_bandwidth is not None:
        figures.append(f"memory {first.memory_bandwidth / 1e9:.0f} GB/s")
    figures.append(f"link {first.bandwidth / 1e9:.0f} GB/s + {first.latency * 1e6:g} us/message")
    if first.action_overhead is not None:
        figures.append(f"{first.action_overhead * 1e6:g} us/action")
    return (f"costs analytic for {', '.join(f'{n} x {k}' for k, n in kinds.items())}: "
            f"{', '.join(figures)}{' (the first device)' if len(kinds) > 1 else ''}; nothing "
            f"measured on this machine")
