"""runtime/distributed_runtime.py: this rank's stages of a torch.distributed job, here one rank
of a one-rank gloo group: it runs the whole pipeline, and its loss and forward match the
model's."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from pipecompile.capture.capture import capture
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import split
from pipecompile.runtime.assemble import assemble
from pipecompile.runtime.distributed import Topology
from pipecompile.runtime.distributed_runtime import DistributedRuntime
from pipecompile.runtime.microbatch import split_microbatches
from pipecompile.runtime.p2p import P2PTransport
from pipecompile.runtime.spec import RuntimeSpec
from pipecompile.schedule.schedules import make_schedule

M = 2


def _mse(out, y):
    return ((out - y) ** 2).mean()


def test_one_rank_runs_every_stage_of_its_pipeline():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    linear = linearize(capture(model, (x,), method="fx"), granularity="layer")
    program = split(linear, (0, linear.num_blocks), ["cpu"])
    schedule = make_schedule("1f1b", 1, M)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        spec = RuntimeSpec(microbatches=M, loss_fn=_mse, topology=Topology(0, 1, 1, 1))
        runtime = assemble(program, schedule, spec)
        assert isinstance(runtime, DistributedRuntime) and runtime.own_stages == (0,)
        assert isinstance(runtime.transport([]), P2PTransport)
        result = runtime.run(schedule, split_microbatches((x,), {}, y, M), batches=1)
        chunks = zip(torch.chunk(x, M), torch.chunk(y, M))
        expected = torch.stack([_mse(model(xc), yc) for xc, yc in chunks]).mean()
        torch.testing.assert_close(result.losses[0], expected, rtol=1e-12, atol=0)
        with torch.no_grad():
            torch.testing.assert_close(runtime.call((x,), {}), model(x), rtol=1e-12, atol=0)
    finally:
        dist.destroy_process_group()
