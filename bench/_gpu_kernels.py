"""bench/gpu.py's kernel section: each kernel price of pipecompile/passes/kernel_prices.py
against the kernel on the GPU, at the shapes published pipeline runs train at.

    GEMMs        every linear of a transformer layer (qkv, attention out, MLP up and down)
                 and the output layer, at hidden 3072 (a 3B GPT), 4096 (Llama-3-8B), 8192
                 (Llama-3-70B) and 12288 (GPT-3 175B), tokens 2048 to 8192 and a few, tensor-
                 parallel widths 1 to 8; forward (x W^T), the input's gradient (g W) and the
                 weight's gradient (g^T x), as autograd runs a Linear
    attention    scaled_dot_product_attention (torch's default backend choice and FlashAttention-
                 2 alone), sequence 1024-8192, head dimension 64 and 128, causal or not,
                 forward and backward apart (backward = forward+backward - forward)
    memory-bound copy, add, GELU, LayerNorm and dropout at training sizes, each priced by the
                 bytes it reads and writes
    loss         cross-entropy over 4096 rows at vocabulary 32k-256k, forward and backward
                 (float32 logits, as transformers' loss upcasts them)
    optimizer    AdamW (foreach and fused) and clip_grad_norm_ over 100M float32 parameters
    launch       the shortest kernel, back to back

Each row: measured microseconds, predicted (kernel_prices on the chip of this GPU's name: the
H100's figures, with the H200's 4.8 TB/s where the GPU is an H200), and error_pct = predicted /
measured - 1 (positive: the price is slower than the GPU). `fitted` gives the constants that
the measurements imply, in kernel_prices' units: the GEMM ceiling and FlashAttention's forward
and backward efficiencies (the median of model-time-at-efficiency-1 / measured over the rows
that are compute-bound), memory efficiency (median bytes / datasheet bandwidth / measured) and
the launch floor. The dry run runs every case at tiny sizes on the CPU (no prediction holds
there: it only checks that the code paths run)."""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pipecompile.passes import kernel_prices as kp

from _gpu_common import Ctx, log, med, release, timed

__all__ = ["kernels", "chip_of"]

# (label, hidden, ffn, query heads, kv heads, head dim): the layers of published runs
LAYERS = (("gpt-3b", 3072, 12288, 32, 32, 96), ("llama3-8b", 4096, 14336, 32, 8, 128),
          ("llama3-70b", 8192, 28672, 64, 8, 128), ("gpt3-175b", 12288, 49152, 96, 96, 128))
# (layer label, tokens, tensor-parallel widths) timed
GEMM_CASES = (("gpt-3b", 2048, (1,)), ("gpt-3b", 4096, (1,)), ("llama3-8b", 8192, (1,)),
              ("llama3-70b", 8192, (4, 8)), ("gpt3-175b", 2048, (8,)), ("llama3-8b", 128, (1,)))
VOCABS = (32000, 128256, 256000)


def chip_of(name: str | None) -> tuple[str, kp.Chip]:
    """The kernel_prices chip that prices the GPU called `name` (the H100's for another)."""
    lowered = (name or "").lower()
    if "a100" in lowered:
        return "a100", kp.CHIPS["a100"]
    if "h200" in lowered:
        return "h200", kp.CHIPS["h200"]
    return "h100", kp.CHIPS["h100"]


def _time(fn: Callable[[], Any], ctx: Ctx, *, reps: int) -> float:
    """Median seconds per call; enough calls per sample that a sample lasts about 2 ms."""
    first = med(timed(fn, ctx, reps=1, warmup=2, inner=1))
    inner = max(1, min(200, int(2e-3 / max(first, 1e-7))))
    return med(timed(fn, ctx, reps=reps, warmup=1, inner=inner))


def _row(kind: str, name: str, measured: float, predicted: float, **extra: Any) -> dict:
    return dict(kind=kind, case=name, measured_us=measured * 1e6, predicted_us=predicted * 1e6,
                error_pct=(predicted / measured - 1) * 100 if measured > 0 else None, **extra)


def _linears(label: str, tp: int) -> list[tuple[str, int, int]]:
    """(name, in features, out features) of one layer's linears at tensor-parallel width tp."""
    _, hidden, ffn, heads, kv, head_dim = next(layer for layer in LAYERS if layer[0] == label)
    qkv = (heads + 2 * kv) * head_dim
    return [("qkv", hidden, qkv // tp), ("attn-out", heads * head_dim // tp, hidden),
            ("mlp-up", hidden, ffn // tp), ("mlp-down", ffn // tp, hidden)]


def _gemms(ctx: Ctx, chip: kp.Chip, div: int, reps: int, rows: list[dict]) -> None:
    cases = [(f"{label} {name} tp{tp}", tokens, k, n)
             for label, tokens, tps in GEMM_CASES for tp in tps
             for name, k, n in _linears(label, tp)]
    cases += [(f"lm-head vocab {v}", 4096, 4096, v) for v in VOCABS]
    if div > 1:  # the dry run: the code paths, not the grid
        cases = cases[:4] + cases[-1:]
    for name, tokens, k, n in cases:
        if ctx.over_budget():
            rows.append(dict(kind="skipped", case=name))
            continue
        m, k, n = (max(size // (div * 4 if div > 1 else 1), 4) for size in (tokens, k, n))
        x = torch.randn(m, k, device=ctx.device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=ctx.device, dtype=torch.bfloat16)
        g = torch.randn(m, n, device=ctx.device, dtype=torch.bfloat16)
        # forward (m x k)(k x n); input grad (m x n)(n x k); weight grad (n x m)(m x k)
        for part, fn, shape in (("fwd", lambda: F.linear(x, w), (m, n, k)),
                                ("dgrad", lambda: g @ w, (m, k, n)),
                                ("wgrad", lambda: g.t() @ x, (n, k, m))):
            t = _time(fn, ctx, reps=reps)
            flops = 2 * shape[0] * shape[1] * shape[2]
            rows.append(_row("gemm", f"{name} {part}", t,
                             kp.matmul_seconds(chip, *shape),
                             mnk="x".join(map(str, shape)), tflops=flops / t / 1e12,
                             fraction_of_peak=flops / t / chip.peak("bfloat16"),
                             ideal_us=_gemm_ideal(chip, *shape) * 1e6))
        del x, w, g


def _gemm_ideal(chip: kp.Chip, m: int, n: int, k: int) -> float:
    """The GEMM's time under the tile model at a ceiling of 1 (for fitting the ceiling)."""
    return kp.matmul_seconds(replace(chip, ceiling=1.0, launch=0.0,
                                     memory_bandwidth=float("inf")), m, n, k)


def _backends(cuda: bool) -> list[tuple[str, Callable[[], contextlib.AbstractContextManager]]]:
    """("default", no restriction), ("flash", FlashAttention-2 only) where torch has it, and on
    CUDA cuDNN's and the memory-efficient kernels alone."""
    out: list[tuple[str, Callable[[], contextlib.AbstractContextManager]]] = [
        ("default", contextlib.nullcontext)]
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return out
    kinds = [("flash", "FLASH_ATTENTION")] + ([("cudnn", "CUDNN_ATTENTION"),
                                               ("efficient", "EFFICIENT_ATTENTION")] if cuda else [])
    for name, backend in kinds:
        if hasattr(SDPBackend, backend):
            out.append((name, lambda b=getattr(SDPBackend, backend): sdpa_kernel(b)))
    return out


def _default_attention_kernels(ctx: Ctx) -> str:
    """The names of the GPU kernels torch's default SDPA runs (forward and backward), from the
    profiler: which backend the default picks here."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(1, 32, 4096 // (1 if ctx.cuda else 64), 128 if ctx.cuda else 16,
                           device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=activities) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        ctx.sync()
    names = sorted({e.key for e in prof.key_averages()
                    if any(w in e.key.lower() for w in ("attn", "attention", "fmha", "flash",
                                                       "cudnn", "sdpa"))})
    return "; ".join(n[:90] for n in names)


def _attention(ctx: Ctx, chip: kp.Chip, div: int, reps: int, rows: list[dict]) -> None:
    seqs = (1024, 2048, 4096, 8192) if div == 1 else (32, 64)
    try:
        rows.append(dict(kind="attention-kernels", case=_default_attention_kernels(ctx)))
    except Exception as exc:  # noqa: BLE001 - a profiler this torch lacks: noted
        rows.append(dict(kind="attention-kernels", case=f"unknown: {exc!r}"[:200]))
    for backend, context in _backends(ctx.cuda):
        for seq in seqs:
            for head_dim in ((64, 128) if div == 1 else (16,)):
                for causal in (True, False):
                    if ctx.over_budget():
                        rows.append(dict(kind="skipped", case=f"sdpa {backend} {seq}"))
                        continue
                    heads = max(32 // div, 2)  # batch x heads: 32 (a 1 x 32-head layer)
                    q, k, v = (torch.randn(1, heads, seq, head_dim, device=ctx.device,
                                           dtype=torch.bfloat16, requires_grad=True)
                               for _ in range(3))
                    grad = torch.randn_like(q)

                    def fwd() -> torch.Tensor:
                        with context():
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                    def fwd_bwd() -> None:
                        torch.autograd.grad(fwd(), (q, k, v), grad)

                    try:
                        t_f = _time(fwd, ctx, reps=reps)
                        t_fb = _time(fwd_bwd, ctx, reps=reps)
                    except RuntimeError as exc:  # no such kernel here (CPU, head dim)
                        rows.append(dict(kind="attention", case=f"sdpa {backend} {seq}",
                                         error=str(exc)[:120]))
                        continue
                    name = (f"sdpa {backend} s{seq} d{head_dim} "
                            f"{'causal' if causal else 'full'}")
                    for part, t in (("fwd", t_f), ("bwd", t_fb - t_f)):
                        back = part == "bwd"
                        pred = kp.attention_seconds(chip, heads, seq, seq, head_dim,
                                                    causal=causal, backward=back)
                        flops = 4 * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
                        flops *= 2.5 if back else 1.0
                        rows.append(_row("attention", f"{name} {part}", t, pred,
                                         backend=backend, backward=back,
                                         fraction_of_peak=flops / t / chip.peak("bfloat16"),
                                         shape_factor=kp.attention_efficiency(
                                             chip, heads, seq, seq, head_dim, causal=causal,
                                             backward=back) / (chip.attention.backward if back
                                                               else chip.attention.forward)))
                    del q, k, v, grad


def _memory_bound(ctx: Ctx, chip: kp.Chip, div: int, reps: int, rows: list[dict]) -> None:
    tokens, width = 8192 // div, 4096 // (div if div == 1 else 8)
    x = torch.randn(tokens, width, device=ctx.device, dtype=torch.bfloat16)
    y = torch.randn_like(x)
    z = torch.empty_like(x)
    ln_w = torch.ones(width, device=ctx.device, dtype=torch.bfloat16)
    n = x.numel() * 2  # bytes of one such tensor
    cases: list[tuple[str, Callable[[], Any], float]] = [
        ("copy bf16", lambda: z.copy_(x), 2 * n),
        ("add bf16", lambda: torch.add(x, y, out=z), 3 * n),
        ("gelu bf16", lambda: F.gelu(x), 2 * n),
        ("gelu backward bf16", lambda: torch.ops.aten.gelu_backward(y, x), 3 * n),
        ("layer_norm bf16", lambda: F.layer_norm(x, (width,), ln_w), 2 * n),
        ("dropout bf16 (with mask)", lambda: torch.ops.aten.native_dropout(x, 0.1, True),
         2 * n + x.numel()),
        ("softmax bf16 rows of 2048", lambda: torch.softmax(x.view(-1, 2048 // div), -1),
         2 * n),
    ]
    for name, fn, nbytes in cases:
        if ctx.over_budget():
            rows.append(dict(kind="skipped", case=name))
            continue
        t = _time(fn, ctx, reps=reps)
        rows.append(_row("memory", name, t, kp.memory_seconds(chip, nbytes), bytes=nbytes,
                         fraction_of_bandwidth=nbytes / t / chip.memory_bandwidth))
    del x, y, z


def _loss(ctx: Ctx, chip: kp.Chip, div: int, reps: int, rows: list[dict]) -> None:
    tokens = 4096 // div
    for vocab in VOCABS:
        if ctx.over_budget():
            rows.append(dict(kind="skipped", case=f"cross-entropy {vocab}"))
            continue
        classes = vocab // (div * 8 if div > 1 else 1)
        logits = torch.randn(tokens, classes, device=ctx.device, dtype=torch.float32,
                             requires_grad=True)
        target = torch.randint(0, classes, (tokens,), device=ctx.device)
        t_f = _time(lambda: F.cross_entropy(logits, target), ctx, reps=reps)
        t_fb = _time(lambda: torch.autograd.grad(F.cross_entropy(logits, target), logits),
                     ctx, reps=reps)
        for part, t, back in (("fwd", t_f, False), ("bwd", t_fb - t_f, True)):
            nbytes = kp.cross_entropy_bytes(tokens, classes, 4, backward=back)
            rows.append(_row("loss", f"cross-entropy fp32 {tokens} x {classes} {part}", t,
                             kp.memory_seconds(chip, nbytes), bytes=nbytes,
                             fraction_of_bandwidth=nbytes / t / chip.memory_bandwidth))
        del logits
    for vocab in VOCABS:  # log-softmax alone: how many times a long row is read
        if ctx.over_budget():
            break
        classes = vocab // (div * 8 if div > 1 else 1)
        for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
            logits = torch.randn(tokens, classes, device=ctx.device, dtype=dtype)
            t = _time(lambda: torch.log_softmax(logits, -1), ctx, reps=reps)
            nbytes = kp.softmax_bytes(tokens, classes, size)
            rows.append(_row("loss", f"log_softmax {str(dtype)[6:]} {tokens} x {classes}", t,
                             kp.memory_seconds(chip, nbytes), bytes=nbytes,
                             fraction_of_bandwidth=nbytes / t / chip.memory_bandwidth,
                             one_pass_fraction=2 * tokens * classes * size / t
                             / chip.memory_bandwidth))
            del logits


def _optimizer(ctx: Ctx, chip: kp.Chip, div: int, reps: int, rows: list[dict]) -> None:
    count = 100_000_000 // (div * div * 16 if div > 1 else 1)
    shapes = [(count // 100,)] * 100  # 100 tensors, as a model's parameters come
    params = [torch.nn.Parameter(torch.randn(s, device=ctx.device)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    nbytes = 4 * sum(p.numel() for p in params)
    for fused in (False, True):
        if ctx.over_budget() or (fused and not ctx.cuda):
            rows.append(dict(kind="skipped", case=f"adamw fused={fused}"))
            continue
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=fused or None)
        opt.step()  # the moments exist from here on
        t = _time(opt.step, ctx, reps=reps)
        passes = kp.adam_passes(fused=fused, weight_decay=0.1)
        pred = kp.optimizer_seconds(chip.bandwidth, nbytes, nbytes, 2 * nbytes, clip=False,
                                    passes=passes)
        rows.append(_row("optimizer", f"adamw {'fused' if fused else 'foreach'} fp32 "
                         f"{count / 1e6:.0f}M", t, pred, passes="/".join(map(str, passes))))
        del opt
    t = _time(lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), ctx, reps=reps)
    rows.append(_row("optimizer", f"clip_grad_norm_ fp32 {count / 1e6:.0f}M", t,
                     kp.CLIP_PASSES * nbytes / chip.bandwidth))
    grads = [p.grad for p in params]
    for name, fn, passes in (("_foreach_norm", lambda: torch._foreach_norm(grads), 1),
                             ("_foreach_mul_", lambda: torch._foreach_mul_(grads, 1.0), 2)):
        t = _time(fn, ctx, reps=reps)
        rows.append(_row("optimizer", f"{name} fp32 {count / 1e6:.0f}M", t,
                         passes * nbytes / chip.bandwidth,
                         fraction_of_bandwidth=passes * nbytes / t / chip.memory_bandwidth))
    del params


def _launch(ctx: Ctx, chip: kp.Chip, rows: list[dict]) -> None:
    small = torch.ones(1, device=ctx.device)
    t = med(timed(lambda: small.add_(0), ctx, reps=5, warmup=20, inner=2000))
    rows.append(_row("launch", "add_ on one element, back to back", t, chip.launch))


def _fitted(chip: kp.Chip, rows: list[dict]) -> list[dict[str, Any]]:
    """The constants the rows imply (module docstring), and each constant's value now."""
    gemm = [r["ideal_us"] / r["measured_us"] for r in rows
            if r.get("kind") == "gemm" and r.get("fraction_of_peak", 0) > 0.3]
    fitted: dict[str, Any] = {"ceiling": (statistics.median(gemm) if gemm else None,
                                          chip.ceiling)}
    for back in (False, True):
        ratios = [r["fraction_of_peak"] / r["shape_factor"] for r in rows
                  if r.get("kind") == "attention" and r.get("backend") == "default"
                  and r.get("backward") == back and r.get("shape_factor")]
        now = chip.attention.backward if back else chip.attention.forward
        fitted["attention_" + ("backward" if back else "forward")] = (
            statistics.median(ratios) if ratios else None, now)
    mem = [r["fraction_of_bandwidth"] for r in rows if r.get("kind") in ("memory", "loss")
           and r.get("fraction_of_bandwidth")]
    fitted["memory_efficiency"] = (statistics.median(mem) if mem else None,
                                   chip.memory_efficiency)
    launch = [r["measured_us"] * 1e-6 for r in rows if r.get("kind") == "launch"]
    fitted["launch"] = (launch[0] if launch else None, chip.launch)
    return [dict(constant=k, measured=v[0], now=v[1]) for k, v in fitted.items()]


def kernels(ctx: Ctx, out: dict[str, Any]) -> None:
    gpu = torch.cuda.get_device_name(0) if ctx.cuda else None
    key, chip = chip_of(gpu)
    div = 1 if ctx.cuda else 16
    reps = 5 if ctx.cuda else 2
    rows: list[dict[str, Any]] = []
    out.update(chip=key, chip_title=chip.title, rows=rows,
               note="error_pct = predicted / measured - 1 (positive: the price is slower)")
    for name, part in (("launch", lambda: _launch(ctx, chip, rows)),
                       ("gemm", lambda: _gemms(ctx, chip, div, reps, rows)),
                       ("attention", lambda: _attention(ctx, chip, div, reps, rows)),
                       ("memory", lambda: _memory_bound(ctx, chip, div, reps, rows)),
                       ("loss", lambda: _loss(ctx, chip, div, reps, rows)),
                       ("optimizer", lambda: _optimizer(ctx, chip, div, reps, rows))):
        try:
            part()
        except Exception as exc:  # noqa: BLE001 - recorded; the other kinds still run
            rows.append(dict(kind=name, case="failed", error=f"{type(exc).__name__}: {exc}"[:300]))
        release(ctx)
        done = [r for r in rows if r.get("kind") == name and "error_pct" in r]
        errors = [r["error_pct"] for r in done if r["error_pct"] is not None]
        if errors:
            log(f"kernels: {name}: {len(done)} rows, error median {statistics.median(errors):+.0f} %, "
                f"range {min(errors):+.0f} to {max(errors):+.0f} %")
    out["fitted"] = _fitted(chip, rows)
    summary = []
    for kind in ("gemm", "attention", "memory", "loss", "optimizer", "launch"):
        errors = [r["error_pct"] for r in rows if r.get("kind") == kind
                  and r.get("error_pct") is not None]
        if errors:
            summary.append(dict(kind=kind, rows=len(errors),
                                median_error_pct=statistics.median(errors),
                                min_error_pct=min(errors), max_error_pct=max(errors)))
    out["summary"] = summary
    log(f"kernels: fitted {out['fitted']}")
