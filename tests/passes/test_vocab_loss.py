"""passes/vocab_loss.py: which readers of split logits lower to a vocabulary-parallel cross
entropy, and the traced loss lowered onto this rank's slice (collectives handed in)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from pipecompile import zoo
from pipecompile.passes.vocab_loss import logits_readers, lower_loss

N, V = 6, 8


def _trace(loss_fn):
    logits = torch.randn(2, 3, V, dtype=torch.float64)
    target = torch.randint(0, V, (2, 3))
    return make_fx(lambda x, t: loss_fn(x, t), tracing_mode="fake", pre_dispatch=True,
                   _allow_non_fake_inputs=True)(
        logits, target)


def _first(gm):
    return next(n for n in gm.graph.nodes if n.op == "placeholder")


def test_a_cross_entropy_after_reshapes_is_lowerable_and_other_readers_are_not():
    gm = _trace(zoo.lm_loss)
    found = logits_readers(_first(gm), V)
    assert found is not None and len(found.losses) == 1 and not found.outputs
    assert [n.target for n in found.chain] == [torch.ops.aten.reshape.default]
    shifted = _trace(lambda x, t: F.cross_entropy(x[:, :-1].float().reshape(-1, V),
                                                  t[:, 1:].reshape(-1), ignore_index=-1))
    assert logits_readers(_first(shifted), V) is not None  # label shift, cast: lowerable
    weight = torch.rand(V, dtype=torch.float64)
    for smoothed in (lambda x, t: F.cross_entropy(x.reshape(-1, V), t.reshape(-1),
                                                  label_smoothing=0.1),
                     lambda x, t: F.cross_entropy(x.reshape(-1, V), t.reshape(-1), weight=weight,
                                                  label_smoothing=0.2)):
        found = logits_readers(_first(_trace(smoothed)), V)
        assert found is not None and len(found.losses) == 1  # Megatron's smoothed form
    for other in (lambda x, t: zoo.lm_loss(x, t) + x.pow(2).mean(),  # not only the loss
                  lambda x, t: F.cross_entropy(x.reshape(-1, V), t.reshape(-1),
                                               weight=x[0, 0].detach()),  # from the logits
                  lambda x, t: x.argmax(-1).float().mean(),
                  lambda x, t: F.cross_entropy(x[..., :4].reshape(-1, 4),  # the vocab sliced
                                               t.reshape(-1) % 4)):
        assert logits_readers(_first(_trace(other)), V) is None


def test_the_lowered_loss_reads_this_ranks_slice_and_calls_the_parallel_cross_entropy():
    """At T = 2 the reshape's vocabulary is V/2 and the cross entropy is the handed-in one,
    with aten's reduction (2: sum) and ignore_index; a loss that does not lower: None."""
    seen = []

    def cross_entropy(local, target, reduction, ignore_index):
        seen.append((tuple(local.shape), reduction, ignore_index))
        return local.sum() * 0 + 1.0

    vocab = {"cross_entropy": cross_entropy, "output": None}
    gm = _trace(lambda x, t: F.cross_entropy(x.reshape(-1, V), t.reshape(-1),
                                             reduction="sum", ignore_index=3))
    lowered = lower_loss(gm, {0: 2}, 2, vocab)
    assert lowered is not None
    out = lowered(torch.randn(2, 3, V // 2, dtype=torch.float64), torch.zeros(2, 3).long())
    assert float(out) == 1.0 and seen == [((N, V // 2), 2, 3)]
    assert lower_loss(_trace(lambda x, t: x.pow(2).mean()), {0: 2}, 2, vocab) is None


def test_class_weights_and_label_smoothing_are_handed_to_the_parallel_cross_entropy():
    """The whole weight vector (a constant of the traced loss) and the smoothing reach the
    lowered call as keywords; without them the call is as before (4 arguments)."""
    seen = []

    def cross_entropy(local, target, reduction, ignore_index, **options):
        seen.append({k: (tuple(v.shape) if isinstance(v, torch.Tensor) else v)
                     for k, v in options.items()})
        return local.sum() * 0 + 1.0

    vocab = {"cross_entropy": cross_entropy, "output": None}
    weight = torch.rand(V, dtype=torch.float64)
    gm = _trace(lambda x, t: F.cross_entropy(x.reshape(-1, V), t.reshape(-1), weight=weight,
                                             label_smoothing=0.25))
    lowered = lower_loss(gm, {0: 2}, 2, vocab)
    assert lowered is not None
    lowered(torch.randn(2, 3, V // 2, dtype=torch.float64), torch.zeros(2, 3).long())
    assert seen == [{"weight": (V,), "label_smoothing": 0.25}]
