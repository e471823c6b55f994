"""Pictures of a partition: the blocks in model order, coloured by stage, each cut marked with
the values that cross it and their size per micro-batch.

    pipe.draw("partition.svg")          # or .png; graphviz if `dot` is installed, else matplotlib
    draw_partition(program, "partition.svg", microbatches=4)     # the same, from plan data
    partition_dot(program, microbatches=4)                       # the graphviz source, as text

matplotlib layout (one row per block, top to bottom):

    stage 0   | 0 transformer.wte        |
    cpu       | 1 transformer.h.0        |
    1.2M par. | 2 transformer.h.1        |
    ----------+--------------------------+-- cut 0: 1 value, 4.0 KiB/mb  add_11 f32[batch,8,64]
    stage 1   | 3 transformer.h.2        |
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .cuts import cuts
from ..errors import ConfigError, require
from ..ir.records import Stage, StagedProgram
from ..ir.formats import format_bytes
from ..ir.formats import format_count

__all__ = ["draw_partition", "partition_dot"]

_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3",
           "#8C8C8C", "#CCB974", "#64B5CD")
_FORMATS = (".svg", ".png")


def draw_partition(program: StagedProgram, path: str, *, microbatches: int,
                   backend: str = "auto") -> str:
    """Write the partition drawing of `program` to `path` (.svg or .png); returns `path`.
    Cut sizes are for one micro-batch of the example batch split `microbatches` ways.

    `backend` is "graphviz" (needs the `dot` program), "matplotlib", or "auto" (graphviz when
    `dot` is on the PATH, else matplotlib)."""
    suffix = Path(path).suffix.lower()
    if suffix not in _FORMATS:
        raise ConfigError(f"cannot draw to {path!r}: use a file name ending in "
                          f"{' or '.join(_FORMATS)}")
    if backend == "auto":
        backend = "graphviz" if shutil.which("dot") else "matplotlib"
    if backend == "graphviz":
        dot = shutil.which("dot")
        if dot is None:
            raise ConfigError("backend='graphviz' needs graphviz's `dot` program on the PATH; "
                              "install graphviz or use backend='matplotlib'")
        subprocess.run([dot, f"-T{suffix[1:]}", "-o", str(path)], input=partition_dot(program, microbatches=microbatches),
                       text=True, check=True, capture_output=True)
        return str(path)
    if backend == "matplotlib":
        return _draw_matplotlib(program, str(path), microbatches)
    raise ConfigError(f"backend={backend!r} is unknown; use 'auto', 'graphviz' or 'matplotlib'")


def partition_dot(program: StagedProgram, *, microbatches: int) -> str:
    """Graphviz source: one cluster per stage, one box per block, cut edges labelled."""
    blocks = program.linear.blocks
    lines = ["digraph partition {", '  rankdir=TB; node [shape=box, style="rounded,filled", '
             'fontname="Helvetica", fontcolor=white]; edge [fontname="Helvetica"];']
    for stage in program.stages:
        color = _COLORS[stage.index % len(_COLORS)]
        lines.append(f'  subgraph cluster_{stage.index} {{ label="{_stage_label(stage, " | ")}"; '
                     f'color="{color}";')
        for b in stage.blocks:
            lines.append(f'    b{b} [label="{b}  {_escape(blocks[b].name)}", fillcolor="{color}"];')
        lines.append("  }")
    cut_after = {c.after_block: c for c in cuts(program, microbatches=microbatches)}
    for b in range(len(blocks) - 1):
        cut = cut_after.get(b)
        if cut is None:
            lines.append(f"  b{b} -> b{b + 1};")
        else:
            label = _escape(_cut_label(cut, "\\n"))
            lines.append(f'  b{b} -> b{b + 1} [color=red, penwidth=2, fontcolor=red, '
                         f'label="{label}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------


def _stage_label(stage: Stage, sep: str) -> str:
    parts = [f"stage {stage.index}", str(stage.device)]
    if stage.cost is not None:
        parts += [f"{format_count(stage.cost.params)} params",
                  f"{(stage.cost.forward_time + stage.cost.backward_time) * 1e3:.2f} ms/mb F+B"]
    return sep.join(parts)


def _cut_label(cut, sep: str, *, limit: int = 4) -> str:
    head = (f"cut {cut.index}: {len(cut.values)} value{'s' if len(cut.values) != 1 else ''}, "
            f"{format_bytes(cut.nbytes)}/mb")
    shown = [f"{v!r} -> stage {','.join(map(str, v.consumers))}" for v in cut.values[:limit]]
    if len(cut.values) > limit:
        shown.append(f"... {len(cut.values) - limit} more")
    return sep.join([head, *shown])


def _escape(text: str) -> str:
    return text.replace('"', '\\"')


def _draw_matplotlib(program: StagedProgram, path: str, microbatches: int) -> str:
    matplotlib = require("matplotlib", purpose="drawing the partition")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    blocks = program.linear.blocks
    n = len(blocks)
    fontsize = 9 if n <= 40 else max(4, 9 - n // 40)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.32 * n))
    for stage in program.stages:
        color = _COLORS[stage.index % len(_COLORS)]
        first, last = stage.blocks[0], stage.blocks[-1]
        for b in stage.blocks:
            ax.add_patch(Rectangle((0.25, b + 0.06), 0.33, 0.88, facecolor=color,
                                   edgecolor="white"))
            ax.text(0.26, b + 0.5, f"{b}  {blocks[b].name}", va="center", ha="left",
                    fontsize=fontsize, color="white", clip_on=True)
        ax.add_patch(Rectangle((0.005, first + 0.06), 0.235, last - first + 0.88,
                               facecolor=color, alpha=0.25, edgecolor=color))
        ax.text(0.012, (first + last + 1) / 2, _stage_label(stage, "\n"), va="center",
                ha="left", fontsize=fontsize)
    for cut in cuts(program, microbatches=microbatches):
        y = cut.after_block + 1
        ax.plot([0.0, 0.6], [y, y], color="red", linewidth=2)
        ax.text(0.61, y, _cut_label(cut, "\n", limit=3), va="center", ha="left",
                fontsize=fontsize - 1, color="red")
    ax.set_xlim(0, 1)
    ax.set_ylim(n, 0)
    ax.axis("off")
    mb = program.captured.microbatch_size(microbatches)
    ax.set_title(f"{program.num_stages} stages, {n} blocks; cut sizes per micro-batch of {mb}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
