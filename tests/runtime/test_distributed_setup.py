"""runtime/distributed.py and runtime/data_parallel.py's collective parts on their own
(tests/runtime/test_distributed.py trains whole pipelines; test_topology.py has the rank grid and
the forward-only schedule, test_replica_sync.py the rest of data_parallel): the plan digest, and
in one run on 2 gloo ranks the environment's topology, the plan check, the loss reduction, the
("dp", "pp") mesh check and a replicated stage's gradients averaged over its replicas at the
step's last backward only."""

from __future__ import annotations

import pytest
import torch

from pipecompile.capture.capture import capture
from pipecompile.errors import ConfigError
from pipecompile.passes.linearize import linearize
from pipecompile.passes.split import split
from pipecompile.runtime import data_parallel, distributed
from pipecompile.runtime.distributed import Topology
from pipecompile.schedule.schedules import make_schedule
from tests.distributed.ranks import run_ranks


def _program(bounds, width=6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, 2))
    linear = linearize(capture(model, (torch.randn(8, 4),)), granularity="layer")
    return split(linear, bounds, ["cpu"] * (len(bounds) - 1))


def test_plan_digest_changes_with_cuts_shapes_and_schedule():
    program = _program((0, 1, 3))
    gpipe = make_schedule("gpipe", 2, 2)
    digest = distributed.plan_digest(program, gpipe)
    assert 0 <= digest < 2**63
    assert distributed.plan_digest(_program((0, 1, 3)), make_schedule("gpipe", 2, 2)) == digest
    assert distributed.plan_digest(_program((0, 2, 3)), gpipe) != digest  # another cut
    assert distributed.plan_digest(_program((0, 1, 3), width=5), gpipe) != digest  # a shape
    assert distributed.plan_digest(program, make_schedule("1f1b", 2, 2)) != digest


def _replicas(rank):
    from torch.distributed.device_mesh import init_device_mesh

    result = {}
    topology = Topology(rank, 2, 1, 2)  # P = 1, D = 2: two replicas of one stage
    mesh = data_parallel.data_parallel_mesh(topology, torch.device("cpu"))
    result["mesh"] = (mesh.mesh_dim_names, mesh.mesh.tolist())
    wrong = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))  # replicas as "pp"
    try:
        data_parallel.data_parallel_mesh(topology, torch.device("cpu"), wrong)
        result["wrong"] = None
    except ConfigError as exc:
        result["wrong"] = str(exc)
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    sync = data_parallel.ReplicaSync(module, microbatches=2, group=mesh["dp"].get_group(),
                                     replicas=2)
    sync.begin_step()
    buckets = []
    for mb in range(2):
        torch.manual_seed(10 * rank + mb)  # each replica and micro-batch its own data
        sync.before_backward()
        module(torch.randn(4, 3)).pow(2).sum().backward()
        buckets.append(sync.buckets)
    result["buckets"] = buckets
    result["grads"] = {n: p.grad.clone() for n, p in module.named_parameters()}
    return result


def _expected_grads():
    """The mean over both replicas of their summed micro-batch gradients, computed here."""
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    for rank in range(2):
        for mb in range(2):
            torch.manual_seed(10 * rank + mb)
            (module(torch.randn(4, 3)).pow(2).sum() / 2).backward()
    return {n: p.grad for n, p in module.named_parameters()}


def _on_two_ranks(rank):
    topology = distributed.topology_from_environment(2, 1, timeout=60)
    result = {"topology": topology, "device": str(distributed.local_device())}
    distributed.check_same_plan(1234, torch.device("cpu"))  # equal: passes
    try:
        distributed.check_same_plan(1234 if rank == 0 else 99, torch.device("cpu"))
        result["differ"] = None
    except ConfigError as exc:
        result["differ"] = str(exc)
    try:
        distributed.topology_from_environment(4, 1, timeout=60)
        result["mismatch"] = None
    except ConfigError as exc:
        result["mismatch"] = str(exc)
    # only the last stage's rank has losses: 1.0 and 2.0 (rank 1), none on rank 0
    losses = [torch.tensor(1.0), torch.tensor(2.0)] if rank == 1 else []
    result["mean"] = distributed.reduce_mean_loss(losses, torch.device("cpu"))
    result["sum"] = distributed.reduce_mean_loss(losses, torch.device("cpu"), summed=True)
    result.update(_replicas(rank))
    return result


@pytest.mark.slow
def test_setup_and_reductions_on_two_gloo_ranks():
    results = run_ranks(_on_two_ranks, 2)
    want = _expected_grads()
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r)
        assert r["topology"] == distributed.Topology(rank, 2, 2, 1)
        assert r["device"] == "cpu"
        assert r["differ"] == (
            f"the ranks compiled different pipeline plans (ranks [0]: plan {1234:016x}; ranks "
            f"[1]: plan {99:016x}). Every rank must call compile with the same model, example "
            f"inputs and options (seed the model's initialisation identically, or load the "
            f"same weights)")
        assert r["mismatch"].startswith("the process group has 2 ranks but devices=4 × "
                                        "data_parallel=1 = 4")
        assert r["mean"].item() == 1.5 and r["sum"].item() == 3.0
        # data_parallel: the mesh of 2 replicas of one position, checked; the replicated stage's
        # first micro-batch accumulates locally, the last one's hook all-reduces
        assert r["mesh"] == (("dp", "pp"), [[0], [1]])
        assert r["wrong"].startswith("mesh= places the ranks as [[0], [1]] over ('pp', 'dp'); "
                                     "pipecompile puts rank = replica * 1 + position")
        assert r["buckets"][0] == 0 and r["buckets"][1] >= 1
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, want[name], rtol=1e-6, atol=1e-6, msg=name)
    torch.testing.assert_close(results[0]["grads"]["weight"], results[1]["grads"]["weight"],
                               rtol=0, atol=0)


@pytest.mark.parametrize("local, world, want", [(None, 4, 4), ("2", 4, 2), ("3", 4, 4),
                                                ("0", 4, 4), ("8", 16, 8)])
def test_ranks_per_node_is_torchruns_local_world_size_when_it_divides_the_job(
        monkeypatch, local, world, want):
    """A tensor-parallel group stays inside a node: torchrun's LOCAL_WORLD_SIZE is its size;
    without it (the tests' spawned ranks), or when it does not divide the job, one node."""
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert distributed.ranks_per_node(world) == want
