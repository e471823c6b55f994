"""runtime/forwards: a kept forward and a recomputed one give the same outputs and, through
the same backward, the same gradients; the recomputed one keeps only its inputs until then."""

from __future__ import annotations

import torch

from pipecompile.runtime.backwards import FusedBackward
from pipecompile.runtime.forwards import KeptForward, RecomputedForward
from pipecompile.runtime.in_flight import InFlight, NoSync
from pipecompile.runtime.stage_call import StageCall
from pipecompile.runtime.stage_loss import StageLoss
from tests.runtime.test_stage_worker import Dropped


def _run(kind, module, inputs, grads):
    """Outputs, input gradients and parameter gradients of F0 F1 B0 B1 with `kind`."""
    module.zero_grad(set_to_none=True)
    call, held, loss, sync = (StageCall(0, module, ("h",), ("out",), frozenset({"h"})),
                              InFlight(), StageLoss(None), NoSync())
    backward = FusedBackward(call, held, loss, sync)
    forward = kind(call, held, loss, backward, sync)
    torch.manual_seed(3)
    outputs = [forward(mb, {"h": inputs[mb]})["out"] for mb in (0, 1)]
    kept = held.saved[0]
    assert (held.steps, held.peak_inflight) == (1, 2)  # micro-batch 0 began the step
    got = [backward.full(mb, forward.restore(mb), {"out": grads[mb]})["h"] for mb in (0, 1)]
    assert held.saved == {}
    return outputs, got, {n: p.grad.clone() for n, p in module.named_parameters()}, kept


def test_recomputed_forward_gives_the_kept_forwards_outputs_and_gradients():
    torch.manual_seed(0)
    module = Dropped().double()
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(8, 5, generator=g, dtype=torch.float64) for _ in range(2)]
    grads = [torch.randn(8, 5, generator=g, dtype=torch.float64) for _ in range(2)]
    out_k, in_k, params_k, kept = _run(KeptForward, module, inputs, grads)
    out_r, in_r, params_r, recomputed = _run(RecomputedForward, module, inputs, grads)
    assert kept.inputs is None and "h" in kept.leaves  # the graph was kept
    assert recomputed.leaves == {} and recomputed.inputs is not None  # only what to rerun
    assert recomputed.rng is not None
    for a, b in zip(out_k + in_k, out_r + in_r):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name, grad in params_k.items():
        torch.testing.assert_close(params_r[name], grad, rtol=0, atol=0)


def test_restore_of_a_recomputed_forward_replaces_its_inputs_by_the_graph():
    torch.manual_seed(0)
    module = Dropped().double()
    call, held, loss, sync = (StageCall(0, module, ("h",), ("out",), frozenset({"h"})),
                              InFlight(), StageLoss(None), NoSync())
    forward = RecomputedForward(call, held, loss, FusedBackward(call, held, loss, sync), sync)
    h = torch.randn(4, 5, dtype=torch.float64)
    out = forward(0, {"h": h})["out"]
    assert not out.requires_grad  # no autograd graph in the forward
    restored = forward.restore(0)
    assert held.saved[0] is restored and restored.inputs is None
    torch.testing.assert_close(restored.outputs["out"].detach(), out, rtol=0, atol=0)
    assert restored.outputs["out"].requires_grad and forward.restore(0) is restored
