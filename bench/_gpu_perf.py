"""bench/gpu.py's timing sections: the runtime's overhead, and the H100 preset against the GPU.

Overhead: the ~100M-parameter Llama (hidden 768, 12 layers, 12 heads, vocabulary 32000,
micro-batch 4 x 1024, m=4), one stage, 1f1b (at one stage F0 B0 F1 B1 ..., the plain loop's
order): `pipe.step` against the plain model's training step on the same micro-batches (zero
grads, per micro-batch forward with labels=, loss / m, backward), alternating, medians; once
with float32 weights under bf16 autocast, once with bfloat16 weights. The fixed cost per
action is measured as bench/overhead.py measures it on the CPU: step time against the number
of micro-batches m for a tiny MLP (8x8, micro-batch of 2): (pipeline slope - plain slope) / 2
actions per micro-batch.

Preset: `pc.preset("h100")` (nothing measured) predicts, from a bfloat16 model built on meta,
one stage's forward+backward per micro-batch (the sum of its blocks' times); the same model in
bfloat16 on the GPU is timed (forward with labels=, backward). For one Llama-3-8B layer (hidden
4096, 32 heads, 8 kv heads, ffn 14336, micro-batch 1, sequence 2048 and 4096) a 1- and a
2-layer model with a small vocabulary are timed and the layer is their difference; the
prediction is the mean of the layer blocks. Microbenchmarks give the preset's constants in its
own units (fractions of the H100's datasheet peaks, seconds per op)."""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import pipecompile as pc
from pipecompile.planner import hardware

from _gpu_common import (LLAMA3_8B_LAYER, LLAMA_100M, Ctx, alternating, fit, llama, log, med,
                         own_loss, param_count, plain_step, release, spread, timed, token_ids)

__all__ = ["overhead", "preset_vs_gpu"]

H100 = hardware.ACCELERATORS["h100"]
PEAK_BF16 = H100.peak("bfloat16")


def overhead(ctx: Ctx, out: dict[str, Any]) -> None:
    size = ctx.size(LLAMA_100M)
    m, reps = size["m"], (3 if ctx.dry else 7)
    rows: list[dict[str, Any]] = []
    out.update(rows=rows, aim="pipe / plain <= 1.03",
               model=f"llama hidden {size['hidden']} x {size['layers']} layers, vocab "
               f"{size['vocab']}, micro-batch {size['mb']} x {size['seq']}, m={m}, 1 stage, 1f1b")
    ids = token_ids(size["vocab"], size["mb"] * m, size["seq"], ctx.device)
    for label, weights, amp in (("fp32 weights, bf16 autocast", torch.float32, torch.bfloat16),
                                ("bf16 weights", torch.bfloat16, None)):
        if ctx.over_budget():
            out.setdefault("skipped", []).append(label)
            continue
        row: dict[str, Any] = {"variant": label}
        rows.append(row)
        try:
            torch.manual_seed(0)
            model = llama(**size).to(ctx.device, weights)
            row["params"] = param_count(model)
            pipe = pc.compile(copy.deepcopy(model), (ids,), {"labels": ids},
                              devices=[ctx.device], microbatches=m, schedule="1f1b",
                              loss_fn=own_loss, checkpoint=False)

            def piped(pipe: pc.Pipeline = pipe, amp: torch.dtype | None = amp) -> None:
                with ctx.autocast(amp):
                    pipe.step(ids, labels=ids)

            times = alternating({"plain": lambda: plain_step(model, ids, m, ctx, amp),
                                 "pipe": piped}, ctx, reps=reps)
            plain, piped_t = med(times["plain"]), med(times["pipe"])
            row.update(plain_ms=plain * 1e3, pipe_ms=piped_t * 1e3, ratio=piped_t / plain,
                       extra_us_per_action=(piped_t - plain) * 1e6 / (2 * m),
                       plain_spread=spread(times["plain"]), pipe_spread=spread(times["pipe"]))
            log(f"overhead: {label}: plain {plain * 1e3:.2f} ms, pipe {piped_t * 1e3:.2f} ms, "
                f"ratio {piped_t / plain:.3f}")
            if ctx.cuda and not ctx.over_budget():  # where the time goes, each way
                out.setdefault("profiles", []).extend(
                    [_profile(f"{label}: plain", lambda: plain_step(model, ids, m, ctx, amp),
                              ctx),
                     _profile(f"{label}: pipe", piped, ctx)])
        except Exception as exc:  # noqa: BLE001 - the other variant still runs
            row["error"] = f"{type(exc).__name__}: {exc}"[:600]
            log(f"overhead: {label}: {row['error'][:200]}")
        release(ctx)
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    out["best_ratio"] = min(ratios) if ratios else None
    _action_cost(ctx, out)


def _profile(label: str, fn: Callable[[], Any], ctx: Ctx) -> dict[str, Any]:
    """One call of `fn` under torch.profiler: wall time, CUDA kernel time, kernel and
    synchronisation counts, and the host calls that took the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    ctx.sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        ctx.sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                    for e in events)
    kernels = sum(e.count for e in events
                  if getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                  > 0 and getattr(e, "device_type", None) is not None
                  and "cuda" in str(e.device_type).lower())
    syncs = {e.key: e.count for e in events if "Synchronize" in e.key or "WaitEvent" in e.key}
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    return dict(case=label, wall_ms=wall * 1e3, device_busy_ms=device_us / 1e3, kernels=kernels,
                syncs=str(syncs),
                top_self_cpu=", ".join(f"{e.key} x{e.count} {e.self_cpu_time_total / 1e3:.1f}ms"
                                       for e in top))


def _action_cost(ctx: Ctx, out: dict[str, Any]) -> None:
    """Fixed seconds per action from the slope of step time against m (tiny MLP)."""
    ms = [2, 8] if ctx.dry else [2, 8, 32]
    reps = 3 if ctx.dry else 5
    rows: list[dict[str, Any]] = []
    out["action_cost"] = rows
    for devices, actions in ((1, 2), (2, 8)):  # actions per micro-batch in this process
        if ctx.over_budget():
            out.setdefault("skipped", []).append(f"action cost, {devices} device(s)")
            continue
        fns: dict[str, Callable[[], Any]] = {}
        for m in ms:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                        torch.nn.Linear(8, 8), torch.nn.Tanh()).to(ctx.device)
            x = torch.randn(2 * m, 8, device=ctx.device)
            y = torch.randn(2 * m, 8, device=ctx.device)
            pipe = pc.compile(model, (x,), devices=[ctx.device] * devices, microbatches=m,
                              schedule="1f1b", loss_fn=F.mse_loss, checkpoint=False,
                              split_points=["2"] if devices == 2 else None)
            params = list(model.parameters())
            fns[f"pipe{m}"] = lambda pipe=pipe, x=x, y=y: pipe.step(x, target=y)
            fns[f"plain{m}"] = lambda model=model, params=params, x=x, y=y, m=m: _mlp_plain(
                model, params, x, y, m)
        times = {k: med(v) for k, v in alternating(fns, ctx, reps=reps).items()}
        pipe_slope = fit(ms, [times[f"pipe{m}"] for m in ms])
        plain_slope = fit(ms, [times[f"plain{m}"] for m in ms])
        per_mb = pipe_slope - plain_slope
        rows.append(dict(devices=devices, ms=str(ms),
                         pipe_ms=" ".join(f"{times[f'pipe{m}'] * 1e3:.2f}" for m in ms),
                         plain_ms=" ".join(f"{times[f'plain{m}'] * 1e3:.2f}" for m in ms),
                         runtime_us_per_mb=per_mb * 1e6, actions_per_mb=actions,
                         us_per_action=per_mb / actions * 1e6))
        log(f"overhead: action cost, {devices} device(s): {per_mb / actions * 1e6:.1f} us")
    if rows:
        ctx.shared["action_overhead_s"] = rows[0]["us_per_action"] * 1e-6
        out["us_per_action"] = rows[0]["us_per_action"]


def _mlp_plain(model: torch.nn.Module, params: list, x: torch.Tensor, y: torch.Tensor,
               m: int) -> None:
    for p in params:
        p.grad = None
    for xc, yc in zip(x.chunk(m), y.chunk(m)):
        (F.mse_loss(model(xc), yc) / m).backward()


# -- the preset against the GPU ------------------------------------------------------------

def preset_name() -> str:
    """The preset of the GPU here: "h200" on an H200, else "h100" (the dry run too)."""
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return "h200" if "h200" in name.lower() else "h100"


def _predict(size: dict, batch: int, seq: int) -> dict[str, float]:
    """The GPU's preset's forward+backward per micro-batch of a bfloat16 Llama built on meta."""
    with torch.device("meta"):
        model = llama(**dict(size, seq=seq)).to(torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    pipe = pc.compile(model, (ids,), {"labels": ids}, devices=[pc.preset(preset_name())],
                      microbatches=1, schedule="gpipe", loss_fn=own_loss, checkpoint=False)
    costs, blocks = pipe.plan.costs.blocks, pipe.plan.linear.blocks
    layers: dict[str, float] = {}
    for c, b in zip(costs, blocks):
        if b.name.startswith("model.layers."):
            key = ".".join(b.name.split(".")[:3])
            layers[key] = layers.get(key, 0.0) + c.forward_time + c.backward_time
    stage = pipe.program.stages[0].cost
    return dict(total=sum(c.forward_time + c.backward_time for c in costs),
                forward=sum(c.forward_time for c in costs),
                flops=sum(c.forward_flops for c in costs),
                layer=sum(layers.values()) / max(len(layers), 1),
                stage=stage.forward_time + stage.backward_time)


def _measure(size: dict, batch: int, seq: int, ctx: Ctx, reps: int) -> float:
    """Median seconds of forward (labels=) + backward of a bfloat16 Llama on the device."""
    torch.manual_seed(0)
    model = llama(**dict(size, seq=seq)).to(ctx.device, torch.bfloat16)
    ids = token_ids(size["vocab"], batch, seq, ctx.device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()

    return med(timed(step, ctx, reps=reps, warmup=2))


def _compare(name: str, predicted: float, measured: float, **extra: Any) -> dict[str, Any]:
    return dict(case=name, predicted_ms=predicted * 1e3, measured_ms=measured * 1e3,
                error_pct=(predicted / measured - 1) * 100, **extra)


def preset_vs_gpu(ctx: Ctx, out: dict[str, Any]) -> None:
    reps = 2 if ctx.dry else 3
    rows: list[dict[str, Any]] = []
    out.update(preset=pc.preset(preset_name()).hardware, rows=rows,
               note="error_pct = predicted / measured - 1 (positive: the preset is slower)")
    size = ctx.size(LLAMA_100M)
    pred = _predict(size, size["mb"], size["seq"])
    meas = _measure(size, size["mb"], size["seq"], ctx, reps)
    rows.append(_compare(f"llama ~100M, mb {size['mb']} x {size['seq']}, whole model",
                         pred["total"], meas, predicted_stage_ms=pred["stage"] * 1e3,
                         forward_gflop=pred["flops"] / 1e9))
    log(f"preset: 100M llama predicted {pred['total'] * 1e3:.2f} ms, measured {meas * 1e3:.2f}")
    release(ctx)
    big = ctx.size(LLAMA3_8B_LAYER)
    seqs = big.pop("seqs")
    for seq in seqs:
        if ctx.over_budget():
            out.setdefault("skipped", []).append(f"8B layer at {seq}")
            continue
        pred = _predict(dict(big, layers=2), 1, seq)
        one = _measure(dict(big, layers=1), 1, seq, ctx, reps)
        two = _measure(dict(big, layers=2), 1, seq, ctx, reps)
        rows.append(_compare(f"llama-3-8B layer, 1 x {seq}", pred["layer"], two - one))
        rows.append(_compare(f"2-layer 8B-shape model (vocab {big['vocab']}), 1 x {seq}",
                             pred["total"], two, forward_gflop=pred["flops"] / 1e9))
        log(f"preset: 8B layer at {seq}: predicted {pred['layer'] * 1e3:.2f} ms, measured "
            f"{(two - one) * 1e3:.2f} ms")
        release(ctx)
    _microbenchmarks(ctx, out)


def _microbenchmarks(ctx: Ctx, out: dict[str, Any]) -> None:
    """Matmul rate, SDPA time, memory bandwidth, launch cost; the preset's constants."""
    div = 64 if ctx.dry else 1
    reps = 3 if ctx.dry else 10
    bf16 = torch.bfloat16
    rows: list[dict[str, Any]] = []
    out["matmul"] = rows
    spec = pc.preset(preset_name())
    rate, bw = spec.rate("bfloat16"), spec.memory_bandwidth
    for mm, k, n in ((8192, 8192, 8192), (4096, 4096, 14336), (2048, 4096, 4096),
                     (16, 4096, 4096)):
        shape = (max(mm // div, 16), k // div, n // div)
        a = torch.randn(shape[0], shape[1], device=ctx.device, dtype=bf16)
        b = torch.randn(shape[1], shape[2], device=ctx.device, dtype=bf16)
        t = med(timed(lambda a=a, b=b: a @ b, ctx, reps=reps, warmup=3, inner=10))
        flops = 2 * shape[0] * shape[1] * shape[2]
        nbytes = 2 * (shape[0] * shape[1] + shape[1] * shape[2] + shape[0] * shape[2])
        predicted = max(flops / rate, nbytes / bw)
        rows.append(dict(shape="x".join(map(str, shape)), measured_us=t * 1e6,
                         tflops=flops / t / 1e12, fraction_of_peak=flops / t / PEAK_BF16,
                         predicted_us=predicted * 1e6, error_pct=(predicted / t - 1) * 100))
    out["sdpa"] = _sdpa(ctx, div, reps)
    numel = (256 << 20) // (div * div)  # float32: 1 GiB on the GPU
    x, y = torch.randn(numel, device=ctx.device), torch.randn(numel, device=ctx.device)
    z = torch.empty_like(x)
    copy_t = med(timed(lambda: z.copy_(x), ctx, reps=reps, warmup=2, inner=5))
    add_t = med(timed(lambda: torch.add(x, y, out=z), ctx, reps=reps, warmup=2, inner=5))
    small = torch.ones(1, device=ctx.device)
    launch = med(timed(lambda: small.add_(0), ctx, reps=reps, warmup=10, inner=1000))
    # what MEMORY_EFFICIENCY prices: eager training kernels (a softmax over attention scores
    # and a dropout that writes its mask), bf16 (batch x heads, 1024, 1024)
    scores = torch.randn(max(192 // (div * div), 1), 1024 // div, 1024 // div,
                         device=ctx.device, dtype=bf16)
    softmax_t = med(timed(lambda: torch.softmax(scores, dim=-1), ctx, reps=reps, warmup=2,
                          inner=5))
    dropout_t = med(timed(lambda: torch.ops.aten.native_dropout(scores, 0.1, True), ctx,
                          reps=reps, warmup=2, inner=5))
    elems = scores.numel()
    out["bandwidth"] = dict(bytes=numel * 4, copy_gbs=2 * numel * 4 / copy_t / 1e9,
                            add_gbs=3 * numel * 4 / add_t / 1e9,
                            softmax_gbs=4 * elems / softmax_t / 1e9,
                            dropout_gbs=5 * elems / dropout_t / 1e9,
                            preset_gbs=bw / 1e9, launch_us=launch * 1e6)
    del x, y, z
    best = max(r["fraction_of_peak"] for r in rows)
    sdpa = out["sdpa"]
    measured = dict(matmul=best, attention=max((r.get("fb_fraction_of_peak", 0.0)
                                                for r in sdpa), default=None),
                    MEMORY_EFFICIENCY=(out["bandwidth"]["softmax_gbs"]
                                       + out["bandwidth"]["dropout_gbs"]) / 2 * 1e9
                    / H100.memory_bandwidth,
                    OP_OVERHEAD=launch, ACTION_OVERHEAD=ctx.shared.get("action_overhead_s"))
    preset = dict(matmul=H100.matmul, attention=H100.attention,
                  MEMORY_EFFICIENCY=hardware.MEMORY_EFFICIENCY, OP_OVERHEAD=hardware.OP_OVERHEAD,
                  ACTION_OVERHEAD=hardware.ACTION_OVERHEAD)
    out["constants"] = [dict(name=k, preset=preset[k], measured=v,
                             error_pct=((preset[k] / v - 1) * 100) if v else None)
                        for k, v in measured.items()]
    out["measured_constants"] = measured  # paste into planner/hardware.py (its units)
    log(f"preset: constants measured {measured}")


def _flash() -> tuple[str, Callable[[], Any]]:
    """("flash", a factory of the context that restricts SDPA to FlashAttention), or the
    default backend where torch has no `sdpa_kernel`."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return "default (no torch.nn.attention)", contextlib.nullcontext
    return "flash", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def _sdpa(ctx: Ctx, div: int, reps: int) -> list[dict[str, Any]]:
    """Causal SDPA (head dim 128, 32 heads, batch 1), forward and forward+backward, on the
    flash backend where there is one; FLOPs as the preset counts them (causal: half)."""
    rows: list[dict[str, Any]] = []
    heads, dim = (32, 128) if div == 1 else (4, 32)
    for seq in ((2048, 4096) if div == 1 else (64, 128)):
        q, k, v = (torch.randn(1, heads, seq, dim, device=ctx.device, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        grad = torch.randn(1, heads, seq, dim, device=ctx.device, dtype=torch.bfloat16)
        backend, context = _flash()
        try:
            with context():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
        except Exception as exc:  # noqa: BLE001 - no flash kernel here (CPU, old GPU)
            backend, context = f"default ({type(exc).__name__})", contextlib.nullcontext

        def fwd() -> torch.Tensor:
            with context():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd() -> None:
            fwd().backward(grad)

        t_f = med(timed(fwd, ctx, reps=reps, warmup=2))
        t_fb = med(timed(fwd_bwd, ctx, reps=reps, warmup=2))
        flops = 4 * heads * seq * seq * dim / 2  # causal: half of QK^T and PV
        rows.append(dict(seq=seq, heads=heads, head_dim=dim, backend=backend,
                         forward_us=t_f * 1e6, fwd_bwd_us=t_fb * 1e6,
                         forward_fraction_of_peak=flops / t_f / PEAK_BF16,
                         fb_fraction_of_peak=3.5 * flops / t_fb / PEAK_BF16,
                         predicted_fb_us=3.5 * flops / (H100.attention * PEAK_BF16) * 1e6))
    return rows
