"""pipecompile's runtime overhead: a 1-stage pipeline against the plain model, and the fixed
cost of one pipeline action (one process with device threads, and 2 gloo ranks).

(a) The plain model's training step on m micro-batches (zero grads, then per micro-batch
    forward, loss / m, backward) against `pc.compile(model, (x,), devices=1, schedule="gpipe",
    microbatches=m, loss_fn=...).step` on the same batch, alternating, medians. A third column
    runs the pipeline's captured stage graph in the same plain loop: the difference between the
    plain model and it is the captured graph's own speed, the rest is the runtime's.
(b) Step time against m for a tiny model with a fixed micro-batch size: the slope is what each
    micro-batch costs, so slope minus the plain model's slope, over the actions a micro-batch
    adds, is the runtime's fixed cost per action. Measured for devices=1, devices=2 in one
    process (two device threads, `Mailbox`) and 2 gloo ranks (spawned processes).

    python bench/overhead.py            # a: GPT d=128 L=4 16x64 and a tiny MLP (m=8), an MLP 32x4 (m=64)
    python bench/overhead.py --quick    # fewer repeats, smaller GPT
    python bench/overhead.py --part a   # only (a); --part b only (b)

One intra-op thread everywhere (`torch.set_num_threads(1)`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Sequence

from _common import fmt_ms, loadavg, machine, med, spawn, spread, table

import torch
import torch.nn.functional as F

import pipecompile as pc
from pipecompile import zoo


def _mlp(dim: int = 8, layers: int = 2) -> torch.nn.Module:
    """A tiny MLP: so little compute that the runtime's fixed costs dominate."""
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(dim, dim), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def _case(name: str, quick: bool, batch: int):
    """(model, x, y, loss_fn) of a benchmark case, seeded."""
    torch.manual_seed(0)
    if name == "gpt":
        dim, layers, seq = (64, 2, 32) if quick else (128, 4, 64)
        model = zoo.GPT(vocab=512, dim=dim, layers=layers, heads=4, seq=seq)
        x = torch.randint(0, 512, (batch, seq))
        return model, x, torch.randint(0, 512, (batch, seq)), zoo.lm_loss
    if name == "mlp32":  # 4 layers of width 32: the one-sample-per-micro-batch case
        model = _mlp(32, 4)
        return model, torch.randn(batch, 32), torch.randn(batch, 32), _mse
    model = _mlp()
    return model, torch.randn(batch, 8), torch.randn(batch, 8), _mse


def _plain_step(model: Callable, params: Sequence[torch.Tensor], x, y, loss_fn, m: int) -> None:
    """The plain training step on the same micro-batches as the pipeline's."""
    for p in params:
        p.grad = None
    for xc, yc in zip(x.chunk(m), y.chunk(m)):
        (loss_fn(model(xc), yc) / m).backward()


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def part_a(quick: bool) -> None:
    repeats = 15 if quick else 60
    rows = []
    # (case, batch, m): m = 8 micro-batches of 2 samples, and one sample per micro-batch
    for name, batch, m in (("gpt", 16, 8), ("mlp", 16, 8), ("mlp32", 64, 64)):
        model, x, y, loss_fn = _case(name, quick, batch)
        pipe = pc.compile(model, (x,), devices=1, schedule="gpipe", microbatches=m,
                          loss_fn=loss_fn)
        # 1f1b at one stage runs F0 B0 F1 B1 ... as the plain loop does; gpipe holds every
        # micro-batch's activations until its backward (m times the memory traffic)
        pipe1 = pc.compile(model, (x,), devices=1, schedule="1f1b", microbatches=m,
                           loss_fn=loss_fn)
        graph = pipe.runtime.workers[0].module  # the captured stage, run in the plain loop
        unflatten = pipe.program.captured.unflatten_outputs

        def graph_loss(out, yc, graph_loss_fn=loss_fn, unflatten=unflatten):
            return graph_loss_fn(unflatten(list(out)), yc)

        params = list(model.parameters())
        gparams = list(pipe.parameters())
        runs: dict[str, Callable[[], Any]] = {
            "plain model": lambda: _plain_step(model, params, x, y, loss_fn, m),
            "captured graph, plain loop": lambda: _plain_step(graph, gparams, x, y,
                                                              graph_loss, m),
            "pipe.step (devices=1, gpipe)": lambda: pipe.step(x, target=y),
            "pipe.step (devices=1, 1f1b)": lambda: pipe1.step(x, target=y),
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        for i in range(repeats + 2):
            for key, fn in runs.items():
                t = _timed(fn)
                if i >= 2:  # warm-up
                    times[key].append(t)
        base = med(times["plain model"])
        label = {"gpt": "GPT " + ("d=64 L=2 16x32" if quick else "d=128 L=4 16x64") + ", m=8",
                 "mlp": "MLP 8x8 (2 layers) batch 16, m=8",
                 "mlp32": "MLP 32x32 (4 layers) batch 64, m=64"}[name]
        for key, ts in times.items():
            rows.append([label, key, fmt_ms(med(ts)), spread(ts),
                         f"{(med(ts) / base - 1) * 100:+.1f}%",
                         f"{(med(ts) - base) * 1e6 / (2 * m):.0f}"])
    print(f"\n(a) 1-stage pipeline vs plain model, {repeats} alternating repeats, "
          f"medians; load {loadavg()}")
    print(table(rows, ["model", "system", "ms/step", "spread", "vs plain",
                       "extra us per action (2m actions)"]))


# -- (b) fixed cost per action -------------------------------------------------------------

def _fit(ms: Sequence[int], ts: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of t against m."""
    mx, my = statistics.fmean(ms), statistics.fmean(ts)
    slope = sum((a - mx) * (b - my) for a, b in zip(ms, ts)) / sum((a - mx) ** 2 for a in ms)
    return slope, my - slope * mx


def _sweep(ms: Sequence[int], repeats: int, devices: int, mb_size: int,
           barrier: Callable[[], None] = lambda: None,
           schedule: str = "gpipe") -> dict[str, dict[int, float]]:
    """Median step time per m: plain model and pipeline with `devices` devices. Every repeat
    runs every m (pipeline, then plain), so load from other work spreads over all of them."""
    torch.set_num_threads(1)
    cases = {}
    for m in ms:
        model, x, y, loss_fn = _case("mlp", True, mb_size * m)
        pipe = pc.compile(model, (x,), devices=devices, schedule=schedule, microbatches=m,
                          loss_fn=loss_fn, split_points=["2"] if devices == 2 else None)
        cases[m] = (model, list(model.parameters()), x, y, loss_fn, pipe)
    times: dict[str, dict[int, list[float]]] = {"plain": {m: [] for m in ms},
                                                "pipe": {m: [] for m in ms}}
    for i in range(repeats + 2):
        for m, (model, params, x, y, loss_fn, pipe) in cases.items():
            barrier()
            t = _timed(lambda: pipe.step(x, target=y))
            p = _timed(lambda: _plain_step(model, params, x, y, loss_fn, m))
            if i >= 2:  # warm-up
                times["pipe"][m].append(t)
                times["plain"][m].append(p)
    return {k: {m: med(ts) for m, ts in v.items()} for k, v in times.items()}


def _rank_sweep(rank: int, world: int, ms, repeats, mb_size):
    import torch.distributed as dist

    result = _sweep(ms, repeats, world, mb_size, barrier=dist.barrier)
    return result


def part_b(quick: bool) -> None:
    ms = [2, 4, 8, 16, 32] if not quick else [2, 8, 16]
    repeats = 8 if quick else 30
    mb = 2
    # (results, actions per micro-batch on the critical device, messages per micro-batch
    # there, share of the model's compute it runs): one process runs every action of both
    # device threads (they share the GIL); a rank runs its stage's F and B, one SEND, one RECV
    results = {
        "1 process, devices=1": (_sweep(ms, repeats, 1, mb), 2, 0, 1.0),
        "1 process, devices=1, 1f1b": (_sweep(ms, repeats, 1, mb, schedule="1f1b"), 2, 0, 1.0),
        "1 process, devices=2 (threads)": (_sweep(ms, repeats, 2, mb), 8, 2, 1.0),
    }
    ranks = spawn(_rank_sweep, 2, ms, repeats, mb)
    slowest = {"pipe": {m: max(r["pipe"][m] for r in ranks) for m in ms},
               "plain": ranks[0]["plain"]}
    results["2 gloo ranks (slower rank)"] = (slowest, 4, 2, 0.5)
    rows = []
    base = None
    for name, (res, actions, messages, share) in results.items():
        slope, icpt = _fit(ms, [res["pipe"][m] for m in ms])
        pslope, _ = _fit(ms, [res["plain"][m] for m in ms])
        extra = slope - share * pslope  # the runtime's own seconds per micro-batch
        base = extra if base is None else base  # the devices=1 gpipe row
        per_message = (f"{(extra - base) / messages * 1e6:.0f}" if messages else "-")
        rows.append([name, " ".join(f"{res['pipe'][m] * 1e3:.2f}" for m in ms),
                     " ".join(f"{res['plain'][m] * 1e3:.2f}" for m in ms),
                     f"{slope * 1e6:.0f}", f"{pslope * 1e6:.0f}", f"{icpt * 1e3:.2f}",
                     f"{extra * 1e6:.0f}", f"{actions}", f"{extra / actions * 1e6:.0f}",
                     per_message])
    print(f"\n(b) tiny MLP (8x8, 2 layers), micro-batch of {mb} samples, gpipe (one row 1f1b), "
          f"m in {ms}, "
          f"{repeats} repeats, medians; load {loadavg()}")
    print(table(rows, ["runtime", "pipe ms/step at each m", "plain ms/step",
                       "pipe us/mb (slope)", "plain us/mb", "pipe intercept ms",
                       "runtime us/mb (slope - share x plain)", "actions/mb",
                       "us per action", "us per message over devices=1"]))
    print("actions/mb: on the critical device (one process runs both device threads' F, B, "
          "SEND and RECV under one GIL: 8; a rank: its F, B, one SEND, one RECV). share: a rank "
          "runs half the model. Per message: (runtime us/mb - the devices=1 row's) / messages "
          "per mb there (2: one each way).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--part", choices=("a", "b", "ab"), default="ab")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    print(machine())
    if "a" in opts.part:
        part_a(opts.quick)
    if "b" in opts.part:
        part_b(opts.quick)


if __name__ == "__main__":
    main()
