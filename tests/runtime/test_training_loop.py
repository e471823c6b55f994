"""A user's training loop around a pipeline, checked against the unsplit model (float64):
input errors, train()/eval(), eval_step, the user's optimizer and scheduler, global-norm
clipping, loss scaling."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import pipecompile as pc
from tests.support.models import CASES
from tests.support.reference import assert_grads_equal, reference_step


class BatchNormDropout(nn.Module):
    """Batch norm in two places, dropout after the last one (running statistics do not
    depend on the dropout masks, so a pipelined run keeps them equal to the model's)."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(6, 16), nn.BatchNorm1d(16)
        self.fc2, self.bn2 = nn.Linear(16, 16), nn.BatchNorm1d(16)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = torch.relu(self.bn1(self.fc1(x)))
        h = torch.relu(self.bn2(self.fc2(h)))
        return self.head(self.drop(h))


def _bn_pipe(p: float = 0.5, capture: str = "export"):
    torch.manual_seed(0)
    model = BatchNormDropout(p).double()
    x = torch.randn(8, 6, dtype=torch.float64) * 2 + 1
    y = torch.randint(0, 3, (8,))
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, loss_fn=F.cross_entropy,
                      split_points=["fc2"], capture=capture)
    return pipe, reference, x, y


# -- 9: inputs the model was not compiled with ---------------------------------------------------


def test_missing_and_extra_inputs_name_the_input_and_the_compiled_signature():
    case = CASES["keyword_tuple"]()
    pipe = pc.compile(case.model, case.args, case.kwargs, devices=2, microbatches=2,
                      loss_fn=case.loss_fn)
    with pytest.raises(pc.ConfigError, match=r"missing the keyword input 'scale'.*\(x, \*, scale\)"):
        pipe.step(*case.args, target=case.target)
    with pytest.raises(pc.ConfigError, match="missing the keyword input 'scale'"):
        pipe(*case.args)
    with pytest.raises(pc.ConfigError, match="'bias' that the model was not compiled with"):
        pipe.step(*case.args, target=case.target, bias=case.args[0], **case.kwargs)
    with pytest.raises(pc.ConfigError, match="2 positional inputs but .* compiled with 1"):
        pipe(case.args[0], case.args[0], **case.kwargs)
    with pytest.raises(pc.ConfigError, match="missing the keyword input 'scale'"):
        pipe.eval_step(*case.args, target=case.target)
    loss = pipe.step(*case.args, target=case.target, **case.kwargs)  # the right call works
    assert torch.isfinite(loss)


def test_an_fx_capture_names_its_positional_signature():
    pipe, _, x, y = _bn_pipe(capture="fx")
    with pytest.raises(pc.ConfigError, match=r"'bias' .*\(x\).*torch.fx: pass inputs positionally"):
        pipe.step(x, target=y, bias=x)


# -- 4 and 7: eval mode, eval_step --------------------------------------------------------------


@pytest.mark.parametrize("capture", ["export", "fx"])
def test_eval_output_equals_model_eval_after_training_steps(capture):
    pipe, reference, x, y = _bn_pipe(capture=capture)
    for _ in range(2):  # running statistics advance per micro-batch, as in the reference
        pipe.step(x, target=y)
        reference_step(reference, (x,), {}, y, F.cross_entropy, 2)
    assert pipe.training
    assert pipe.eval() is pipe and not pipe.training
    with torch.no_grad():
        reference.eval()
        torch.testing.assert_close(pipe(x), reference(x), rtol=1e-12, atol=1e-12)
        assert torch.equal(pipe(x), pipe(x))  # no dropout
    for key, value in reference.state_dict().items():  # eval forwards changed no buffer
        torch.testing.assert_close(pipe.state_dict()[key], value, rtol=1e-12, atol=0, msg=key)
    pipe.train()
    assert pipe.training
    with torch.no_grad():
        assert not torch.equal(pipe(x), pipe(x))  # dropout is back


def test_training_in_eval_mode_uses_running_statistics():
    pipe, reference, x, y = _bn_pipe(p=0.0)
    pipe.step(x, target=y)
    reference_step(reference, (x,), {}, y, F.cross_entropy, 2)
    pipe.eval()
    reference.eval()
    loss = pipe.step(x, target=y)  # gradients through the eval graphs, stats unchanged
    ref_loss, ref_grads = reference_step(reference, (x,), {}, y, F.cross_entropy, 2)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert_grads_equal(pipe, ref_grads)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value, rtol=1e-12, atol=0, msg=key)


def test_eval_step_is_the_mean_eval_loss_and_changes_nothing():
    pipe, reference, x, y = _bn_pipe()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.step(x, target=y)
    opt.step()
    grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    reference.load_state_dict(state)
    reference.eval()
    with torch.no_grad():
        want = torch.stack([F.cross_entropy(reference(xi), yi)
                            for xi, yi in zip(x.chunk(2), y.chunk(2))]).mean()
    got = pipe.eval_step(x, target=y)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert not got.requires_grad and pipe.training  # stays in train mode
    assert pipe.eval_step(x, target=y) == got  # no dropout: the same every time
    for name, p in pipe.named_parameters():  # gradients and state are untouched
        assert torch.equal(p.grad, grads[name]), name
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_eval_step_over_schedules_keeps_no_activations(schedule):
    torch.manual_seed(0)
    case = CASES["gpt"]()
    reference = copy.deepcopy(case.model).eval()
    pipe = pc.compile(case.model, case.args, devices=2, microbatches=4, schedule=schedule,
                      loss_fn=case.loss_fn)
    got = pipe.eval_step(*case.args, target=case.target)
    with torch.no_grad():
        want = torch.stack([case.loss_fn(reference(xi), yi) for xi, yi in
                            zip(case.args[0].chunk(4), case.target.chunk(4))]).mean()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert all(not w.saved for w in pipe.runtime.workers.values())


# -- 1: the user's optimizer and scheduler -------------------------------------------------------


def test_user_adamw_and_scheduler_on_a_model_tied_across_stages():
    torch.manual_seed(0)
    case = CASES["gpt"]()  # wte.weight is lm_head.weight: first and last stage
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, devices=2, microbatches=2, loss_fn=case.loss_fn)
    assert {s for s, _ in pipe.program.ties[0].copies} == {0, 1}

    def loop(params):
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    opt, sched = loop(pipe.parameters())
    ref_opt, ref_sched = loop(reference.parameters())
    for _ in range(3):
        loss = pipe.step(*case.args, target=case.target)
        opt.step()
        sched.step()
        opt.zero_grad()
        ref_loss, _ = reference_step(reference, case.args, {}, case.target, case.loss_fn, 2)
        ref_opt.step()
        ref_sched.step()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    want = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=1e-10, atol=1e-12, msg=name)
    for name, copies in pipe.program.tensors.items():  # every stage's copy of every tensor
        for _, t in copies:
            torch.testing.assert_close(t, reference.get_parameter(name) if name in want
                                       else t, rtol=1e-10, atol=1e-12, msg=name)


def test_a_tied_weight_frozen_after_compile_stays_frozen_in_every_stage():
    """`requires_grad_(False)` on the tied weight after compile: the last stage's leaf of it (an
    alias) follows, so it gets no gradient and the optimizer leaves it, as in the model."""
    torch.manual_seed(0)
    case = CASES["gpt"]()
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, devices=2, microbatches=2, loss_fn=case.loss_fn)
    pipe.step(*case.args, target=case.target)  # a step before the freeze
    before = pipe.wte.weight.detach().clone()
    pipe.wte.weight.requires_grad_(False)
    reference.wte.weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in pipe.parameters() if p.requires_grad], lr=0.1)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        loss = pipe.step(*case.args, target=case.target)
        opt.step()
        ref_loss, ref_grads = reference_step(reference, case.args, {}, case.target,
                                             case.loss_fn, 2)
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert "wte.weight" not in ref_grads and pipe.wte.weight.grad is None
    assert all(t.grad is None and not t.requires_grad for _, t in pipe.program.tensors["wte.weight"])
    assert torch.equal(pipe.wte.weight, before)
    want = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, want[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.fixture
def second_device(monkeypatch):
    """Stages on "cpu:1" get their own copies of the tensors, as stages on a second
    accelerator would (no accelerator here): a tie across stages has two objects."""
    import pipecompile.passes.split as split_module

    place = split_module._to_device

    def to_device(tensor, device):
        if device.index != 1:
            return place(tensor, device)
        moved = tensor.detach().clone()
        if isinstance(tensor, nn.Parameter):
            return nn.Parameter(moved, requires_grad=tensor.requires_grad)
        return moved

    monkeypatch.setattr(split_module, "_to_device", to_device)
    return ["cpu:0", "cpu:1"]


@pytest.mark.parametrize("clip", [False, True])
def test_user_adamw_when_the_tie_has_a_copy_on_another_device(second_device, clip):
    torch.manual_seed(0)
    case = CASES["gpt"]()
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, devices=second_device, microbatches=2,
                      loss_fn=case.loss_fn)
    (_, owner), (_, other) = pipe.program.tensors["lm_head.weight"]
    assert owner is not other and pipe.get_parameter("lm_head.weight") is owner
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for _ in range(3):
        loss = pipe.step(*case.args, target=case.target)  # the copy follows at its start
        ref_loss, _ = reference_step(reference, case.args, {}, case.target, case.loss_fn, 2)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
        if clip:  # the tie counted once, both copies' gradients scaled
            torch.testing.assert_close(
                pipe.clip_grad_norm_(0.05),
                torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05), rtol=1e-12, atol=0)
            torch.testing.assert_close(other.grad, owner.grad, rtol=0, atol=0)
        opt.step()
        sched.step()
        opt.zero_grad()
        ref_opt.step()
        ref_sched.step()
    assert not torch.equal(other, owner)  # only the owner was updated so far
    with torch.no_grad():
        torch.testing.assert_close(pipe(*case.args), reference(*case.args), rtol=1e-10,
                                   atol=1e-12)
    assert torch.equal(other, owner)
    torch.testing.assert_close(owner, reference.lm_head.weight, rtol=1e-10, atol=1e-12)


def test_one_name_read_on_two_devices_trains_as_the_model(second_device):
    """keyword_tuple reads `encode.weight` under one name at both ends: on two devices the
    second stage's copy is a tie's copy (its gradient summed into the owner's, the owner
    stepped, the copy following), as a tie under two names is."""
    torch.manual_seed(0)
    case = CASES["keyword_tuple"]()
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, case.kwargs, devices=second_device,
                      microbatches=2, loss_fn=case.loss_fn)
    (_, owner), (_, other) = pipe.program.tensors["encode.weight"]
    assert owner is not other and pipe.get_parameter("encode.weight") is owner
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        loss = pipe.step(*case.args, target=case.target, **case.kwargs)
        ref_loss, ref_grads = reference_step(reference, case.args, case.kwargs, case.target,
                                             case.loss_fn, 2)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
        assert_grads_equal(pipe, ref_grads)
        opt.step()
        ref_opt.step()
    with torch.no_grad():
        pipe(*case.args, **case.kwargs)  # the copy follows before a forward
    assert torch.equal(other, owner)
    torch.testing.assert_close(owner, reference.encode.weight, rtol=1e-10, atol=1e-12)


def test_tied_copies_follow_their_owner_after_any_update():
    from pipecompile.ir.records import StagedProgram
    from pipecompile.runtime.training import TiedCopies

    owner = nn.Parameter(torch.randn(3, 2, dtype=torch.float64))
    copy_ = nn.Parameter(owner.detach().clone())  # as on another device

    class Tie:
        names = ("a", "b")

    class Program:
        ties = (Tie(),)
        tensors = {"a": ((0, owner), (1, copy_)), "b": ((0, owner), (1, copy_))}
        held, held_copies = StagedProgram.held, StagedProgram.held_copies

    ties = TiedCopies(Program(), own_stages=(0, 1))
    ties.follow()
    assert torch.equal(copy_, owner)
    owner.grad = torch.ones_like(owner)
    torch.optim.AdamW([owner], lr=0.1).step()  # updates the owner only, in place
    assert not torch.equal(copy_, owner)
    ties.follow()
    assert torch.equal(copy_, owner)


# -- 2: clipping by the global norm --------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_equals_the_unsplit_model(norm_type):
    torch.manual_seed(0)
    case = CASES["gpt"]()
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, devices=3, microbatches=2, loss_fn=case.loss_fn)
    pipe.step(*case.args, target=case.target)
    reference_step(reference, case.args, {}, case.target, case.loss_fn, 2)
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type)
    got = pipe.clip_grad_norm_(0.1, norm_type)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    assert got > 0.1  # the gradients were really scaled
    assert_grads_equal(pipe, {n: p.grad for n, p in reference.named_parameters()}, rtol=1e-12)


def test_clip_refuses_a_non_finite_norm_when_asked_and_asynchronous_schedules():
    pipe, _, x, y = _bn_pipe(p=0.0)
    pipe.step(x, target=y)
    next(pipe.parameters()).grad[0, 0] = math.inf
    with pytest.raises(pc.ConfigError, match="error_if_nonfinite=False"):
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    pipe = pc.compile(BatchNormDropout(0.0).double(), (x,), devices=2, microbatches=2,
                      loss_fn=F.cross_entropy, schedule="pipedream", split_points=["fc2"],
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(pc.ConfigError, match="no step gradients to clip"):
        pipe.clip_grad_norm_(1.0)


# -- 3 (GradScaler side): a scaled loss scales the gradients -------------------------------------


def test_loss_scale_and_grad_scaler_scale_the_gradients():
    torch.manual_seed(0)
    case = CASES["gpt"]()
    pipe = pc.compile(case.model, case.args, devices=2, microbatches=2, loss_fn=case.loss_fn)
    loss = pipe.step(*case.args, target=case.target)
    plain = {n: p.grad.clone() for n, p in pipe.named_parameters()}
    scaled_loss = pipe.step(*case.args, target=case.target, loss_scale=1024.0)
    assert scaled_loss == loss  # the returned loss is not scaled
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, plain[name] * 1024, rtol=1e-12, atol=0, msg=name)

    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    pipe.step(*case.args, target=case.target, loss_scale=scaler)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, plain[name] * 256, rtol=1e-12, atol=0, msg=name)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, before[name] - 0.1 * plain[name], rtol=1e-12,
                                   atol=1e-15, msg=name)


@pytest.mark.parametrize("where", ["one device", "two devices"])
def test_backward_through_pipe_call_gives_a_tied_weight_its_whole_gradient(where, request):
    """`loss_fn(pipe(x), y).backward()`, the caller's own backward: the last stage's leaf of the
    tied weight (an alias on one device, a copy on another) hands its gradient to the owner,
    as autograd sums a tensor read twice; a step afterwards still keeps them apart."""
    torch.manual_seed(0)
    case = CASES["gpt"]()
    reference = copy.deepcopy(case.model)
    devices = 2 if where == "one device" else request.getfixturevalue("second_device")
    pipe = pc.compile(case.model, case.args, devices=devices, microbatches=2,
                      loss_fn=case.loss_fn)
    (_, owner), (_, other) = pipe.program.tensors["wte.weight"]
    for _ in range(2):  # the second backward accumulates onto the first, as autograd does
        case.loss_fn(pipe(*case.args), case.target).backward()
        case.loss_fn(reference(*case.args), case.target).backward()
    assert other.grad is None and owner is pipe.wte.weight
    want = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-10, atol=1e-14, msg=name)
    loss = pipe.step(*case.args, target=case.target)  # a step starts from zero again
    ref_loss, ref_grads = reference_step(reference, case.args, {}, case.target, case.loss_fn, 2)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert_grads_equal(pipe, ref_grads)
    pipe.zero_grad()  # then the caller's own backward again: the step's sum is not counted
    reference.zero_grad()
    case.loss_fn(pipe(*case.args), case.target).backward()
    case.loss_fn(reference(*case.args), case.target).backward()
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-10, atol=1e-14, msg=name)
