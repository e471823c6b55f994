"""Any sequence length: with symbolic_sizes="all" capture keeps the non-batch sizes of batched
inputs symbolic where the model allows it, so one plan runs every length, in one process and
over gloo ranks, with the unsplit model's loss and gradients; by default ("auto") a lazy
pipeline captures the batch alone and, at the first call with another length, plans once more
with every size symbolic; a size the model fixes gets an error naming the input."""

from __future__ import annotations

import copy

import pytest
import torch

import pipecompile as pc
from pipecompile import zoo
from tests.distributed.ranks import run_ranks
from tests.distributed.training_cases import sequence_lengths
from tests.support.models import CASES
from tests.support.reference import assert_grads_equal, reference_step


@pytest.mark.parametrize("name,schedule", [("llama", "1f1b"), ("gpt2", "zb-h1")])
def test_other_sequence_lengths_match_unsplit_model(name, schedule):
    torch.manual_seed(0)
    case = CASES[name]()  # example sequence length 8
    pipe = pc.compile(case.model, case.args, devices=2, microbatches=2, schedule=schedule,
                      loss_fn=case.loss_fn, symbolic_sizes="all")
    captured = pipe.program.captured
    assert len(captured.example_sizes) == 2, "batch and sequence length are symbols"
    for seq in (5, 12):
        x = torch.randint(0, 64, (6, seq))
        y = torch.randint(0, 64, (6, seq))
        loss = pipe.step(x, target=y)
        ref_loss, ref_grads = reference_step(case.model, (x,), {}, y, case.loss_fn, 2)
        assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=0)
        assert_grads_equal(pipe, ref_grads)
        out = pipe(x)
        assert out.logits.shape == (6, seq, 64)
        torch.testing.assert_close(out.logits, case.model(x).logits, rtol=1e-12, atol=1e-12)


def test_a_lazy_pipeline_makes_the_length_symbolic_when_a_call_changes_it():
    """torch.compile's automatic dynamic shapes: the first plan keeps the batch alone symbolic;
    a call with another length plans once more with every size symbolic, and that plan runs
    every later length; each step exact against the unsplit model."""
    torch.manual_seed(0)
    case = CASES["llama"]()
    pipe = pc.compile(case.model, devices=2, microbatches=2, schedule="1f1b",
                      loss_fn=case.loss_fn)
    symbols = []
    for seq in (8, 5, 12, 8):
        x = torch.randint(0, 64, (4, seq))
        y = torch.randint(0, 64, (4, seq))
        loss = pipe.step(x, target=y)
        symbols.append(len(pipe.program.captured.example_sizes))
        ref_loss, ref_grads = reference_step(case.model, (x,), {}, y, case.loss_fn, 2)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
        assert_grads_equal(pipe, ref_grads)
    # first plan: the batch alone; the length 5 made a plan with both; 12 ran on it; 8 on the
    # first plan again
    assert symbols == [1, 2, 2, 1]
    assert len(pipe._plans.kept) == 2


def test_other_sequence_lengths_on_two_ranks():
    results = run_ranks(sequence_lengths, 2)
    torch.manual_seed(0)
    case = CASES["gpt"]()
    for seq in (5, 8, 3):
        x, y = case.args[0][:, :seq], case.target[:, :seq]
        ref_loss, ref_grads = reference_step(case.model, (x,), {}, y, case.loss_fn, 2)
        with torch.no_grad():
            ref_out = case.model(x)
        for rank in results:
            got = rank[seq]
            assert torch.allclose(got["loss"], ref_loss, rtol=1e-12, atol=0)
            assert got["out"].shape == (8, seq, 64)
            torch.testing.assert_close(got["out"], ref_out, rtol=1e-12, atol=1e-12)
            assert got["grads"], "each rank holds gradients of its stages"
            for name, grad in got["grads"].items():
                torch.testing.assert_close(grad, ref_grads[name], rtol=1e-10, atol=1e-12)


class FixedLength(torch.nn.Module):
    """Its code fixes the sequence length: a position table added by broadcasting."""

    def __init__(self, seq: int = 6, dim: int = 4):
        super().__init__()
        self.pos = torch.nn.Parameter(torch.randn(seq, dim))
        self.a = torch.nn.Linear(dim, dim)
        self.b = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x + self.pos)))


def test_size_the_model_fixes_is_named_in_the_error():
    model = FixedLength()
    x = torch.randn(4, 6, 4)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2,
                      loss_fn=lambda out, y: (out - y).pow(2).mean())
    assert pipe.program.captured.values[pipe.program.captured.input_names[0]].shape[1] == 6
    with pytest.raises(pc.ConfigError, match=r"input 'x' has size 5 in dimension 1.*fixed at 6"):
        pipe.step(torch.randn(4, 5, 4), target=torch.randn(4, 5, 4))
    with pytest.raises(pc.ConfigError, match=r"input 'x' has 2 dimensions.*compiled with 3"):
        pipe(torch.randn(4, 6))
    # the batch size still varies
    assert pipe.step(torch.randn(8, 6, 4), target=torch.randn(8, 6, 4)).dim() == 0


class Branchy(torch.nn.Module):
    """Its code branches on the sequence length: export keeps the length symbolic but assumes
    the branch taken (lengths 5 and up)."""

    def __init__(self, dim: int = 4):
        super().__init__()
        self.a = torch.nn.Linear(dim, dim)
        self.b = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if x.shape[1] > 4:
            h = h * 2
        return self.b(torch.tanh(h))


def test_size_outside_the_range_export_assumed_is_refused_not_miscomputed():
    model = Branchy().double()
    x = torch.randn(4, 6, 4, dtype=torch.float64)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, symbolic_sizes="all",
                      loss_fn=lambda out, y: (out - y).pow(2).mean())
    torch.testing.assert_close(pipe(x[:, :5]), model(x[:, :5]))  # in the range: symbolic
    with pytest.raises(pc.ConfigError, match=r"input 'x' has size 3 in dimension 1.*sizes 5\.\."):
        pipe(x[:, :3])  # the graph holds the branch of lengths > 4 only


def test_symbolic_sizes_batch_keeps_the_other_sizes_fixed():
    """symbolic_sizes="batch": only the batch varies (a faster capture for fixed lengths); the
    step is still exact and another length gets the fixed-size error."""
    torch.manual_seed(0)
    model = zoo.GPT(vocab=32, dim=8, layers=2, heads=2, seq=8).double()
    x, y = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    reference = copy.deepcopy(model)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2, schedule="1f1b",
                      loss_fn=zoo.lm_loss, symbolic_sizes="batch")
    captured = pipe.program.captured
    assert captured.values[captured.input_names[0]].shape[1] == 8
    want = zoo.lm_loss(reference(x), y)
    torch.testing.assert_close(pipe.step(x, target=y), want.detach(), rtol=1e-12, atol=0)
    with pytest.raises(pc.ConfigError,
                       match=r"size 5 in dimension 1.*symbolic_sizes='auto' or 'batch'"):
        pipe.step(x[:, :5], target=y[:, :5])
    assert pipe.step(torch.cat([x, x]), target=torch.cat([y, y])).dim() == 0  # the batch varies
    with pytest.raises(pc.ConfigError, match="symbolic_sizes='sequence'"):
        pc.compile(model, (x,), devices=2, symbolic_sizes="sequence")
