"""Pipeline is an nn.Module: the model's names over this process's stage tensors; a loaded
pipeline keeps everything compile produced (simulate, explain, timeline)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import pipecompile as pc
from pipecompile.compiler import compile as compile_model
from pipecompile.pipeline import Pipeline
from pipecompile import zoo
from tests.support.models import CASES
from tests.support.reference import reference_step


def _gpt_pipe(**options):
    torch.manual_seed(0)
    case = CASES["gpt"]()  # float64, wte.weight tied to lm_head.weight
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, devices=3, microbatches=2, loss_fn=case.loss_fn,
                      **options)
    return case, reference, pipe


def test_names_order_and_state_are_the_models():
    case, reference, pipe = _gpt_pipe()
    assert isinstance(pipe, nn.Module) and isinstance(pipe, Pipeline)
    assert pc.compile is compile_model
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert "lm_head.weight" not in dict(pipe.named_parameters())  # tied: once, first name
    assert pipe.get_parameter("lm_head.weight") is pipe.get_parameter("wte.weight")
    want = reference.state_dict()
    got = pipe.state_dict()
    assert list(got) == list(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    assert [n for n, _ in pipe.named_buffers()] == [n for n, _ in reference.named_buffers()]
    # the stage graphs are not registered: no stage-prefixed names, no GraphModule children
    assert not any(isinstance(m, fx.GraphModule) for m in pipe.modules())
    assert {n for n, _ in pipe.named_modules()} <= {n for n, _ in reference.named_modules()}


def test_registered_tensors_are_the_ones_the_stages_train():
    case, _, pipe = _gpt_pipe()
    stage_tensors = {id(t) for s in pipe.program.stages for t in s.module.parameters()}
    assert {id(p) for p in pipe.parameters()} <= stage_tensors


def test_user_optimizer_over_pipe_parameters_matches_the_unsplit_model():
    case, reference, pipe = _gpt_pipe()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        loss = pipe.step(*case.args, target=case.target)
        opt.step()
        ref_loss, _ = reference_step(reference, case.args, {}, case.target, case.loss_fn, 2)
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    want = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=1e-12, atol=1e-14, msg=name)


def test_load_state_dict_round_trips_and_reports_bad_keys():
    case, reference, pipe = _gpt_pipe()
    fresh = {k: torch.randn_like(v) for k, v in reference.state_dict().items()}
    fresh["lm_head.weight"] = fresh["wte.weight"]  # a tied pair holds one value
    result = pipe.load_state_dict(fresh)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, fresh[key]), key
    for copies in pipe.program.tensors.values():  # every copy, on every stage
        for _, tensor in copies:
            name = next(n for n, c in pipe.program.tensors.items() if c is copies)
            assert torch.equal(tensor, fresh[name]), name
    with pytest.raises(pc.ConfigError, match="missing keys"):
        pipe.load_state_dict({"wte.weight": fresh["wte.weight"]})


class _Clashing(nn.Module):
    """Submodules named like Pipeline's API."""

    def __init__(self):
        super().__init__()
        self.step = nn.Linear(4, 4)
        self.stages = nn.Linear(4, 4)

    def forward(self, x):
        return self.stages(torch.relu(self.step(x)))


def test_model_names_never_clash_with_the_pipeline_api():
    model = _Clashing().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2,
                      loss_fn=lambda out, y: ((out - y) ** 2).mean())
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert len(pipe.program.stages) == 2
    assert pipe.stages.weight is dict(pipe.named_parameters())["stages.weight"]  # the model's
    loss = pipe.step(x, target=torch.zeros(8, 4, dtype=torch.float64))
    assert loss.item() > 0
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=0)


def test_moving_a_pipeline_is_refused_with_advice():
    _, _, pipe = _gpt_pipe()
    with pytest.raises(pc.ConfigError, match="devices="):
        pipe.to(torch.float32)


def test_loaded_pipeline_simulates_explains_and_times_like_the_compiled_one(tmp_path):
    case, _, pipe = _gpt_pipe(schedule="1f1b")
    pipe.save(tmp_path)
    loaded = pc.load(tmp_path, loss_fn=case.loss_fn)
    assert loaded.plan.stage_costs == pipe.plan.stage_costs
    assert (loaded.plan.cores, loaded.plan.efficiency) == (pipe.plan.cores, pipe.plan.efficiency)
    assert loaded.predicted.to_dict() == pipe.predicted.to_dict()
    assert loaded.simulate().to_dict() == pipe.simulate().to_dict()
    assert loaded.simulate().makespan > 0
    compiled_log = pipe.explain().split("\n\n")[0].splitlines()  # the pass log (then the
    loaded_log = loaded.explain().split("\n\n")[0].splitlines()  # search, not saved)
    assert loaded_log[: len(compiled_log)] == compiled_log
    assert loaded_log[-1].startswith("load")
    pipe.step(*case.args, target=case.target)
    loaded.step(*case.args, target=case.target)
    ran = sorted((e.device, str(e.action)) for e in pipe.timeline().events)
    assert ran and ran == sorted((e.device, str(e.action))
                                 for e in loaded.timeline().events)


def test_loaded_pipeline_keeps_vertical_sync(tmp_path):
    torch.manual_seed(0)
    model = zoo.GPT(vocab=32, dim=16, layers=2, heads=2, seq=8, tied=False).double()
    x = torch.randint(0, 32, (8, 8))
    sgd = lambda params: torch.optim.SGD(params, lr=0.01)  # noqa: E731
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=zoo.lm_loss,
                      schedule="pipedream", optimizer=sgd, vertical_sync=True)
    pipe.save(tmp_path)
    loaded = pc.load(tmp_path, loss_fn=zoo.lm_loss, optimizer=sgd)
    assert loaded.plan.asked.vertical_sync
    assert all(w.versions.rule.vertical_sync for w in loaded.runtime.workers.values())
    y = torch.randint(0, 32, (8, 8))
    torch.testing.assert_close(loaded.step(x, target=y), pipe.step(x, target=y), rtol=1e-12,
                               atol=0)
