"""capture/unbacked.py: a size the data decides (JetMoE's `x.split(counts.tolist())`) is an
unbacked symbol in the captured graph; capture prices it as an even split of what it splits,
in the batch size, says so in the notes, and the model compiles and trains exactly."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import pipecompile as pc
from pipecompile.capture.capture import capture
from pipecompile.capture.unbacked import estimate
from tests.support.reference import assert_grads_equal, reference_step


class _Routed(nn.Module):
    """Each row goes to one of two experts; the experts' row counts come from `.tolist()`."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 2)
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.gate(x).argmax(-1)
        order = choice.argsort()
        hits = torch.zeros(x.shape[0], 2, dtype=torch.long).scatter(1, choice[:, None], 1)
        pieces = x[order].split(hits.sum(0).tolist())
        out = torch.cat([expert(piece) for expert, piece in zip(self.experts, pieces)])
        return out[order.argsort()]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), _Routed(), nn.Tanh(), nn.Linear(4, 4), _Routed(),
                         nn.Linear(4, 2)).double()


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def test_split_sizes_are_estimated_as_even_splits_in_the_batch():
    x = torch.randn(8, 4, dtype=torch.float64)
    captured = capture(_model(), (x,), {})
    batch = captured.batch_symbol
    assert batch is not None
    assert len(captured.estimated_sizes) == 4  # two experts in each of two routed layers
    # whole rows, the last piece taking the rest: the pieces add up to the batch
    assert [e.subs(batch, 7) for e in captured.estimated_sizes.values()] == [3, 4, 3, 4]
    sizes = captured.sizes_at(6)
    assert [sizes[s] for s in captured.estimated_sizes] == [3, 3, 3, 3]
    note = next(n for n in captured.notes if "data-dependent" in n)
    assert note.startswith("4 data-dependent sizes (u0, u1, u2, u3) priced as even splits")
    assert "in '1': batch / 2" in note, note


def test_estimate_prices_a_size_no_split_explains_at_one():
    class Nonzero(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x > 0].sum() + x.sum()

    graph = torch.export.export(Nonzero(), (torch.randn(4, 3),)).graph
    found, notes = estimate(graph)
    assert list(found.values()) == [1] and len(notes) == 1
    assert "priced at 1 (nothing to derive them from)" in notes[0], notes


def test_a_model_routing_by_data_dependent_splits_trains_exactly():
    model = _model()
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randn(8, 2, dtype=torch.float64)
    ref_loss, ref_grads = reference_step(copy.deepcopy(model), (x,), {}, y, _loss, 2)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="1f1b", loss_fn=_loss)
    assert any("data-dependent sizes" in line for line in pipe.explain().splitlines())
    loss = pipe.step(x, target=y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert sorted(assert_grads_equal(pipe, ref_grads)) == sorted(ref_grads)


def test_a_saved_program_keeps_its_size_estimates(tmp_path):
    """The estimates of data-dependent sizes are saved with the program and read back."""
    model = _model()
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="1f1b", loss_fn=_loss)
    pipe.save(tmp_path / "saved")
    loaded = pc.load(tmp_path / "saved", loss_fn=_loss)
    before = pipe.plan.captured.estimated_sizes
    after = loaded.plan.captured.estimated_sizes
    assert before and sorted(map(str, after)) == sorted(map(str, before))
    assert ({str(k): str(v) for k, v in after.items()}
            == {str(k): str(v) for k, v in before.items()})
    sizes = {str(k): v for k, v in loaded.plan.captured.sizes_at(8).items()}
    assert sizes == {str(k): v for k, v in pipe.plan.captured.sizes_at(8).items()}


def test_routed_blocks_are_costed_at_their_estimated_sizes():
    """A block whose split sizes the data decides runs on fakes at the estimates (it used to
    fail the first guard comparing two unbacked sizes and be costed at 0 FLOPs, warned)."""
    import warnings

    model = _model()
    x = torch.randn(8, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "could not be costed" would raise
        pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="1f1b",
                          loss_fn=_loss)
    flops = [b.forward_flops for b in pipe.plan.costs.blocks]
    # a micro-batch of 4 rows: the gate (4 x 4 -> 2) and two experts of 2 rows (4 x 4) each
    gate, experts = 2 * 4 * 4 * 2, 2 * (2 * 2 * 4 * 4)
    assert flops[1] == flops[4] == gate + experts
    assert flops[0] == flops[3] == 2 * 4 * 4 * 4
