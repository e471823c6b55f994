"""pipecompile vs DeepSpeed vs torch.distributed.pipelining: one torchrun job, 2 gloo ranks, 1F1B.

All three systems train the same model with the same weights, data, split, schedule, loss and
optimizer, in the same two processes (gloo on loopback, `torch.set_num_threads(1)` per rank):

    model     a GPT (zoo.GPT's layers, untied) as a flat list of layers: embedding (token +
              position), L blocks, head (ln_f + lm_head); float32, cross-entropy over the vocab
    split     before block L/2 on every system: pipecompile `split_points=["layers.<L/2>"]`,
              torch.distributed.pipelining `split_spec={"layers.<L/2>": BEGINNING}`, DeepSpeed
              `PipelineModule(partition_method="uniform")` over the L + 2 layers, which cuts at
              the same place (embedding + L/2 blocks | L/2 blocks + head); each split is printed
    step      1F1B over m=8 micro-batches of a 16-sample batch, then one SGD step (DeepSpeed's
              `engine.train_batch` includes the optimizer step, so the others do one too:
              pipecompile `optimizer=` in compile, torch pipelining `opt.step()`); no gradient
              clipping (DeepSpeed's default of 1.0 is turned off in its config)

Rounds alternate the order (round r rotates the list of systems by r); each round times `--steps`
steps of every system between two barriers after one warm-up step. The 1F1B bound is measured in
the same job and rotation: the unsplit model's step (same micro-batches, same SGD step, one
process) timed on rank 0 while rank 1 waits at the barrier; bound = T1 / 2 * (m + 1) / m, and
efficiency = bound / measured 2-rank step. "halves at once" has each rank train its own half of
the model at the same moment, without messages: the stages' compute with both cores busy, which
T1 / 2 does not see; machine bound = that * (m + 1) / m. "pipecompile compiled" is pipecompile
with `compile_stages=True` (torch.compile per stage) and "deepspeed compiled" is DeepSpeed's own
`engine.compile()` (inductor): both reported apart from the eager, like-for-like targets.
"pipecompile auto" is the declarative call, `compile(model, devices=2)` with the same loss and
optimizer (and `example_target=`, so that planning times the loss): the compiler picks schedule,
micro-batch count and cuts. It is compared with DeepSpeed at m = 8 and at the other micro-batch
counts a user would try by hand ("deepspeed m=4", "deepspeed m=2": the same 16-sample batch in
fewer, larger micro-batches, same update), and pipecompile's 1F1B at those counts ("pipecompile
m=4", "pipecompile m=2"). The first two steps' losses of every pipeline (from the same initial
weights) are printed and checked: equal losses show that the systems do the same work.

    DS_BUILD_OPS=0 pip install deepspeed==0.19.8      # benchmark-only; skipped if not importable
    torchrun --nproc-per-node 2 bench/vs_peers.py             # d=128, 8 layers, batch 16x64
    torchrun --nproc-per-node 2 bench/vs_peers.py --quick     # d=64, 4 layers, batch 16x32
    torchrun --nproc-per-node 2 bench/vs_peers.py --overhead  # d=16, 8 layers, 32x8, m=32

`--overhead` is the overhead-bound mode: so little compute per micro-batch (one sample of 8
tokens through d=16 layers) that each system's fixed cost per action decides the step. It runs
pipecompile, DeepSpeed, torch.distributed.pipelining and the 1-process bound, and prints each
system's cost per action: (median step - T1 / 2) / (4 m), where T1 / 2 is half the unsplit
model's step (the compute of one rank) and 4 m the actions of a rank's 1F1B step (F, B, one
SEND, one RECV per micro-batch).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is imported

import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import pipecompile as pc  # noqa: E402
from pipecompile import zoo  # noqa: E402

__all__ = ["FlatGPT", "main"]

LR = 1e-3
BOUND = "1-process bound"
HALVES = "halves at once"
COMPILED = "pipecompile compiled"
DS_COMPILED = "deepspeed compiled"
AUTO = "pipecompile auto"
DS_M4, DS_M2 = "deepspeed m=4", "deepspeed m=2"
PC_M4, PC_M2 = "pipecompile m=4", "pipecompile m=2"
SYSTEMS = ("pipecompile", "deepspeed", "torch.pipelining", BOUND, HALVES, COMPILED, DS_COMPILED,
           AUTO, DS_M4, DS_M2, PC_M4, PC_M2)
OVERHEAD_SYSTEMS = ("pipecompile", "deepspeed", "torch.pipelining", BOUND)
NOT_PEERS = ("pipecompile", COMPILED, BOUND, HALVES, AUTO, PC_M4, PC_M2)  # no speedup column
OTHER_M = (AUTO, DS_M4, DS_M2, PC_M4, PC_M2)  # at another micro-batch count: not vs m=8 bounds


class Embed(nn.Module):
    """Token + position embedding: the first layer of the flat list."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding):
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Head(nn.Module):
    """Final layer norm + LM head: the last layer of the flat list."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear):
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class FlatGPT(nn.Module):
    """zoo.GPT (untied, seed 0) regrouped as embed, layers.0..L-1, head: one tensor in and out
    of every layer, as DeepSpeed's PipelineModule needs; the same weights for every system."""

    def __init__(self, opts: argparse.Namespace):
        super().__init__()
        torch.manual_seed(0)
        g = zoo.GPT(vocab=opts.vocab, dim=opts.dim, layers=opts.layers, heads=opts.heads,
                    seq=opts.seq, tied=False)
        self.embed = Embed(g.wte, g.wpe)
        self.layers = g.layers
        self.head = Head(g.ln_f, g.lm_head)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def flat(self) -> list[nn.Module]:
        return [self.embed, *self.layers, self.head]


@dataclass(frozen=True)
class System:
    """A built system: `step()` runs one training step and returns the mean loss where this
    rank has it (else None); `split` names what each stage holds."""

    step: Callable[[], Any]
    split: str


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def _pipecompile(x, y, opts, rank: int, m: int | None = None,
                 compile_stages: bool = False) -> System:
    """1F1B at the shared cut. `compile_stages=True` ("pipecompile compiled") puts each stage
    graph through torch.compile: not like-for-like (the peers run eager), reported apart."""
    cut = f"layers.{opts.layers // 2}"
    pipe = pc.compile(FlatGPT(opts), (x,), devices=2, microbatches=m or opts.m, schedule="1f1b",
                      loss_fn=C.ce, optimizer=_sgd, split_points=[cut], checkpoint=False,
                      compile_stages=compile_stages)
    return System(lambda: pipe.step(x, target=y), " | ".join(C.block_names(pipe)))


def _pipecompile_auto(x, y, opts, rank: int) -> System:
    """`compile(model, devices=2)`: the compiler picks schedule, micro-batch count, virtual
    stages, cuts and recomputation itself (same batch, loss and SGD step as every row)."""
    # the example target lets the planning probe time the loss, as a lazy compile's first step
    pipe = pc.compile(FlatGPT(opts), (x,), devices=2, loss_fn=C.ce, optimizer=_sgd,
                      example_target=y)
    sched = pipe.plan.schedule
    return System(lambda: pipe.step(x, target=y),
                  f"{' | '.join(C.block_names(pipe))} ({sched.name}, m={sched.num_microbatches})")


def _torch_pipelining(x, y, opts, rank: int) -> System:
    cut = f"layers.{opts.layers // 2}"
    stage, sched = C.pipelining_stage(FlatGPT(opts), x, cut, rank, opts.m, "1f1b", C.ce)
    opt = _sgd(stage.submod.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x, return_outputs=False)
        else:
            sched.step(target=y, losses=losses, return_outputs=False)
        opt.step()
        return torch.stack(losses).mean() if losses else None

    return System(step, f"embed..layers.{opts.layers // 2 - 1} | {cut}..head")


def _deepspeed(x, y, opts, rank: int, compiled: bool = False, m: int | None = None) -> System:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")  # reuses this job's process group
    model = FlatGPT(opts)
    names = ["embed", *(f"layers.{i}" for i in range(opts.layers)), "head"]
    pm = PipelineModule(layers=model.flat(), num_stages=2, loss_fn=C.ce,
                        partition_method="uniform")
    # gradient_clipping: DeepSpeed clips at norm 1.0 unless told (0 = off); the others do not
    m = m or opts.m
    config = {"train_batch_size": opts.batch, "train_micro_batch_size_per_gpu": opts.batch // m,
              "gradient_accumulation_steps": m, "gradient_clipping": 0.0,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=pm, optimizer=_sgd(pm.parameters()), config=config)
    if engine.gradient_clipping():
        raise RuntimeError(f"DeepSpeed clips gradients at {engine.gradient_clipping()}; the "
                           f"others do not: the comparison would not be equal work")
    if compiled:
        engine.compile()  # torch.compile of the stage's module (DeepSpeed's own option)
        if not engine.is_compiled:
            raise RuntimeError("DeepSpeed's engine.compile() left the module uncompiled")
    torch.set_num_threads(1)  # whatever deepspeed set, one intra-op thread as the others
    data = itertools.cycle(list(zip(x.chunk(m), y.chunk(m))))
    parts = pm.parts  # layer index bounds per stage
    split = " | ".join(f"{names[a]}..{names[b - 1]}" for a, b in zip(parts, parts[1:]))
    return System(lambda: engine.train_batch(data), split)


def _unsplit(x, y, opts, rank: int) -> System:
    """The whole model in one process (rank 0; rank 1 only meets the barriers)."""
    model = FlatGPT(opts)
    opt = _sgd(model.parameters())
    mbs = list(zip(x.chunk(opts.m), y.chunk(opts.m)))

    def step():
        if rank != 0:
            return None
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for xi, yi in mbs:
            loss = C.ce(model(xi), yi)
            (loss / opts.m).backward()
            total += loss.detach()
        opt.step()
        return total / opts.m

    return System(step, "embed..head on rank 0")


def _halves(x, y, opts, rank: int) -> System:
    """Each rank trains its own half of the model at the same time, with no messages: rank 0
    embed + the first L/2 blocks (backward from a fixed gradient), rank 1 the other blocks + the
    head and the loss (from a fixed input: the first half's output at the initial weights). The
    step time is what the two stages' compute alone takes when both cores work at once, the
    floor under any 2-rank pipeline on this machine, which T1 / 2 does not see (two processes
    computing at once slow each other down: shared caches, memory bandwidth, the VM)."""
    model, cut, m = FlatGPT(opts), opts.layers // 2, opts.m
    layers = model.flat()
    first, second = nn.Sequential(*layers[:cut + 1]), nn.Sequential(*layers[cut + 1:])
    with torch.no_grad():
        mid = first(x)
    g = torch.Generator().manual_seed(2)
    grads = torch.randn(mid.shape, generator=g).chunk(m)
    half = first if rank == 0 else second
    opt = _sgd(half.parameters())
    inputs = list(zip(x.chunk(m) if rank == 0 else mid.chunk(m), y.chunk(m), grads))

    def step():
        opt.zero_grad(set_to_none=True)
        for xi, yi, gi in inputs:
            out = half(xi)
            if rank == 0:
                out.backward(gi)
            else:
                (C.ce(out, yi) / m).backward()
        opt.step()
        return None  # not the pipeline's loss after step 1: left out of the loss check

    return System(step, f"embed..layers.{cut - 1} | layers.{cut}..head, no messages")


BUILDERS = {"pipecompile": _pipecompile, "deepspeed": _deepspeed,
            "torch.pipelining": _torch_pipelining, BOUND: _unsplit, HALVES: _halves,
            COMPILED: partial(_pipecompile, compile_stages=True),
            DS_COMPILED: partial(_deepspeed, compiled=True),
            AUTO: _pipecompile_auto,
            DS_M4: partial(_deepspeed, m=4),
            DS_M2: partial(_deepspeed, m=2),
            PC_M4: partial(_pipecompile, m=4),
            PC_M2: partial(_pipecompile, m=2)}


def _timed(step: Callable[[], Any], steps: int) -> tuple[float, float]:
    """(wall, this process's CPU) seconds per step over `steps` steps between barriers."""
    return C.timed(step, steps)


def _build(opts, x, y, rank: int) -> tuple[dict[str, System], dict[str, str]]:
    """Every system that builds on both ranks (a system failing on either is left out on both)."""
    systems, errors = {}, {}
    for name in opts.systems:
        try:
            systems[name] = BUILDERS[name](x, y, opts, rank)
        except Exception as exc:  # noqa: BLE001 - reported in the output
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        failed: list[Any] = [None, None]
        dist.all_gather_object(failed, name in errors)
        if any(failed):
            systems.pop(name, None)
            errors.setdefault(name, "failed on the other rank")
    return systems, errors


def _loss(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.detach().float().mean()) if torch.is_tensor(value) else float(value)


def _run(opts) -> dict:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, opts.vocab, (opts.batch, opts.seq), generator=g)
    y = torch.randint(0, opts.vocab, (opts.batch, opts.seq), generator=g)
    systems, errors = _build(opts, x, y, rank)
    names = list(systems)
    # the first two steps' losses: from the initial weights, and after one SGD step
    first = {n: (_loss(systems[n].step()), _loss(systems[n].step())) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(opts.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            systems[n].step()  # warm-up
            wall, used = _timed(systems[n].step, opts.steps)
            times[n].append(wall)
            cpu[n].append(used)
    return {"first": first, "times": times, "cpu": cpu, "errors": errors,
            "splits": {n: s.split for n, s in systems.items()},
            "threads": torch.get_num_threads()}


def _report(per_rank: list[dict], opts, load_before: str) -> None:
    r0, r1 = per_rank
    times = r0["times"]
    print("# pipecompile vs DeepSpeed vs torch.distributed.pipelining: 1F1B, 2 gloo ranks "
          "(torchrun), 1 intra-op thread each")
    print(C.machine() + _deepspeed_version())
    print(f"model: GPT d={opts.dim}, {opts.layers} layers, {opts.heads} heads, vocab {opts.vocab}, "
          f"untied, float32; batch {opts.batch}x{opts.seq}, m={opts.m}, SGD lr={LR}; "
          f"{opts.rounds} rounds (order rotated each round) of {opts.steps} timed steps after a "
          f"warm-up; intra-op threads at the end: rank 0 {r0['threads']}, rank 1 {r1['threads']}; "
          f"load average {load_before} before, {C.loadavg()} after")
    for name, err in r0["errors"].items():
        print(f"{name}: SKIPPED ({err})")
    _check_losses(r0["first"], r1["first"])
    pc_t = times.get("pipecompile")
    rows = []
    for n, ts in times.items():
        t, best = C.med(ts), min(ts)
        if pc_t and n not in NOT_PEERS:
            speed = f"{t / C.med(pc_t):.2f}x / {best / min(pc_t):.2f}x"
        else:
            speed = "-"
        c0, c1 = C.med(r0["cpu"][n]), C.med(r1["cpu"][n])
        rows.append((n, C.fmt_ms(t), C.spread(ts), C.fmt_ms(best), speed,
                     f"{c0 * 1e3:.0f} / {c1 * 1e3:.0f}", r0["splits"][n]))
    print()
    print(C.table(rows, ("system", "ms/step (median)", "spread", "best ms/step",
                         "pipecompile speedup (median / best)", "CPU ms/step r0 / r1",
                         "split (stage 0 | stage 1)")))
    if BOUND in times:
        t1, t1_best = C.med(times[BOUND]), min(times[BOUND])
        factor = (opts.m + 1) / opts.m / 2
        print(f"\n1F1B bound = T1 / 2 * (m + 1) / m: median {C.fmt_ms(t1 * factor)} ms "
              f"(T1 {C.fmt_ms(t1)}), best {C.fmt_ms(t1_best * factor)} ms (T1 {C.fmt_ms(t1_best)})")
        _efficiencies(times, "bound", t1 * factor, t1_best * factor)
    if HALVES in times:
        h, h_best = C.med(times[HALVES]), min(times[HALVES])
        factor = (opts.m + 1) / opts.m
        print(f"\nmachine bound = halves at once * (m + 1) / m: median {C.fmt_ms(h * factor)} ms, "
              f"best {C.fmt_ms(h_best * factor)} ms (the stages' compute with both cores busy)")
        if BOUND in times:
            print(f"  two cores at once run each half {h / (C.med(times[BOUND]) / 2):.2f}x "
                  f"slower than half the 1-process step (medians)")
        _efficiencies(times, "machine bound", h * factor, h_best * factor)
    if BOUND in times and opts.overhead:
        half = C.med(times[BOUND]) / 2
        print(f"\ncost per action = (median step - T1 / 2) / (4 m), T1 / 2 = {C.fmt_ms(half)} ms, "
              f"4 m = {4 * opts.m} actions per rank and step:")
        for n in times:
            if n != BOUND:
                print(f"  {n:<18} {(C.med(times[n]) - half) / (4 * opts.m) * 1e6:.0f} us")
    if pc_t:
        print("\ntargets (medians): ", end="")
        checks = ([("deepspeed", 1.1), ("torch.pipelining", 2.0)] if opts.overhead
                  else [("deepspeed", 1.15), ("torch.pipelining", 1.3)])
        out = [f">= {need}x {n} (eager pipecompile): {C.med(times[n]) / C.med(pc_t):.2f}x "
               f"{'met' if C.med(times[n]) / C.med(pc_t) >= need else 'NOT met'}"
               for n, need in checks if n in times]
        if BOUND in times:
            eff = C.med(times[BOUND]) * (opts.m + 1) / opts.m / 2 / C.med(pc_t)
            out.append(f">= 90% of the bound: {eff:.0%} {'met' if eff >= 0.9 else 'NOT met'}")
        print("; ".join(out))
    if AUTO in times:
        at = C.med(times[AUTO])
        ds = {n: C.med(times[n]) for n in ("deepspeed", DS_M4, DS_M2) if n in times}
        line = f"declarative (compile(model, devices=2), {r0['splits'][AUTO].rsplit('(', 1)[-1]}: "
        line += "; ".join(f"{C.med(times[n]) / at:.2f}x {n}" for n in
                          ("pipecompile", *ds, "torch.pipelining") if n in times)
        if ds:
            best = min(ds, key=ds.get)
            line += f"; vs DeepSpeed's best m ({best}): {ds[best] / at:.2f}x"
        print(line)
    same_m = [(pm, dm) for pm, dm in (("pipecompile", "deepspeed"), (PC_M4, DS_M4),
                                      (PC_M2, DS_M2)) if pm in times and dm in times]
    if same_m:
        print("1F1B at the same m and split: " + "; ".join(
            f"{pm} {C.med(times[dm]) / C.med(times[pm]):.2f}x {dm}" for pm, dm in same_m))
    if COMPILED in times:
        ct = C.med(times[COMPILED])
        print(f"compiled stages (compile_stages=True): "
              + "; ".join(f"{C.med(times[n]) / ct:.2f}x {n}" for n in
                          ("pipecompile", "deepspeed", "torch.pipelining") if n in times))


def _efficiencies(times: dict, label: str, bound: float, bound_best: float) -> None:
    """Per m=8 pipeline row: `label` / its step, for the medians and for the best rounds."""
    for n, ts in times.items():
        if n not in (BOUND, HALVES, *OTHER_M):
            print(f"  {n:<20} efficiency = {label} / step: {bound / C.med(ts):.0%} "
                  f"(median), {bound_best / min(ts):.0%} (best)")


def _check_losses(first0: dict, first1: dict) -> None:
    """Print the first two steps' losses of every system (the last stage's rank has them) and
    whether they agree: equal losses mean equal weights, data, split and SGD step."""
    print("\nloss of step 1 (initial weights) and step 2 (after one SGD step), same data:")
    losses = {n: tuple(b if b is not None else a for a, b in zip(first0[n], first1[n]))
              for n in first0 if n != HALVES}
    for n, (a, b) in losses.items():
        print(f"  {n:<18} {a:.8f}  {b:.8f}")
    for i in (0, 1):
        known = [v[i] for v in losses.values()]
        diff = max(known) - min(known)
        print(f"  step {i + 1}: max difference {diff:.2e}, "
              f"{'OK' if diff <= 1e-5 else 'MISMATCH'} (tolerance 1e-5)")


def _deepspeed_version() -> str:
    try:
        import deepspeed

        return f", deepspeed {deepspeed.__version__}"
    except Exception:  # noqa: BLE001 - the DeepSpeed rows say why they are missing
        return ", deepspeed not importable"


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="d=64, 4 layers, seq 32, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--systems", nargs="+", default=None, choices=SYSTEMS)
    parser.add_argument("--overhead", action="store_true",
                        help="overhead-bound: d=16, 8 layers, batch 32x8, m=32 (1 sample each)")
    opts = parser.parse_args()
    opts.dim, opts.layers, opts.seq = (64, 4, 32) if opts.quick else (128, 8, 64)
    opts.heads, opts.vocab, opts.batch, opts.m = 4, 512, 16, 8
    if opts.overhead:
        opts.dim, opts.layers, opts.seq, opts.heads, opts.vocab = 16, 8, 8, 2, 64
        opts.batch, opts.m = 32, 32
    opts.systems = opts.systems or (list(OVERHEAD_SYSTEMS) if opts.overhead else list(SYSTEMS))
    opts.rounds = opts.rounds or (2 if opts.quick else 5)
    opts.steps = opts.steps or (2 if opts.quick else 4)
    return opts


def main() -> None:
    opts = _options()
    torch.set_num_threads(1)
    load = C.loadavg()
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit(f"run 2 ranks (torchrun --nproc-per-node 2), not {dist.get_world_size()}")
    if "deepspeed" in opts.systems:
        try:
            import deepspeed  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - DeepSpeed is a benchmark-only dependency
            if dist.get_rank() == 0:
                print(f"DeepSpeed is not importable ({type(exc).__name__}: {exc}); skipping its "
                      f"rows. Install it with: DS_BUILD_OPS=0 pip install deepspeed==0.19.8")
            opts.systems = [s for s in opts.systems if s != "deepspeed"]
    result = _run(opts)
    per_rank: list[Any] = [None, None]
    dist.all_gather_object(per_rank, result)
    if dist.get_rank() == 0:
        _report(per_rank, opts, load)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
