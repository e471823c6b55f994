"""calibrate: correct the block costs by the stages' measured times (`measure/stages.py`).

`profile` times every block alone; a stage in a pipeline costs more than the sum of its blocks.
`fit_calibration` finds one factor for every block's time (the median of the stages'
measured / predicted ratios) and takes the loss's time, measured alone on the last stage;
`calibrate_blocks` applies them to a cost table (of any granularity). The compiler re-plans on
the calibrated costs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from ..ir.records import CostTable, StageTimes

__all__ = ["Calibration", "fit_calibration", "calibrate_blocks"]


@dataclass(frozen=True)
class Calibration:
    """How measured stages differ from the sum of their blocks: a time factor for every block,
    and the loss's seconds per micro-batch, charged to the last block."""

    factor: float = 1.0
    loss_time: float = 0.0
    microbatch_size: int = 0  # the size the loss was timed at (0: the size it is applied to)
    loss_timed: bool = True  # False: no target at compile, so the loss was not run (time 0)

    def __str__(self) -> str:
        if not self.loss_timed:
            return (f"block times x{self.factor:.2f}, loss not timed (no target at compile: "
                    f"compile lazily or pass example_target=)")
        return f"block times x{self.factor:.2f}, loss {self.loss_time * 1e3:.3f} ms/mb"

    def at(self, microbatch_size: int) -> "Calibration":
        """This calibration for micro-batches of `microbatch_size`: the loss's time scales with
        the rows it reduces."""
        if not self.microbatch_size or microbatch_size == self.microbatch_size:
            return self
        return replace(self, loss_time=self.loss_time * microbatch_size / self.microbatch_size,
                       microbatch_size=microbatch_size)


def fit_calibration(
    costs: CostTable, bounds: Sequence[int], measured: Mapping[int, StageTimes], *,
    loss_timed: bool = True,
) -> Calibration:
    """The factor is the median over the stages of measured / predicted F+B (the loss's own
    measured time left out); the loss is measured directly on the last stage (`loss_timed`
    False: it was not run, for want of a target)."""
    predicted = [sum(costs.blocks[b].time for b in range(lo, hi))
                 for lo, hi in zip(bounds, bounds[1:])]
    loss = measured[len(predicted) - 1].loss
    actual = [measured[s].forward + measured[s].backward - measured[s].loss
              for s in range(len(predicted))]
    ratios = [a / p for a, p in zip(actual, predicted) if p > 0]
    return Calibration(statistics.median(ratios) if ratios else 1.0, loss, loss_timed=loss_timed)


def calibrate_blocks(costs: CostTable, calibration: Calibration) -> CostTable:
    """`costs` with every block time scaled and the loss added to the last block."""
    blocks = []
    last = len(costs.blocks) - 1
    for i, b in enumerate(costs.blocks):
        extra = calibration.loss_time if i == last else 0.0
        # the loss runs in forward and starts the backward: charge it to F and I evenly
        blocks.append(replace(
            b,
            forward_time=b.forward_time * calibration.factor + extra / 2,
            backward_input_time=b.backward_input_time * calibration.factor + extra / 2,
            backward_weight_time=b.backward_weight_time * calibration.factor,
        ))
    return replace(costs, blocks=tuple(blocks),
                   notes=(*costs.notes, f"calibrated by the measured stages: {calibration}"))
