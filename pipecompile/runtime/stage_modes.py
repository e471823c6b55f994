"""Train and eval mode of the stages this process runs.

Train mode runs the captured (training-mode) stage graphs; eval mode their inference forms
(batch norm reads its running statistics, no dropout), built once on first use by the pass the
`RuntimeSpec` hands in (`eval_graph`) and sharing the same parameter and buffer objects. Under
FSDP the eval graph reads the gathered weights, gathered for it. Each worker is told which
graph to run through `StageWorker.use_module`.

    modes = StageModes(program, workers, spec)
    modes.set(False)                      # every worker runs its stage's eval graph
    with modes.mode(training=True): ...   # then back to the mode before
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch

from ..errors import ConfigError
from ..ir.records import StagedProgram
from .compiled import compile_stage
from .spec import RuntimeSpec
from .stage_worker import StageWorker

__all__ = ["StageModes"]


class StageModes:
    """Which graph each worker runs: its stage's training graph or its eval-mode form."""

    def __init__(self, program: StagedProgram, workers: Mapping[int, StageWorker],
                 spec: RuntimeSpec) -> None:
        self.program, self.workers, self.spec = program, workers, spec
        self.training = True  # False: the workers run the stages' eval-mode graphs
        self._train = {i: w.module for i, w in workers.items()}
        self._eval: dict[int, torch.nn.Module] = {}

    def set(self, training: bool) -> None:
        """Switch every worker to its training graph (`training`) or its eval graph."""
        if training == self.training:
            return
        for index, worker in self.workers.items():
            stage = self.program.stages[index]
            if self.spec.fsdp:  # the eval graph reads the gathered weights, gathered for it
                if training:
                    stage.module.reshard()  # type: ignore[operator]
                else:
                    stage.module.unshard()  # type: ignore[operator]
                    self._eval.pop(index, None)
            worker.use_module(self._train[index] if training else self._eval_module(index))
        self.training = training

    @contextlib.contextmanager
    def mode(self, *, training: bool) -> Iterator[None]:
        """Run the body in train or eval mode, then return to the mode before."""
        before = self.training
        self.set(training)
        try:
            yield
        finally:
            self.set(before)

    def _eval_module(self, index: int) -> Any:
        if index not in self._eval:
            graph = self._eval_graph(self.program.stages[index].module)
            self._eval[index] = (compile_stage(graph, index) if self.spec.compile_stages
                                 else graph)
        return self._eval[index]

    def _eval_graph(self, module: Any) -> torch.fx.GraphModule:
        """The inference form of a stage graph, by the pass the spec hands in."""
        if self.spec.eval_graph is None:
            raise ConfigError("this runtime was assembled without eval-mode stage graphs "
                              "(RuntimeSpec.eval_graph): assemble it with one to run eval()")
        return self.spec.eval_graph(module)
