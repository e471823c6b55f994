"""bench/gpu.py's correctness sections: exactness on the device, memory against the planner,
compiled stages. Each fills its result dict as it goes, so a failure keeps what ran before it.

Exactness: GPT-2 and Llama (transformers, tiny configs, `use_cache=False`) at 1 and 2 stages on
one device (`devices=[dev] * 2`: two device threads, each with its own CUDA stream), gpipe /
1f1b / zb-h1; per case the loss and every gradient against the unsplit model's plain step on
the same device and micro-batches, float32 (bar 1e-5 relative) and under bf16 autocast (the
reference under the same autocast; bar 2e-2 relative, about three bf16 ulps: the same ops in
the same order should be far closer, a larger error means the split computes something else).
"""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Iterator

import torch

import pipecompile as pc

from _gpu_common import (LLAMA_100M, TINY, Ctx, alternating, fresh_thread_state, gpt2,
                         grad_errors, llama, log,
                         med, own_loss, param_count, plain_step, reference, rel_error,
                         token_ids)

FLOAT32_BAR = 1e-5
BF16_BAR = 2e-2
MODES = (("float32", None, FLOAT32_BAR), ("bf16 autocast", torch.bfloat16, BF16_BAR))
FAMILIES = {"gpt2": gpt2, "llama": llama}
SCHEDULES = ("gpipe", "1f1b", "zb-h1")


def _cases(dry: bool) -> list[tuple[str, int, str]]:
    """(family, stages, schedule); a family "<name> from cpu" is the model left on the CPU and
    compiled for the device (its parameters are copied there; the graph was traced on the CPU)."""
    if dry:  # every code path once: both families, 1 and 2 stages, each schedule
        return [("llama", 1, "gpipe"), ("llama", 2, "zb-h1"), ("gpt2", 2, "1f1b")]
    return ([(f, s, sch) for f in FAMILIES for s in (1, 2) for sch in SCHEDULES]
            + [("llama from cpu", 2, "1f1b")])


def _compile(model: torch.nn.Module, ids: torch.Tensor, ctx: Ctx, stages: int, m: int,
             schedule: str, **options: Any) -> pc.Pipeline:
    return pc.compile(model, (ids,), {"labels": ids}, devices=[ctx.device] * stages,
                      microbatches=m, schedule=schedule, loss_fn=own_loss, checkpoint=False,
                      **options)


def exactness(ctx: Ctx, out: dict[str, Any]) -> None:
    rows: list[dict[str, Any]] = []
    out.update(float32_bar=FLOAT32_BAR, bf16_bar=BF16_BAR, rows=rows,
               sizes={k: v for k, v in TINY.items()})
    cases = _cases(ctx.dry)
    refs: dict[tuple[str, str], tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
    models: dict[str, torch.nn.Module] = {}
    ids = token_ids(TINY["vocab"], TINY["batch"], TINY["seq"], ctx.device)
    for done, (family, stages, schedule) in enumerate(cases):
        if ctx.over_budget():
            out["skipped"] = [f"{f} {s} stages {sch}" for f, s, sch in cases[done:]]
            log(f"exactness: over budget, {len(cases) - done} cases left out")
            break
        name = family.split()[0]
        if name not in models:
            torch.manual_seed(0)
            models[name] = FAMILIES[name](**TINY).to(ctx.device)
            for mode, amp, _ in MODES:
                refs[name, mode] = reference(models[name], ids, TINY["m"], ctx, amp)
        model = copy.deepcopy(models[name])
        try:
            if family.endswith("from cpu"):
                model, example = model.cpu(), ids.cpu()
            else:
                example = ids
            pipe = _compile(model, example, ctx, stages, TINY["m"], schedule)
        except Exception as exc:  # noqa: BLE001 - recorded; the next case runs
            rows.append(dict(model=family, stages=stages, schedule=schedule, ok=False,
                             dtype="compile", error=f"{type(exc).__name__}: {exc}"[:600]))
            log(f"exactness: {family} {stages} stage(s) {schedule}: {rows[-1]['error'][:200]}")
            continue
        for mode, amp, bar in MODES:
            row: dict[str, Any] = dict(model=family, stages=stages, schedule=schedule,
                                       dtype=mode, bar=bar)
            try:
                fresh_thread_state()  # one case's failure cannot reach the next
                with ctx.autocast(amp):
                    loss = pipe.step(ids, labels=ids)
                ref_loss, ref_grads = refs[name, mode]
                err, worst, count = grad_errors(pipe.named_parameters(), ref_grads)
                row.update(loss_rel_err=rel_error(loss, ref_loss), grad_rel_err=err,
                           worst_param=worst, params_compared=count,
                           on_device=str(next(pipe.parameters()).device))
                row["ok"] = row["loss_rel_err"] <= bar and err <= bar
            except Exception as exc:  # noqa: BLE001 - one case's failure is a result
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:600])
            rows.append(row)
            log(f"exactness: {family} {stages} stage(s) {schedule} {mode}: "
                + (f"loss {row['loss_rel_err']:.2e} grads {row['grad_rel_err']:.2e}"
                   if "error" not in row else row["error"][:200]))
    out["compile_failures"] = sum(1 for r in rows if r["dtype"] == "compile")
    for mode, _, _ in MODES:
        errs = [max(r["loss_rel_err"], r["grad_rel_err"]) for r in rows
                if r["dtype"] == mode and "error" not in r]
        key = mode.replace(" ", "_")
        out[f"{key}_max_rel_err"] = max(errs) if errs else None
        out[f"{key}_all_ok"] = bool(rows) and all(r["ok"] for r in rows if r["dtype"] == mode)
        out[f"{key}_failures"] = sum(1 for r in rows if r["dtype"] == mode and "error" in r)


def memory(ctx: Ctx, out: dict[str, Any]) -> None:
    """The ~100M Llama (float32, AdamW, 1f1b, 4 micro-batches; sequence halved), 1 and 2 stages
    on the one device: the allocator's peak during the second step (the first made AdamW's
    state) against the plan's predicted memory. With 2 stages both share the device, so the
    device's peak is compared with the sum of the stages' predictions (their peaks need not
    coincide: the sum is an upper bound); per stage, `pipe.memory_stats()` (parameters,
    gradients, optimizer state, saved activations) against the prediction."""
    size = ctx.size(LLAMA_100M)
    size["seq"] //= 2
    rows: list[dict[str, Any]] = []
    out.update(rows=rows, model=f"llama hidden {size['hidden']} x {size['layers']} layers, "
               f"micro-batch {size['mb']} x {size['seq']}, m={size['m']}, float32, AdamW")
    ids = token_ids(size["vocab"], size["mb"] * size["m"], size["seq"], ctx.device)
    for stages in (1, 2):
        if ctx.over_budget():
            out["skipped"] = f"{stages} stages: over budget"
            break
        torch.manual_seed(0)  # built on the device: the stages share its tensors
        pipe = _compile(llama(**size).to(ctx.device), ids, ctx, stages, size["m"], "1f1b",
                        optimizer=lambda p: torch.optim.AdamW(p))
        pipe.step(ids, labels=ids)  # AdamW's state exists after the first step
        ctx.sync()
        base = peak = None
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        pipe.step(ids, labels=ids)
        ctx.sync()
        if ctx.cuda:
            peak = torch.cuda.max_memory_allocated()
        stats = pipe.memory_stats()
        predicted = [s.cost.memory for s in pipe.program.stages]
        if stages == 1:  # what the prediction was made from
            captured = pipe.plan.captured
            blocks = sorted(zip(pipe.plan.linear.blocks, pipe.plan.costs.blocks),
                            key=lambda bc: -bc[1].activation_bytes)
            out["capture"] = dict(
                method=captured.method, dynamic_batch=captured.dynamic_batch,
                captured_batch_size=captured.captured_batch_size,
                example_sizes=str(dict(captured.example_sizes)),
                inflight=pipe.program.stages[0].cost.inflight,
                attention_ops=str(sorted({str(n.target) for n in captured.module.graph.nodes
                                          if "attention" in str(n.target)})),
                activation_bytes_per_microbatch=sum(c.activation_bytes
                                                    for _, c in blocks),
                largest_blocks=", ".join(f"{b.name} {c.activation_bytes:.3g}"
                                         for b, c in blocks[:4]))
        for d in stats:
            rows.append(dict(stages=stages, device=d.device, place=d.place,
                             plan_stages=str(d.stages), measured_total=d.total,
                             params=d.parameters, grads=d.gradients, optim=d.optimizer_state,
                             activations=d.activations, predicted_total=d.predicted_total,
                             predicted_activations=d.predicted_activations,
                             predicted_over_measured=d.ratio))
        rows.append(dict(stages=stages, device="whole device", place=ctx.device,
                         measured_total=peak, allocated_before_step=base,
                         predicted_total=sum(predicted),
                         predicted_over_measured=(sum(predicted) / peak) if peak else None))
        log(f"memory: {stages} stage(s): device peak {peak}, predicted {sum(predicted):.4g}")
        del pipe


@contextlib.contextmanager
def _backend(backend: str | None) -> Iterator[None]:
    """torch.compile with `backend` in place of the one asked for (None: unchanged)."""
    if backend is None:
        yield
        return
    original = torch.compile

    def patched(*args: Any, **kwargs: Any) -> Any:
        kwargs["backend"] = backend
        return original(*args, **kwargs)

    torch.compile = patched  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original  # type: ignore[assignment]


def compiled_stages(ctx: Ctx, out: dict[str, Any]) -> None:
    """A small Llama, 2 stages on the device, 1f1b, float32: compile_stages=True against the
    eager stages and the unsplit model; first step (compilation included) and median steps."""
    size = dict(TINY) if ctx.dry else dict(hidden=256, layers=4, heads=4, kv=2, ffn=512,
                                           vocab=1024, seq=256, batch=16, m=4)
    torch.manual_seed(0)
    model = llama(**size).to(ctx.device)
    ids = token_ids(size["vocab"], size["batch"], size["seq"], ctx.device)
    ref_loss, ref_grads = reference(model, ids, size["m"], ctx, None)
    out.update(model=f"llama hidden {size['hidden']} x {size['layers']} layers, batch "
               f"{size['batch']} x {size['seq']}, m={size['m']}, 2 stages, 1f1b, float32",
               params=param_count(model), bar=FLOAT32_BAR)
    pipes = {}
    if ctx.dry:  # dynamo and AOTAutograd as on the GPU; inductor's C++ build takes minutes here
        out["backend"] = "aot_eager (dry run)"
    for name, flag in (("eager", False), ("compiled", True)):
        with _backend("aot_eager" if ctx.dry else None):
            pipes[name] = _compile(copy.deepcopy(model), ids, ctx, 2, size["m"], "1f1b",
                                   compile_stages=flag)
        ctx.sync()
        t = time.perf_counter()
        loss = pipes[name].step(ids, labels=ids)
        ctx.sync()
        out[f"{name}_first_step_s"] = time.perf_counter() - t
        err, worst, _ = grad_errors(pipes[name].named_parameters(), ref_grads)
        out[f"{name}_loss_rel_err"] = rel_error(loss, ref_loss)
        out[f"{name}_grad_rel_err"] = err
        out[f"{name}_worst_param"] = worst
        log(f"compiled: {name} first step {out[f'{name}_first_step_s']:.1f} s, grads {err:.2e}")
    out["exact"] = all(out[f"{n}_{k}_rel_err"] <= FLOAT32_BAR for n in pipes
                       for k in ("loss", "grad"))
    if ctx.over_budget():
        out["skipped"] = "timing: over budget"
        return
    times = alternating({n: (lambda p=p: p.step(ids, labels=ids)) for n, p in pipes.items()},
                        ctx, reps=2 if ctx.dry else 8, warmup=1)
    out["eager_step_ms"] = med(times["eager"]) * 1e3
    out["compiled_step_ms"] = med(times["compiled"]) * 1e3
    out["compiled_over_eager"] = med(times["compiled"]) / med(times["eager"])
    plain = alternating({"plain": lambda: plain_step(model, ids, size["m"], ctx)}, ctx,
                        reps=2 if ctx.dry else 8, warmup=1)
    out["plain_model_step_ms"] = med(plain["plain"]) * 1e3
