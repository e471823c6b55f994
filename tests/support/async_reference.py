"""A step-by-step reference of the asynchronous schedules' semantics (the issue's formulas).

Stage s owns the parameters listed for it. Micro-batch j of a call (or stream), with U updates
made before it, runs its forward and backward with, on every stage s, the weights after

    pipedream:                U + max(0, j - p + s + 1) updates of stage s
    pipedream, vertical sync: U + max(0, j - p + 1)
    2bw:                      max(0, U + j // m - 1)            (gradients averaged per batch)

and every update applies, with the stage's own optimizer, that gradient to its newest weights.
"""

from __future__ import annotations

import torch


class AsyncReference:
    def __init__(self, model, stage_names, optimizer, *, schedule, microbatches,
                 vertical_sync=False):
        self.model = model
        self.names = stage_names
        self.p = len(stage_names)
        self.m = microbatches
        self.schedule = schedule
        self.vertical_sync = vertical_sync
        params = dict(model.named_parameters())
        self.live = [{n: params[n].detach().clone().requires_grad_(True) for n in names}
                     for names in stage_names]
        self.optimizers = [optimizer(list(live.values())) for live in self.live]
        self.versions = [{0: self._clone(live)} for live in self.live]
        self.updates = 0  # the same on every stage

    @staticmethod
    def _clone(live):
        return {n: t.detach().clone() for n, t in live.items()}

    def version(self, s, base, j):
        if self.schedule == "2bw":
            return max(0, base + j // self.m - 1)
        behind = self.p - 1 if self.vertical_sync else self.p - s - 1
        return base + max(0, j - behind)

    def run(self, microbatches, loss_fn):
        """One call or stream: a list of (args, kwargs, target) micro-batches; returns losses."""
        base = self.updates
        scale = 1.0 / self.m if self.schedule == "2bw" else 1.0
        pending = [{} for _ in range(self.p)]
        losses = []
        for j, (args, kwargs, target) in enumerate(microbatches):
            weights = {}
            for s in range(self.p):
                weights.update(self.versions[s][self.version(s, base, j)])
            leaves = {n: t.clone().requires_grad_(True) for n, t in weights.items()}
            out = torch.func.functional_call(self.model, leaves, args, kwargs)
            loss = loss_fn(out, target)
            losses.append(loss.detach())
            grads = torch.autograd.grad(loss * scale, list(leaves.values()), allow_unused=True)
            grad_of = dict(zip(leaves, grads))
            for s in range(self.p):
                for n in self.names[s]:
                    g = grad_of[n]
                    if g is not None:
                        pending[s][n] = g if n not in pending[s] else pending[s][n] + g
            if self.schedule == "pipedream" or j % self.m == self.m - 1:
                self.updates += 1
                for s in range(self.p):
                    for n, t in self.live[s].items():
                        t.grad = pending[s].get(n)
                    self.optimizers[s].step()
                    self.versions[s][self.updates] = self._clone(self.live[s])
                pending = [{} for _ in range(self.p)]
        return losses

    def parameters(self):
        return {n: t for live in self.live for n, t in live.items()}
