"""Functions run on every rank by tests/planner/test_layout_torchrun.py (importable by spawned
processes): on 4 gloo ranks, every rank passes the GLOBAL batch and the layout (P x D) is
searched (`data_parallel="auto"`, or neither `devices` nor `data_parallel`) or forced
(`devices=P` with `data_parallel="auto"`: D = 4 / P); one training step each, then the bad
inputs; then `tensor_parallel="auto"` (TENSOR_CASES). One spawn runs every case (the suite's
time goes to starting processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pipecompile as pc
from pipecompile.schedule.actions import Schedule

BATCH = 8
WORLD = 4
# name -> (compile's options, lazy: compiled without example inputs)
CASES: dict[str, tuple[dict, bool]] = {
    "declarative": ({}, True),  # neither devices nor data_parallel: the search chooses P x D
    "auto": ({"data_parallel": "auto", "fsdp": "auto"}, False),
    "4x1": ({"devices": 4, "data_parallel": "auto"}, False),
    "2x2": ({"devices": 2, "data_parallel": "auto", "fsdp": False}, False),
    "1x4 fsdp": ({"devices": 1, "data_parallel": "auto", "fsdp": True}, False),
    # a written schedule fixes P = its 2 devices: 2 x 2
    "written": ({"data_parallel": "auto", "schedule": "name: mine\n0: 0F0 0F1 0B0 0B1\n"
                 "1: 1F0 1B0 1F1 1B1"}, False),
}


def model() -> torch.nn.Module:
    """Four linear layers (seven blocks), float64: every layout of 4 ranks fits it."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).double()


def batch(rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(rows, 8, generator=g, dtype=torch.float64),
            torch.randn(rows, 4, generator=g, dtype=torch.float64))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor's all-gather is collective: every replica calls it)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _step(options: dict, lazy: bool) -> tuple[dict, pc.Pipeline]:
    x, y = batch()
    pipe = pc.compile(model(), **({} if lazy else {"example_inputs": (x,)}), loss_fn=F.mse_loss,
                      timeout=300, **options)
    loss = pipe.step(x, target=y).item()
    grads = {n: _full(p.grad).detach().clone() for n, p in pipe.named_parameters()}
    evaluated = pipe.eval_step(x, target=y).item()  # each replica its rows, the global mean
    with torch.no_grad():
        out = pipe(x)  # not split: every replica runs the global batch, returns its output
    tried = pipe.plan.search.layouts if pipe.plan.search is not None else ()
    return {"loss": loss, "layout": pipe.layout, "repr": repr(pipe), "grads": grads,
            "eval": evaluated, "out": out,
            "tried": [(c.layout.pipeline, c.layout.data_parallel, c.layout.fsdp, c.fits)
                      for c in tried]}, pipe


def _errors(pipe: pc.Pipeline) -> dict[str, str]:
    """The bad inputs: each a PipecompileError on every rank (never a hang); `pipe` runs
    1 x 4 (its steps refuse global batches that 4 replicas cannot share)."""
    x, y = batch()
    found: dict[str, str] = {}

    def expect(name, call):
        try:
            call()
        except pc.PipecompileError as exc:
            found[name] = f"{type(exc).__name__}: {exc}"
        else:
            found[name] = "no error"

    expect("pipeline does not divide", lambda: pc.compile(
        model(), (x,), devices=3, data_parallel="auto", loss_fn=F.mse_loss))
    written = Schedule.from_text("name: three\n0: 0F0 0B0\n1: 1F0 1B0\n2: 2F0 2B0")
    expect("written schedule does not divide", lambda: pc.compile(
        model(), (x,), data_parallel="auto", schedule=written, loss_fn=F.mse_loss))
    one_block = torch.nn.Linear(8, 4).double()  # P = 1 only; D = 4 does not divide 2 samples
    expect("no layout", lambda: pc.compile(
        one_block, (x[:2],), data_parallel="auto", loss_fn=F.mse_loss))
    expect("batch smaller than D", lambda: pc.compile(
        model(), (x[:2],), devices=1, data_parallel="auto", loss_fn=F.mse_loss))
    x6, y6 = batch(6)
    expect("step: batch not divisible", lambda: pipe.step(x6, target=y6))
    expect("step: batch smaller than D", lambda: pipe.step(x[:2], target=y[:2]))
    expect("devices list", lambda: pc.compile(
        model(), (x,), devices=["cpu"] * 4, data_parallel="auto", loss_fn=F.mse_loss))
    # after the refused steps the pipeline still trains (no rank was left in a collective)
    found["after"] = str(pipe.step(x, target=y).item())
    return found


def run_all(rank: int) -> dict:
    """Every case's loss, gradients (whole tensors) and layout, then the bad inputs' errors."""
    out: dict = {}
    pipes = {}
    for name, (options, lazy) in CASES.items():
        out[name], pipes[name] = _step(options, lazy)
    out["errors"] = _errors(pipes["1x4 fsdp"])
    out["tensor"] = run_tensor(rank)  # the same job: no spawn of its own
    return out


# tensor_parallel="auto" over the 4 ranks (the test GPT, 2 heads: T in {1, 2}), the global
# batch of 4 sequences with the measured link; and one sequence (D = 1) with bandwidth= given
# fast: P x T = 4, and T = 2 halves each rank's matmuls where P = 4 only queues the one
# micro-batch through more stages, so the search picks T = 2
TENSOR_CASES: dict[str, tuple[int, dict]] = {
    "tp auto": (4, {}),
    "tp auto one sequence": (1, {"bandwidth": 1e13}),
}


def _tensor_step(rows: int, options: dict) -> dict:
    from tests.distributed.tensor_parallel_cases import gpt

    model, (ids,), _, target, loss_fn = gpt()
    pipe = pc.compile(model, example_inputs=(ids[:rows],), loss_fn=loss_fn, timeout=300,
                      tensor_parallel="auto", **options)
    loss = pipe.step(ids[:rows], target=target[:rows]).item()
    grads = {n: _full(p.grad).detach().clone() for n, p in pipe.named_parameters()
             if p.grad is not None}
    tried = pipe.plan.search.layouts if pipe.plan.search is not None else ()
    return {"loss": loss, "layout": pipe.layout, "grads": grads, "explain": pipe.explain(),
            "tried": sorted({(c.layout.pipeline, c.layout.data_parallel,
                              c.layout.tensor_parallel) for c in tried})}


def _tensor_errors() -> dict[str, str]:
    """tensor_parallel="auto" asked with a fixed pipeline degree: refused on every rank."""
    from tests.distributed.tensor_parallel_cases import gpt

    model, (ids,), _, _, loss_fn = gpt()
    try:
        pc.compile(model, (ids,), devices=2, tensor_parallel="auto", loss_fn=loss_fn)
    except pc.PipecompileError as exc:
        return {"devices given": f"{type(exc).__name__}: {exc}"}
    return {"devices given": "no error"}


def run_tensor(rank: int) -> dict:
    """Each tensor-parallel case's loss, gradients (whole tensors), layout and the layouts
    searched, then the refused request's error."""
    out: dict = {name: _tensor_step(rows, options)
                 for name, (rows, options) in TENSOR_CASES.items()}
    out["errors"] = _tensor_errors()
    return out
