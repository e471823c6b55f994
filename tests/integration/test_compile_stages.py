"""compile_stages=True: stage graphs through torch.compile (inductor) give the uncompiled
pipeline's and the unsplit model's float32 loss and gradients, under every synchronous schedule
family (zero-bubble included), with checkpointing, in eval mode, without recompiling when the
batch or sequence size changes."""

from __future__ import annotations

import copy

import pytest
import torch

import pipecompile
from pipecompile import zoo
from pipecompile.errors import ConfigError, StageExecutionError
from pipecompile.runtime.compiled import CompiledStage, compiled_graphs

from tests.distributed.ranks import run_ranks
from tests.support.reference import assert_grads_equal, reference_step

RTOL = 1e-6  # float32: relative to each gradient's largest entry

# One xdist worker runs them all, one after another: inductor keeps what it compiled on disk
# (its FX graph cache), so the later tests reuse the first's stage graphs. Spread over two
# workers, both compiled the same graphs at once from a cold cache.
pytestmark = pytest.mark.xdist_group("compile_stages")


def _model(tied: bool = True) -> zoo.GPT:
    torch.manual_seed(0)
    # float32; sequence length = hidden size: only the former may be dynamic when compiled
    return zoo.GPT(vocab=32, dim=8, layers=2, heads=2, seq=8, tied=tied)


def _batch(batch: int = 8, seq: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 32, (batch, seq), generator=g),
            torch.randint(0, 32, (batch, seq), generator=g))


def _pipe(model, x, schedule, **kw):
    return pipecompile.compile(model, (x,), devices=["cpu", "cpu"], microbatches=4,
                               schedule=schedule, loss_fn=zoo.lm_loss, **kw)


def _grads(pipe) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("schedule,checkpoint", [("gpipe", False), ("1f1b", True),
                                                 ("zb-h1", False), ("zb-h1", True)])
def test_matches_uncompiled_pipeline_and_unsplit_model(schedule, checkpoint):
    model = _model()
    x, y = _batch()
    want_loss, want_grads = reference_step(copy.deepcopy(model), (x,), {}, y, zoo.lm_loss, 4)
    plain = _pipe(copy.deepcopy(model), x, schedule, checkpoint=checkpoint)
    plain_loss = plain.step(x, target=y)
    pipe = _pipe(copy.deepcopy(model), x, schedule, checkpoint=checkpoint, compile_stages=True)
    before = compiled_graphs()
    loss = pipe.step(x, target=y)
    # a training forward per stage; checkpointing adds its forwards without autograd
    assert compiled_graphs() - before == 2 * (2 if checkpoint else 1)
    assert all(isinstance(w.module, CompiledStage) for w in pipe.runtime.workers.values())
    torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=0)
    torch.testing.assert_close(loss, plain_loss, rtol=RTOL, atol=0)
    assert_grads_equal(pipe, want_grads, rtol=RTOL)
    assert_grads_equal(pipe, _grads(plain), rtol=RTOL)


def test_other_sizes_reuse_the_code_and_updates_reach_it():
    """Another batch and sequence size run without recompiling; the optimizer's updates to the
    (same) parameter objects are what the compiled code reads; eval mode compiles its graphs."""
    model = _model()
    x, y = _batch()
    opt = lambda ps: torch.optim.SGD(ps, lr=0.5)  # noqa: E731
    plain = _pipe(copy.deepcopy(model), x, "1f1b", optimizer=opt, symbolic_sizes="all")
    pipe = _pipe(copy.deepcopy(model), x, "1f1b", optimizer=opt, compile_stages=True,
                 symbolic_sizes="all")
    # the compiled graphs read the pipeline's parameters' memory (a tied weight's second
    # stage through an alias of it)
    graph_params = {p.data_ptr() for w in pipe.runtime.workers.values()
                    for p in w.module.parameters()}
    assert {p.data_ptr() for p in pipe.parameters()} == graph_params
    pipe.step(x, target=y)
    plain.step(x, target=y)
    before = compiled_graphs()
    x2, y2 = _batch(batch=12, seq=5, seed=2)
    loss2 = pipe.step(x2, target=y2)
    assert compiled_graphs() == before  # dynamic shapes: no recompilation
    torch.testing.assert_close(loss2, plain.step(x2, target=y2), rtol=RTOL, atol=0)
    # after an update (lr 0.5) float32 rounding of two steps adds up: a looser bound
    assert_grads_equal(pipe, _grads(plain), rtol=10 * RTOL)

    pipe.eval()
    plain.eval()
    with torch.no_grad():
        got, want = pipe(x2), plain(x2)
    assert all(isinstance(w.module, CompiledStage) for w in pipe.runtime.workers.values())
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-7)
    torch.testing.assert_close(pipe.eval_step(x, target=y), plain.eval_step(x, target=y),
                               rtol=RTOL, atol=0)


def test_save_and_load_keep_compiled_stages(tmp_path):
    """A saved compiled pipeline loads compiled (the same loss); `compile_stages=False` at load
    overrides it."""
    model = _model()
    x, y = _batch()
    pipe = _pipe(model, x, "1f1b", compile_stages=True)
    pipe.save(tmp_path)
    want = pipe.step(x, target=y)
    loaded = pipecompile.load(tmp_path, loss_fn=zoo.lm_loss)
    assert loaded.plan.asked.compile_stages
    torch.testing.assert_close(loaded.step(x, target=y), want, rtol=RTOL, atol=0)
    assert all(isinstance(w.module, CompiledStage) for w in loaded.runtime.workers.values())
    plain = pipecompile.load(tmp_path, loss_fn=zoo.lm_loss, compile_stages=False)
    torch.testing.assert_close(plain.step(x, target=y), want, rtol=RTOL, atol=0)
    assert not any(isinstance(w.module, CompiledStage) for w in plain.runtime.workers.values())


def test_asynchronous_schedule_is_refused():
    x, _ = _batch()
    with pytest.raises(ConfigError, match="compile_stages=True with schedule='pipedream'"):
        _pipe(_model(tied=False), x, "pipedream", compile_stages=True,
              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def test_compiler_failure_names_the_stage(monkeypatch):
    """An inductor failure (here: one injected where inductor compiles a graph) is an error
    naming the stage and the way out, not a silent fallback."""
    import torch._inductor.compile_fx as compile_fx

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compile_fx, "compile_fx", no_compiler)
    x, y = _batch()
    pipe = _pipe(_model(), x, "gpipe", compile_stages=True)
    with pytest.raises(StageExecutionError, match=r"torch.compile failed for stage \d: "
                                                  r"RuntimeError: no C\+\+ compiler.*"
                                                  r"compile_stages=False"):
        pipe.step(x, target=y)


def _rank_step(rank):
    """On each of 2 gloo ranks: its stage compiled, one zero-bubble step; loss and grads."""
    x, y = _batch()
    pipe = pipecompile.compile(_model(), (x,), devices=2, microbatches=4, schedule="zb-h1",
                               loss_fn=zoo.lm_loss, compile_stages=True, timeout=300)
    loss = pipe.step(x, target=y)
    compiled = [isinstance(w.module, CompiledStage) for w in pipe.runtime.workers.values()]
    return {"loss": loss, "grads": _grads(pipe), "compiled": compiled}


def test_two_gloo_ranks_zero_bubble():
    x, y = _batch()
    want_loss, want_grads = reference_step(_model(), (x,), {}, y, zoo.lm_loss, 4)
    results = run_ranks(_rank_step, 2)
    for rank, result in enumerate(results):
        assert "error" not in result and "died" not in result, result
        assert result["compiled"] == [True], rank
        torch.testing.assert_close(result["loss"].float(), want_loss, rtol=RTOL, atol=0)
        for name, grad in result["grads"].items():
            scale = want_grads[name].abs().max().item()
            assert (grad - want_grads[name]).abs().max().item() <= RTOL * scale, (rank, name)
    # every parameter has its gradient on some rank
    assert set(want_grads) <= {n for r in results for n in r["grads"]}
