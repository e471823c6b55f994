"""Gantt charts of timelines (predicted and measured, one panel each) with matplotlib."""

from __future__ import annotations

from typing import Mapping

from ..errors import require
from ..schedule.actions import Kind
from ..schedule.simulate import Timeline

__all__ = ["plot_timelines"]

# Forward blue, backward green, split backward I/W two shades, optimizer grey.
_COLORS = {Kind.F: "#4C72B0", Kind.B: "#55A868", Kind.I: "#8FBC8F", Kind.W: "#2E8B57",
           Kind.STEP: "#999999"}


def plot_timelines(timelines: Mapping[str, Timeline], path: str, *, title: str = "") -> str:
    """One panel per timeline, one row per device, one bar per compute action; returns path."""
    matplotlib = require("matplotlib", purpose="plotting the timeline")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, squeeze=False,
                             figsize=(12, 1.0 + 0.6 * sum(t.num_devices for t in timelines.values())))
    for ax, (label, timeline) in zip(axes[:, 0], timelines.items()):
        origin = min((e.start for e in timeline.events), default=0.0)
        for e in timeline.events:
            color = _COLORS.get(e.action.kind)
            if color is None or e.end <= e.start:
                continue
            start_ms, width_ms = (e.start - origin) * 1e3, (e.end - e.start) * 1e3
            ax.broken_barh([(start_ms, width_ms)], (e.device - 0.4, 0.8), facecolors=color,
                           edgecolor="white", linewidth=0.5)
            if e.action.microbatch is not None:
                ax.text(start_ms + width_ms / 2, e.device, f"{e.action.kind.value}{e.action.microbatch}",
                        ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(timeline.num_devices))
        ax.set_yticklabels([f"device {d}" for d in range(timeline.num_devices)])
        ax.invert_yaxis()
        ax.set_xlabel("ms")
        ax.set_title(f"{label}: step {timeline.makespan * 1e3:.2f} ms, "
                     f"bubble {timeline.bubble_fraction:.1%}", fontsize=9)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
