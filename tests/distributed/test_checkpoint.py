"""torch.distributed.checkpoint: a 2-rank pipeline's checkpoint (original parameter names)
loads into the unsplit model and resumes a 4-rank pipeline whose next step is the unsplit
model's; get_state_dict/set_state_dict round trip in one process."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import pipecompile as pc
from tests.distributed.cases import plan_case
from tests.distributed.ranks import run_ranks
from tests.distributed.checkpoint_cases import OPTIONS, optimizer, resume, train_and_save
from tests.support.models import CASES
from tests.support.reference import reference_step


def _close(got, want, name):
    scale = want.abs().max().item() or 1.0
    err = (got - want).abs().max().item() / scale
    assert err <= 1e-10, f"{name}: differs by {err:.3e} relative"


# with -n, one worker runs this module (pyproject.toml: loadgroup): its fixture runs once
pytestmark = pytest.mark.xdist_group("checkpoint")


@pytest.fixture(scope="module")
def reference():
    """The unsplit model's losses and its state after each of 3 AdamW steps."""
    torch.manual_seed(0)
    case = CASES["gpt"]()
    model = copy.deepcopy(case.model)
    opt = optimizer(model.parameters())
    losses, states = [], []
    for _ in range(3):
        loss, _ = reference_step(model, case.args, {}, case.target, case.loss_fn, 2)
        opt.step()
        losses.append(loss)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, states


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-rank pipeline's checkpoint after 2 AdamW steps."""
    directory = str(tmp_path_factory.mktemp("dcp"))
    results = run_ranks(train_and_save, 2, directory,
                        warm=functools.partial(plan_case, "gpt", 2, 1, 2))
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r)
    return directory, results


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_two_rank_checkpoint_loads_into_the_unsplit_model(checkpoint, reference):
    directory, results = checkpoint
    losses, states = reference
    for r in results:
        for got, want in zip(r["losses"], losses):
            _close(got, want, "loss")
    fresh = CASES["gpt"]().model
    assert set(results[0]["keys"]) | set(results[1]["keys"]) == set(fresh.state_dict())
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=directory, no_dist=True)  # one process, no process group
    fresh.load_state_dict(state["model"])
    assert fresh.lm_head.weight is fresh.wte.weight
    for name, tensor in fresh.state_dict().items():
        _close(tensor, states[1][name], name)


@pytest.mark.slow
def test_checkpoint_resumes_on_four_ranks(checkpoint, reference):
    directory, _ = checkpoint
    losses, states = reference
    results = run_ranks(resume, 4, directory, 4, warm=functools.partial(plan_case, "gpt", 4, 1, 2))
    seen = set()
    for rank, r in enumerate(results):
        assert "error" not in r and "died" not in r, (rank, r)
        _close(r["loss"], losses[2], "loss")
        for name, p in r["params"].items():
            _close(p, states[2][name], name)
            seen.add(name)
    assert seen == {n for n, _ in CASES["gpt"]().model.named_parameters()}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_state_dict_round_trip_in_one_process(tmp_path):
    """No torch.distributed: a trained pipeline and its AdamW go through dcp.save/dcp.load into
    a fresh pipeline, whose next step equals the original's. (Without the files in between,
    set_state_dict would share the optimizer state's tensors between the two optimizers.)"""
    torch.manual_seed(0)
    case = CASES["gpt"]()

    def build():
        pipe = pc.compile(copy.deepcopy(case.model), case.args, devices=2, microbatches=2,
                          loss_fn=case.loss_fn, schedule="1f1b")
        return pipe, optimizer(pipe.parameters())

    pipe, opt = build()
    for _ in range(2):
        pipe.step(*case.args, target=case.target)
        opt.step()
        opt.zero_grad()
    model_sd, optim_sd = get_state_dict(pipe, opt, options=OPTIONS)
    assert set(model_sd) == set(case.model.state_dict())
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path, no_dist=True)
    other, other_opt = build()
    model_sd, optim_sd = get_state_dict(other, other_opt, options=OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=tmp_path, no_dist=True)
    set_state_dict(other, other_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=OPTIONS)
    for p, q in ((pipe, opt), (other, other_opt)):
        p.step(*case.args, target=case.target)
        q.step()
    want = dict(pipe.named_parameters())
    # float64 to 1e-10 like every equivalence test: the device threads add a tied weight's
    # gradient contributions in either order, so the last bit may differ between two pipelines
    for name, tensor in other.named_parameters():
        torch.testing.assert_close(tensor, want[name], rtol=1e-10, atol=1e-12, msg=name)
