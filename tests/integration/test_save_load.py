"""pipe.save / pipecompile.load: the loaded pipeline computes the same outputs and gradients."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.schedule.actions import Schedule
from tests.support.models import CASES

ROUND_TRIP = ["gpt", "residual_cnn", "keyword_tuple"]


def _compiled(name: str, **options):
    torch.manual_seed(0)
    case = CASES[name]()
    pipe = pc.compile(case.model, case.args, case.kwargs, devices=3, microbatches=2,
                      loss_fn=case.loss_fn, **options)
    return case, pipe


def _leaves(tree):
    return torch.utils._pytree.tree_leaves(tree)


@pytest.mark.parametrize("name", ROUND_TRIP)
def test_loaded_pipeline_gives_same_outputs_and_gradients(name, tmp_path):
    case, pipe = _compiled(name, schedule="1f1b")
    pipe.save(tmp_path)
    loaded = pc.load(tmp_path, loss_fn=case.loss_fn)

    with torch.no_grad():
        want, got = pipe(*case.args, **case.kwargs), loaded(*case.args, **case.kwargs)
    assert type(got) is type(want)
    for g, w in zip(_leaves(got), _leaves(want), strict=True):
        assert torch.equal(g, w)

    want_loss = pipe.step(*case.args, target=case.target, **case.kwargs)
    got_loss = loaded.step(*case.args, target=case.target, **case.kwargs)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=0)
    want_grads = dict(pipe.named_parameters())
    names = [n for n, _ in loaded.named_parameters()]
    assert names == [n for n, _ in pipe.named_parameters()]
    for n, p in loaded.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n].grad, rtol=1e-12, atol=1e-15)
    # buffers (BatchNorm statistics) advanced the same way; ties and plan came back
    want_state = pipe.state_dict()
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, want_state[key], rtol=1e-12, atol=1e-15)
    assert [t.names for t in loaded.program.ties] == [t.names for t in pipe.program.ties]
    assert loaded.program.bounds == pipe.program.bounds
    assert str(loaded.schedule) == str(pipe.schedule)
    assert str(loaded) == str(pipe)


def test_directory_holds_code_json_and_safetensors_only(tmp_path):
    case, pipe = _compiled("gpt")
    plan_path = pipe.save(tmp_path)
    assert Path(plan_path) == tmp_path / "plan.json"
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["plan.json", "schedule.json", "stage0.py", "stage0.safetensors",
                     "stage1.py", "stage1.safetensors", "stage2.py", "stage2.safetensors"]
    code = (tmp_path / "stage1.py").read_text()
    assert "class Stage1(torch.nn.Module):" in code and "def forward(self, " in code
    assert pipe.program.stages[1].module.code.strip() in "\n".join(
        line[4:] for line in code.splitlines())  # the fx code, indented in the class
    plan = json.loads(Path(plan_path).read_text())
    assert plan["microbatches"] == 2 and plan["bounds"] == list(pipe.program.bounds)
    assert plan["stages"][1]["inputs"] == list(pipe.program.stages[1].inputs)
    assert plan["ties"][0]["names"] == ["wte.weight", "lm_head.weight"]
    schedule = json.loads((tmp_path / "schedule.json").read_text())
    assert Schedule.from_text(pipe.schedule.to_text()).actions == tuple(
        tuple(a for a in row) for row in pipe.schedule.actions)
    assert schedule["actions"] == [[str(a) for a in row] for row in pipe.schedule.actions]
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "stage0.safetensors"))
    assert set(weights) == set(plan["stages"][0]["attributes"])  # the names stage 0 reads
    for name, tensor in weights.items():
        assert torch.equal(tensor, pipe.program.stages[0].module.get_parameter(name))


def test_save_of_a_loaded_pipeline_writes_the_same_files(tmp_path):
    case, pipe = _compiled("keyword_tuple")
    pipe.save(tmp_path / "a")
    pc.load(tmp_path / "a").save(tmp_path / "b")
    for name in ("stage0.py", "stage1.py", "stage2.py", "schedule.json"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text(), name


def test_load_without_the_model_code_in_a_fresh_process(tmp_path):
    case, pipe = _compiled("gpt")
    pipe.save(tmp_path / "program")
    from safetensors.torch import save_file

    x = case.args[0]
    with torch.no_grad():
        save_file({"x": x, "y": pipe(x)}, str(tmp_path / "io.safetensors"))
    script = (
        "import sys, torch, pipecompile\n"
        "from safetensors.torch import load_file\n"
        f"io = load_file({str(tmp_path / 'io.safetensors')!r})\n"
        f"pipe = pipecompile.load({str(tmp_path / 'program')!r})\n"
        "assert 'pipecompile.zoo' not in sys.modules and 'tests' not in sys.modules\n"
        "with torch.no_grad():\n"
        "    assert torch.equal(pipe(io['x']), io['y'])\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


def test_optimizer_given_to_load_steps_like_the_original(tmp_path):
    opt = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    case, pipe = _compiled("keyword_tuple", optimizer=opt)
    pipe.save(tmp_path)
    loaded = pc.load(tmp_path, loss_fn=case.loss_fn, optimizer=opt)
    for _ in range(2):
        pipe.step(*case.args, target=case.target, **case.kwargs)
        loaded.step(*case.args, target=case.target, **case.kwargs)
    want = dict(pipe.named_parameters())
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=1e-10, atol=1e-12)


def test_model_output_types_come_back_or_fall_back_to_dict(tmp_path):
    case, pipe = _compiled("gpt2")
    pipe.save(tmp_path)
    with torch.no_grad():
        want = pipe(*case.args)
        got = pc.load(tmp_path)(*case.args)
    assert type(got) is type(want)  # transformers is importable here
    # a type that cannot be imported where the program is loaded: a dict with the same keys
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan["captured"]["out_spec"] = plan["captured"]["out_spec"].replace(
        "transformers.modeling_outputs.CausalLMOutputWithCrossAttentions", "nowhere.Output")
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    with torch.no_grad():
        fallback = pc.load(tmp_path)(*case.args)
    assert isinstance(fallback, dict) and list(fallback) == ["logits"]
    assert torch.equal(fallback["logits"], want.logits)


def test_load_errors_name_the_fix(tmp_path):
    case, pipe = _compiled("keyword_tuple")
    pipe.save(tmp_path)
    loaded = pc.load(tmp_path / "plan.json", devices=["cpu"])
    assert [str(s.device) for s in loaded.program.stages] == ["cpu"] * 3
    with pytest.raises(pc.ConfigError, match="one device per schedule device"):
        pc.load(tmp_path, devices=["cpu", "cpu"])
    with pytest.raises(pc.ConfigError, match="does not exist"):
        pc.load(tmp_path / "missing")
    fx_case = CASES["gpt"]()
    fx_pipe = pc.compile(fx_case.model, fx_case.args, devices=2, microbatches=2, capture="fx")
    with pytest.raises(pc.ConfigError, match="capture='export'"):
        fx_pipe.save(tmp_path / "fx")


def test_simulate_gives_the_prediction_before_and_after_save(tmp_path):
    # One question, one answer: pipe.simulate() and pipe.predicted both count the per-action
    # overhead, and so does a loaded pipeline (the overhead is saved with the stage costs).
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 8))
    pipe = pc.compile(zoo.GPT(vocab=64, dim=16, layers=4, heads=2, seq=8), (ids,), devices=2,
                      schedule="1f1b", microbatches=4, loss_fn=zoo.lm_loss)
    assert pipe.plan.overhead > 0  # else dropping it would go unnoticed here
    assert pipe.predicted is not None
    assert pipe.simulate().events == pipe.predicted.events
    assert pipe.simulate().makespan == pipe.predicted.makespan

    pipe.save(tmp_path)
    loaded = pc.load(tmp_path, loss_fn=zoo.lm_loss)
    assert loaded.plan.overhead == pipe.plan.overhead
    assert loaded.simulate().events == pipe.predicted.events
    assert loaded.simulate().makespan == loaded.predicted.makespan == pipe.predicted.makespan

    # a plan.json saved before the overhead was: loads, with no overhead
    plan = tmp_path / "plan.json"
    data = json.loads(plan.read_text())
    del data["overhead"]
    plan.write_text(json.dumps(data))
    assert pc.load(tmp_path, loss_fn=zoo.lm_loss).plan.overhead == 0.0


def test_plans_saved_with_the_stage_times_in_each_stages_cost_still_load(tmp_path):
    """Before a stage's `StageCost` took its times from the simulator's costs, plan.json kept
    forward_time and backward_time in each stage's "cost" (and, earlier still, no plan-level
    "stage_costs")."""
    case, pipe = _compiled("gpt")
    pipe.save(tmp_path)
    plan = tmp_path / "plan.json"
    data = json.loads(plan.read_text())
    assert all("times" not in s["cost"] for s in data["stages"])  # one home: "stage_costs"
    for entry, costs in zip(data["stages"], data["stage_costs"]):
        entry["cost"].update(forward_time=costs["forward"], backward_time=costs["backward"])
    plan.write_text(json.dumps(data))
    loaded = pc.load(tmp_path, loss_fn=case.loss_fn)
    assert [s.cost for s in loaded.plan.program.stages] == [
        s.cost for s in pipe.plan.program.stages]
    del data["stage_costs"]
    plan.write_text(json.dumps(data))
    oldest = pc.load(tmp_path, loss_fn=case.loss_fn).plan.program.stages
    assert [(s.cost.forward_time, s.cost.backward_time) for s in oldest] == [
        (s.cost.times.forward, s.cost.times.backward) for s in pipe.plan.program.stages]
