"""data_parallel="auto" under torch.distributed: on 4 gloo ranks every rank passes the global
batch, the search (or the user) picks P x D among 4 x 1, 2 x 2, 1 x 4, and one step equals the
unsplit model on the global batch (float64); bad inputs say what to do. Validating the options
joins no process group (compile's "join" pass does, then "ranks" places this process)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import pipecompile as pc
from pipecompile.planner import ranks_passes
from pipecompile.runtime.data_parallel import replica_microbatches
from tests.distributed.ranks import free_port, run_ranks
from tests.distributed.layout_cases import CASES, TENSOR_CASES, WORLD, batch, model, run_all

# with -n, one worker runs this module (pyproject.toml: loadgroup): its fixture runs once
pytestmark = pytest.mark.xdist_group("layout-torchrun")

FORCED = {"4x1": (4, 1, False), "2x2": (2, 2, False), "1x4 fsdp": (1, 4, True),
          "written": (2, 2, None)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    results = run_ranks(run_all, WORLD)
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r)
    return results


def _reference() -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    net = model()
    x, y = batch()
    out = net(x)
    loss = F.mse_loss(out, y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in net.named_parameters()}, out.detach()


@pytest.mark.parametrize("case", list(CASES))
def test_each_layout_equals_the_unsplit_model_on_the_global_batch(ranks, case):
    loss, grads, out = _reference()
    layouts = {r[case]["layout"] for r in ranks}
    shape = {(lay.pipeline, lay.data_parallel, lay.fsdp) for lay in layouts}
    assert len(shape) == 1, (case, layouts)  # every rank runs the same layout
    seen = set()
    for rank, r in enumerate(ranks):
        got = r[case]
        lay = got["layout"]
        assert lay.pipeline * lay.data_parallel == WORLD
        assert (lay.pipeline_rank, lay.data_rank) == (rank % lay.pipeline, rank // lay.pipeline)
        assert abs(got["loss"] - loss) < 1e-12, (case, rank, got["loss"], loss)
        assert abs(got["eval"] - loss) < 1e-12, (case, rank, got["eval"], loss)
        assert (got["out"] - out).abs().max().item() < 1e-12, (case, rank)
        for name, g in got["grads"].items():
            scale = grads[name].abs().max().item()
            assert (g - grads[name]).abs().max().item() <= 1e-10 * scale, (case, rank, name)
        seen |= set(got["grads"])
        assert f"layout {lay}" in got["repr"]
    assert seen == set(grads)  # the ranks together hold every parameter
    if case in FORCED:
        want = FORCED[case]
        assert (lay.pipeline, lay.data_parallel) == want[:2], case
        assert want[2] is None or lay.fsdp == want[2], case


def test_the_search_costs_every_divisor_and_all_ranks_agree(ranks):
    for case in ("declarative", "auto"):
        tried = [r[case]["tried"] for r in ranks]
        assert all(t == tried[0] for t in tried), case  # rank 0's numbers: the same choice
        degrees = {(p, d) for p, d, _, _ in tried[0]}
        assert degrees == {(4, 1), (2, 2), (1, 4)}, (case, tried[0])
        assert (tried[0][0][0], tried[0][0][1]) == (ranks[0][case]["layout"].pipeline,
                                                    ranks[0][case]["layout"].data_parallel)
    # fsdp="auto" weighs sharded and replicated replicas; the declarative call replicates
    assert {f for _, d, f, _ in ranks[0]["auto"]["tried"] if d > 1} == {True, False}
    assert not any(f for _, _, f, _ in ranks[0]["declarative"]["tried"])


def test_bad_inputs_say_what_to_do_on_every_rank(ranks):
    errors = [r["errors"] for r in ranks]
    assert all(e == errors[0] for e in errors)  # the same error everywhere: nobody waits
    e = errors[0]
    assert "devices=3 pipeline ranks do not divide the 4 ranks" in e["pipeline does not divide"]
    assert "runs on 3 pipeline devices, which does not divide the 4" in e[
        "written schedule does not divide"]
    assert "no layout of 4 devices fits" in e["no layout"]
    assert "global batch has 2 samples, fewer than data_parallel=4" in e["batch smaller than D"]
    assert "global batch of 6 samples does not split into 4 replicas" in e[
        "step: batch not divisible"]
    assert "global batch of 2 samples does not split into 4 replicas" in e[
        "step: batch smaller than D"]
    assert "pass devices=P (the pipeline ranks)" in e["devices list"]
    assert float(e["after"]) > 0


def test_validating_the_options_joins_no_process_group(monkeypatch):
    """A lazy compile under torchrun's environment checks its options without a process
    group (joining would wait for the other ranks: here it would fail after 2 s), the layout
    searched or given."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert ranks_passes.world_size() == 4 and not dist.is_initialized()
    pipe = pc.compile(model(), loss_fn=F.mse_loss, timeout=2)  # plans at the first step
    assert not pipe.planned and not dist.is_initialized()
    with pytest.raises(pc.PipecompileError, match=r"pass devices=P \(the pipeline ranks\)"):
        pc.compile(model(), loss_fn=F.mse_loss, devices=["cpu"] * 4, data_parallel="auto",
                   timeout=2)
    assert not dist.is_initialized()
    # the layout given (devices x data_parallel): validated, nothing joined before planning
    pipe = pc.compile(model(), loss_fn=F.mse_loss, devices=2, data_parallel=2, timeout=2)
    assert not pipe.planned and not dist.is_initialized()
    with pytest.raises(pc.PipecompileError, match=r"the job has 4 ranks but devices=3 × "
                                                  r"data_parallel=1 = 3"):
        pc.compile(model(), loss_fn=F.mse_loss, devices=3, data_parallel=1, timeout=2)
    assert not dist.is_initialized()
    monkeypatch.delenv("WORLD_SIZE")
    assert ranks_passes.world_size() == 1 and "WORLD_SIZE" not in os.environ


def test_the_link_between_ranks_is_fitted_to_the_ring_all_reduce():
    def ring(size):  # 4 ranks, 100 us per message, 1 GB/s: 6 steps, 1.5 x the bytes moved
        return 6 * 100e-6 + 1.5 * size / 1e9

    bandwidth, latency = ranks_passes.fit_link(4, (4, ring(4)), (1 << 20, ring(1 << 20)))
    assert bandwidth == pytest.approx(1e9) and latency == pytest.approx(100e-6)


def test_each_replica_takes_its_rows_of_the_global_batch():
    x, y = batch()
    for replica in range(4):
        mbs = replica_microbatches((x,), {}, y, microbatches=2, replica=replica, replicas=4)
        assert [mb.index for mb in mbs] == [0, 1]
        rows = torch.cat([mb.args[0] for mb in mbs])
        assert torch.equal(rows, x[2 * replica: 2 * replica + 2])
        assert torch.equal(torch.cat([mb.target for mb in mbs]), y[2 * replica: 2 * replica + 2])
    with pytest.raises(pc.PipecompileError, match="does not split into 3 replicas"):
        replica_microbatches((x,), {}, y, microbatches=1, replica=0, replicas=3)


def _tensor_reference(rows: int) -> tuple[float, dict[str, torch.Tensor]]:
    from tests.distributed.tensor_parallel_cases import gpt

    net, (ids,), _, target, loss_fn = gpt()
    loss = loss_fn(net(ids[:rows]), target[:rows])
    loss.backward()
    return loss.item(), {n: p.grad for n, p in net.named_parameters()}


@pytest.mark.parametrize("case", ["tp auto", "tp auto one sequence"])
def test_tensor_parallel_auto_runs_the_searched_layout_exactly(ranks, case):
    """tensor_parallel="auto" on 4 ranks: the search weighs T in {1, 2} (the GPT's 2 heads)
    with P and D, every rank reports the same layout, and the step equals the unsplit model."""
    rows = TENSOR_CASES[case][0]
    loss, grads = _tensor_reference(rows)
    got = [r["tensor"][case] for r in ranks]
    layouts = {(g["layout"].pipeline, g["layout"].data_parallel, g["layout"].tensor_parallel)
               for g in got}
    assert len(layouts) == 1, (case, layouts)  # one layout on every rank
    (p, d, t), = layouts
    assert p * d * t == WORLD and t in (1, 2)
    assert all(g["tried"] == got[0]["tried"] for g in got)
    assert {lt for _, _, lt in got[0]["tried"]} == {1, 2}, got[0]["tried"]  # T was searched
    if case == "tp auto one sequence":  # D = 1: T = 2 halves the matmuls, P = 4 cannot
        assert (p, d, t) == (2, 1, 2) and got[0]["tried"] == [(2, 1, 2), (4, 1, 1)]
        assert "tensor-parallel ranks" in got[0]["explain"]  # the TP lowering ran
    for rank, g in enumerate(got):
        assert abs(g["loss"] - loss) < 1e-10, (case, rank, g["loss"], loss)
        for name, grad in g["grads"].items():
            scale = grads[name].abs().max().item()
            assert (grad - grads[name]).abs().max().item() <= 1e-9 * scale, (case, rank, name)
    assert set().union(*(g["grads"] for g in got)) == set(grads)


def test_tensor_parallel_auto_with_a_fixed_pipeline_is_refused_on_every_rank(ranks):
    errors = [r["tensor"]["errors"]["devices given"] for r in ranks]
    assert all(e == errors[0] for e in errors)
    assert errors[0].startswith("ConfigError: tensor_parallel='auto' under torch.distributed "
                                "searches the whole layout of the 4 ranks"), errors[0]
