"""Untraceable submodules kept as opaque calls: an eager top-2 MoE (nonzero routing, a Python
loop over the experts hit) inside a small decoder trains exactly as the unsplit model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import pipecompile as pc
from pipecompile.capture.capture import capture
from pipecompile.errors import CaptureError
from tests.support.capture_models import DataDependentRoot, MoEDecoder
from tests.support.reference import assert_grads_equal, reference_step

VOCAB = 32


def _loss(out, target):
    logits, aux = out
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1)) + 0.01 * aux


def _case():
    torch.manual_seed(0)
    model = MoEDecoder(vocab=VOCAB).double()
    return model, torch.randint(0, VOCAB, (8, 6)), torch.randint(0, VOCAB, (8, 6))


def test_capture_keeps_each_moe_as_one_call_under_its_own_name():
    model, ids, _ = _case()
    captured = capture(model, (ids,))
    calls = [n.target for n in captured.module.graph.nodes if n.op == "call_module"]
    assert calls == [f"blocks.{i}.moe" for i in range(4)]
    assert captured.dynamic_batch
    assert [n for n in captured.notes if n.startswith("opaque module")] == [
        n for n in captured.notes if "data-dependent" in n]
    assert len([n for n in captured.notes if "(EagerMoE)" in n]) == 4
    names = dict(captured.module.named_parameters())
    assert names["blocks.2.moe.experts.3.up.weight"] is model.blocks[2].moe.experts[3].up.weight
    # the captured graph computes the model, on another batch size too
    with torch.no_grad():
        small = ids[:3]
        got = captured.module(small)
        want = model(small)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
@pytest.mark.parametrize("devices", [2, 4])
def test_moe_decoder_step_matches_unsplit_model(devices, schedule):
    model, ids, target = _case()
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (ids,), devices=["cpu"] * devices, microbatches=4,
                      schedule=schedule, loss_fn=_loss, granularity="layer+1")
    loss = pipe.step(ids, target=target)
    ref_loss, ref_grads = reference_step(reference, (ids,), {}, target, _loss, 4)
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    compared = assert_grads_equal(pipe, ref_grads, rtol=1e-12)
    assert len(compared) == len(ref_grads)
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in reference.named_parameters()]
    assert "opaque module 'blocks.3.moe' (EagerMoE)" in pipe.explain()


def test_root_that_branches_on_data_is_refused_quietly_with_the_hints_that_apply(capfd):
    model = DataDependentRoot().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    with pytest.raises(CaptureError) as info:
        pc.compile(model, (x,), devices=2, loss_fn=lambda out, y: out.sum())
    message = str(info.value)
    assert "in module '<root>' (DataDependentRoot)" in message
    assert "torch.where or torch.cond" in message and "move that code into a submodule" in message
    assert "use_cache" not in message and "capture='fx'" not in message
    assert "verbose=True" in message and "def forward" in info.value.details
    assert "def forward" not in capfd.readouterr().err


def test_opaque_false_refuses_the_moe_naming_the_module():
    model, ids, _ = _case()
    with pytest.raises(CaptureError, match=r"in module 'blocks\.0\.moe' \(EagerMoE\)"):
        capture(model, (ids,), opaque=False)


class _PerSampleMoE(MoEDecoder):
    """Loops over the batch in Python: export falls back to static shapes, MoEs stay opaque."""

    def forward(self, ids):
        logits, aux = super().forward(ids)
        rows = [logits[i] * (1.0 + 0.1 * i) for i in range(ids.shape[0])]
        return torch.stack(rows), aux


def test_static_fallback_keeps_opaque_modules_at_the_microbatch_size():
    torch.manual_seed(0)
    model = _PerSampleMoE(vocab=VOCAB).double()
    ids, target = torch.randint(0, VOCAB, (8, 6)), torch.randint(0, VOCAB, (8, 6))
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (ids,), devices=2, microbatches=4, loss_fn=_loss)
    text = pipe.explain()
    assert "static batch" in text and "opaque module 'blocks.0.moe'" in text
    loss = pipe.step(ids, target=target)
    ref_loss, ref_grads = reference_step(reference, (ids,), {}, target, _loss, 4)
    assert torch.equal(loss, ref_loss)
    assert len(assert_grads_equal(pipe, ref_grads, rtol=1e-12)) == len(ref_grads)


def test_a_cut_right_after_an_opaque_call_sends_its_tensors_not_the_tuple():
    from pipecompile.passes.linearize import linearize
    from pipecompile.passes.split import split

    model, ids, _ = _case()
    linear = linearize(capture(model, (ids,)), granularity="op")
    call = next(b.index for b in linear.blocks if b.nodes == ("blocks_0_moe",))
    program = split(linear, (0, call + 1, linear.num_blocks), ["cpu", "cpu"])
    first, second = program.stages
    assert "blocks_0_moe" not in first.outputs
    assert all(linear.captured.values[v].is_tensor for v in second.inputs)
    with torch.no_grad():  # the two stages chained compute the model
        sent = dict(zip(first.outputs, first.module(ids)))
        got = second.module(*[ids if v == "ids" else sent[v] for v in second.inputs])
        want = model(ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
