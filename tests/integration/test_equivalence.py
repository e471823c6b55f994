"""Tier 2: a compiled GPipe step equals the unsplit model (float64, same micro-batches)."""

from __future__ import annotations

import copy

import pytest
import torch

import pipecompile as pc
from tests.support.models import CASES
from tests.support.reference import assert_grads_equal, reference_step

MICROBATCHES = 4


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpipe_step_matches_unsplit_model(name, stages):
    torch.manual_seed(0)
    case = CASES[name]()
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, case.kwargs, devices=stages,
                      microbatches=MICROBATCHES, schedule="gpipe", loss_fn=case.loss_fn)
    assert len(pipe.program.stages) == stages

    loss = pipe.step(*case.args, target=case.target, **case.kwargs)
    ref_loss, ref_grads = reference_step(reference, case.args, case.kwargs, case.target,
                                         case.loss_fn, MICROBATCHES)

    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0), (loss, ref_loss)
    compared = assert_grads_equal(pipe, ref_grads)
    assert len(compared) == len(ref_grads)
    # buffers (BatchNorm running statistics) were updated exactly as by the unsplit model
    ref_state = reference.state_dict()
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, ref_state[key]), key


@pytest.mark.parametrize("name", ["gpt2", "keyword_tuple", "unet"])
def test_forward_call_returns_model_structure(name):
    torch.manual_seed(0)
    case = CASES[name]()
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, case.kwargs, devices=3, microbatches=2,
                      loss_fn=case.loss_fn)
    with torch.no_grad():
        got = pipe(*case.args, **case.kwargs)
        want = reference(*case.args, **case.kwargs)
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    want_leaves, want_spec = torch.utils._pytree.tree_flatten(want)
    assert type(got) is type(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_other_batch_size_uses_dynamic_batch():
    torch.manual_seed(0)
    case = CASES["gpt"]()
    reference = copy.deepcopy(case.model)
    pipe = pc.compile(case.model, case.args, devices=2, microbatches=4, loss_fn=case.loss_fn)
    x = torch.randint(0, 64, (12, 8))
    y = torch.randint(0, 64, (12, 8))
    loss = pipe.step(x, target=y)
    ref_loss, ref_grads = reference_step(reference, (x,), {}, y, case.loss_fn, 4)
    assert torch.allclose(loss, ref_loss, rtol=1e-12)
    assert_grads_equal(pipe, ref_grads)


def test_optimizer_step_matches_reference_sgd():
    torch.manual_seed(0)
    case = CASES["gpt2"]()
    reference = copy.deepcopy(case.model)
    opt = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    pipe = pc.compile(case.model, case.args, devices=4, microbatches=2, loss_fn=case.loss_fn,
                      optimizer=opt)
    ref_opt = opt(reference.parameters())
    for _ in range(3):
        pipe.step(*case.args, target=case.target)
        reference_step(reference, case.args, {}, case.target, case.loss_fn, 2)
        ref_opt.step()
    ref_params = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-10, atol=1e-12)


def test_named_parameters_and_state_dict_use_original_names():
    torch.manual_seed(0)
    case = CASES["gpt2"]()
    model = case.model
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict().keys())
    pipe = pc.compile(model, case.args, devices=4, microbatches=2, loss_fn=case.loss_fn)
    assert [n for n, _ in pipe.named_parameters()] == names
    assert list(pipe.state_dict().keys()) == keys
    # load_state_dict round trip: a fresh model's weights flow into every stage
    fresh = CASES["gpt2"]().model
    pipe.load_state_dict(fresh.state_dict())
    for name, p in pipe.named_parameters():
        assert torch.equal(p, dict(fresh.named_parameters())[name])
    with pytest.raises(pc.ConfigError, match="missing keys"):
        pipe.load_state_dict({})


def test_tied_gpt2_embedding_is_one_parameter_with_summed_gradient():
    torch.manual_seed(0)
    case = CASES["gpt2"]()
    pipe = pc.compile(case.model, case.args, devices=4, microbatches=2, loss_fn=case.loss_fn)
    ties = pipe.program.ties
    assert len(ties) == 1
    assert set(ties[0].names) == {"transformer.wte.weight", "lm_head.weight"}
    stages_using = {s for s, _ in ties[0].copies} | {
        st.index for st in pipe.program.stages
        if {"transformer.wte.weight", "lm_head.weight"} & set(st.parameter_names)
    }
    assert {0, 3} <= stages_using  # the first and last stage both read the tied weight
