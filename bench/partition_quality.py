"""Partition quality: pipecompile's placement vs equal layers vs equal parameters, predicted and measured.

For each model and stage count p, four placements of the same chain of blocks:

  pipecompile   `pc.compile`'s optimal DP on the analytic cost model (FLOPs, bytes, op count),
                with the compiler's choice of block granularity (finer than whole layers when
                layers cannot balance the stages)
  pc+profile    the same on measured, stage-calibrated block times (`profile=True`,
                `example_target=`: the loss is timed too)
  equal layers  the repeated layers (the largest run named `<prefix>.<i>`) split evenly, the
                blocks before them on the first stage and after them on the last (what
                torch.distributed.pipelining's users and DeepSpeed's `uniform` do); a model
                without such a run: `uniform_bounds` over all blocks
  equal params  DeepSpeed's default `partition_method="parameters"`: `balanced_by(params per
                block, p)`

Predicted: the slowest stage under the analytic cost model (`evaluate(problem, bounds)`, on the
blocks each placement cuts: the baselines cut between whole layers), and the lower bound
max(total / p, largest block) (`lower_bound`) of pipecompile's blocks; "pc gap" is how far
pipecompile's bottleneck is above it (the DP is optimal, so any gap is the blocks' granularity).

Measured: every placement is compiled (`split_points=`) and run in ONE thread (the executor's
single-thread mode, so stages do not compete for the 2 cores); a stage's time is the median over
micro-batches of its F + B action durations (the loss on the last stage included), over
`--steps` GPipe steps. The placements are measured in turns (one step each per round) so that
load from other processes hits them alike. "vs params" = equal-params' measured slowest stage /
this placement's. "max/mean" is the measured slowest stage over the mean stage: 1.00 is a perfect
balance of the work the placement actually did (a block larger than total/p makes 1.00
unreachable; the summary's "limit" says whether the predicted lower bound is set by the largest
block or by total/p). Timings are noisy when other work shares the 2 cores: compare rows of one
model and p, which were measured in the same rounds.

    python bench/partition_quality.py           # GPT (heavy head), GPT-2, BERT, U-Net, ResNet; p=2,4
    python bench/partition_quality.py --quick
"""

from __future__ import annotations

import argparse
import re
import statistics

import _common as C
import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.passes.annotate import annotate
from pipecompile.ir.devices import DeviceSpec
from pipecompile.passes.partition import (
    PartitionProblem,
    balanced_by,
    evaluate,
    lower_bound,
    uniform_bounds,
)
from pipecompile.schedule.actions import Kind

M = 8  # micro-batches


def _models(quick: bool):
    """name -> (model factory, input, loss_fn)."""
    torch.manual_seed(0)
    d, layers, seq, vocab = (64, 4, 32, 4096) if quick else (128, 8, 64, 8192)
    ids = torch.randint(0, vocab, (16, seq))

    def heavy_gpt():
        return C.gpt(vocab=vocab, dim=d, layers=layers, heads=4, seq=seq, tied=False), C.ce

    def gpt2():
        return C.gpt2(layers=layers, dim=d, heads=4, vocab=vocab, seq=seq, tied=True)

    def bert():
        return C.bert(layers=layers, dim=d, heads=4, vocab=vocab, seq=seq)

    def unet():
        return zoo.UNet(width=8 if quick else 16), _mean_square

    def resnet():
        return zoo.ResidualCNN(width=16 if quick else 32, blocks=layers), _mean_square

    img = torch.randn(16, 3, 32 if quick else 64, 32 if quick else 64)
    small = torch.randn(16, 3, 16 if quick else 32, 16 if quick else 32)
    def heavier_gpt():
        return C.gpt(vocab=2 * vocab, dim=d, layers=layers, heads=4, seq=seq, tied=False), C.ce

    ids2 = torch.randint(0, 2 * vocab, (16, seq))
    models = {
        f"GPT heavy head (V={vocab}, untied)": (heavy_gpt, ids, _lm_target(vocab, ids)),
        f"GPT heavy head (V={2 * vocab}, untied)": (heavier_gpt, ids2, _lm_target(2 * vocab, ids2)),
        f"GPT-2 (V={vocab}, tied)": (gpt2, ids, _lm_target(vocab, ids)),
        "BERT": (bert, ids, torch.randn(16, seq, d)),
        "U-Net": (unet, img, None),
        "ResidualCNN": (resnet, small, None),
    }
    if quick:
        models = {k: v for k, v in models.items()
                  if not k.startswith(("GPT-2", "BERT", f"GPT heavy head (V={2 * vocab}"))}
    return models


def _lm_target(vocab, ids):
    return torch.randint(0, vocab, ids.shape, generator=torch.Generator().manual_seed(1))


def _mean_square(out, target):
    return out.pow(2).mean()


def equal_layers(linear, p: int) -> tuple[tuple[int, ...], str]:
    """Bounds splitting the longest run of repeated layers evenly (see the module docstring)."""
    n, groups = linear.num_blocks, {}
    for i, block in enumerate(linear.blocks):
        match = re.match(r"(.*)\.(\d+)$", block.name)
        if match:
            groups.setdefault(match.group(1), []).append(i)
    run = max(groups.values(), key=len, default=[])
    if len(run) >= max(p, 4) and run == list(range(run[0], run[-1] + 1)):
        q = uniform_bounds(len(run), p)
        return (0, *[run[0] + q[j] for j in range(1, p)], n), "layers"
    return uniform_bounds(n, p), "blocks"


def _problem(costs, p: int) -> PartitionProblem:
    return PartitionProblem(
        block_times=tuple(b.time for b in costs.blocks), cut_bytes=costs.cut_bytes,
        static_bytes=tuple(b.static_bytes for b in costs.blocks),
        activation_bytes=tuple(b.activation_bytes for b in costs.blocks),
        devices=(DeviceSpec(),) * p, inflight=(1,) * p)


def _compile(factory, x, bounds, p, linear=None, profile=False, y=None, granularity=None):
    model, loss_fn = factory()
    split = None if bounds is None else [linear.blocks[b].name for b in bounds[1:-1]]
    pipe = pc.compile(model, (x,), devices=p, microbatches=M, schedule="gpipe",
                      loss_fn=loss_fn, split_points=split, profile=profile, example_target=y,
                      granularity=granularity or (linear.granularity if linear else None))
    if bounds is not None and tuple(pipe.program.bounds) != tuple(bounds):
        raise RuntimeError(f"split_points {split} gave bounds {pipe.program.bounds}, not {bounds}")
    pipe.runtime.executor.threads = False  # one thread: stage times without core contention
    return pipe


def _stage_times(pipe) -> list[list[float]]:
    """Per stage, F+B seconds of every micro-batch of the last step."""
    per: dict[tuple[int, int], float] = {}
    for e in pipe.timeline().events:
        if e.action.kind in (Kind.F, Kind.B):
            key = (e.action.stage, e.action.microbatch)
            per[key] = per.get(key, 0.0) + e.duration
    stages = max(s for s, _ in per) + 1
    return [[t for (s, _), t in sorted(per.items()) if s == j] for j in range(stages)]


def measure(pipes: dict, x, y, steps: int) -> dict[str, list[float]]:
    """Median F+B per micro-batch of every stage, for each pipeline (measured in turns)."""
    samples = {k: None for k in pipes}
    for pipe in pipes.values():
        pipe.step(x, target=y)  # warm-up
    for _ in range(steps):
        for key, pipe in pipes.items():
            pipe.step(x, target=y)
            got = _stage_times(pipe)
            if samples[key] is None:
                samples[key] = [[] for _ in got]
            for j, ts in enumerate(got):
                samples[key][j].extend(ts)
    return {k: [statistics.median(ts) for ts in v] for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--models", nargs="+", default=None,
                        help="only models whose name contains one of these words (e.g. U-Net)")
    opts = parser.parse_args()
    steps = opts.steps or (3 if opts.quick else 7)
    torch.set_num_threads(1)
    print(f"# Partition quality: slowest stage (ms per micro-batch, F+B), {M} micro-batches of "
          f"2 samples\n{C.machine()}, 1 thread; measured = median over micro-batches and "
          f"{steps} steps; load average {C.loadavg()} at start\n")
    rows, summary = [], []
    models = {k: v for k, v in _models(opts.quick).items()
              if opts.models is None or any(w.lower() in k.lower() for w in opts.models)}
    for name, (factory, x, y) in models.items():
        for p in opts.stages:
            auto = _compile(factory, x, None, p)
            # the baselines cut between whole layers (the first granularity with p blocks)
            linear = _compile(factory, x, None, p, granularity="layer").program.linear
            mb = x.shape[0] // M
            costs = annotate(linear, microbatch_size=mb)
            problem = _problem(costs, p)
            eq, eq_how = equal_layers(linear, p)
            params = balanced_by([b.param_count for b in costs.blocks], p)
            profiled = _compile(factory, x, None, p, profile=True, y=y)
            placements = {"pipecompile": auto.program.bounds,
                          "pc+profile": profiled.program.bounds,
                          f"equal {eq_how}": eq, "equal params": params}
            built = {"pipecompile": auto, "pc+profile": profiled}
            pipes = {}
            for key, bounds in placements.items():  # one pipeline per distinct placement
                same = next((k for k in pipes if tuple(placements[k]) == tuple(bounds)), None)
                pipes[key] = (pipes[same] if same else built.get(key)
                              or _compile(factory, x, bounds, p, linear))
            # identical placements share one pipeline; measure each distinct one once
            distinct = {id(pp): (k, pp) for k, pp in pipes.items()}
            got = measure({k: pp for k, pp in distinct.values()}, x, y, steps)
            meas = {k: got[distinct[id(pp)][0]] for k, pp in pipes.items()}
            # pipecompile's placements may use finer blocks (refined): predict each placement
            # on its own pipeline's blocks, with the same analytic model
            own = {k: _problem(annotate(pp.program.linear, microbatch_size=mb), p)
                   for k, pp in built.items()}
            lb = lower_bound(own["pipecompile"])
            limit = ("block" if max(own["pipecompile"].block_times)
                     >= sum(own["pipecompile"].block_times) / p else "total/p")
            base = max(meas["equal params"])
            for key, bounds in placements.items():
                pred = evaluate(own.get(key, problem), bounds).bottleneck
                m_max = max(meas[key])
                blocks = built[key].program.linear.granularity if key in built else "layer"
                rows.append((name, p, key, f"{tuple(bounds)} {blocks}", f"{pred * 1e3:.2f}",
                             f"{m_max * 1e3:.2f}",
                             " / ".join(f"{t * 1e3:.1f}" for t in meas[key]),
                             f"{m_max / statistics.mean(meas[key]):.2f}",
                             f"{base / m_max:.2f}x"))
            pc_pred = evaluate(own["pipecompile"], placements["pipecompile"]).bottleneck
            summary.append((name, p, f"{lb * 1e3:.2f} ({limit})",
                            f"{(pc_pred / lb - 1) * 100:+.1f}%",
                            *[f"{max(meas[k]) / statistics.mean(meas[k]):.2f}"
                              for k in ("pipecompile", "pc+profile")],
                            *[f"{base / max(meas[k]):.2f}x" for k in ("pipecompile", "pc+profile")]))
            print(f"done: {name}, p={p}", flush=True)
    print()
    print(C.table(rows, ("model", "p", "placement", "bounds", "pred. max ms", "meas. max ms",
                         "measured stages ms", "max/mean", "vs params")))
    print()
    print(C.table(summary, ("model", "p", "lower bound ms (limit)", "pc gap to LB (pred.)",
                            "pc max/mean (meas.)", "pc+profile max/mean (meas.)", "pc vs params",
                            "pc+profile vs params")))


if __name__ == "__main__":
    main()
