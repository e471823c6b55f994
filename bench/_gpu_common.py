"""What bench/gpu.py's sections share: the run's context (device, dry run, deadlines), progress
lines, the models (transformers Llama and GPT-2 from configs, random weights), the unsplit
reference step, relative errors, and timing on CPU or CUDA. Not a benchmark itself."""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

T0 = time.monotonic()

# Model sizes: (full run, dry run). Llama fields: hidden, layers, heads, kv heads, ffn, vocab.
TINY = dict(hidden=64, layers=2, heads=4, kv=2, ffn=128, vocab=128, seq=32, batch=8, m=4)
LLAMA_100M = (dict(hidden=768, layers=12, heads=12, kv=12, ffn=2048, vocab=32000, seq=1024,
                   mb=4, m=4),
              dict(hidden=64, layers=2, heads=4, kv=4, ffn=128, vocab=256, seq=32, mb=2, m=2))
LLAMA3_8B_LAYER = (dict(hidden=4096, heads=32, kv=8, ffn=14336, vocab=2048, seqs=(2048, 4096)),
                   dict(hidden=128, heads=4, kv=2, ffn=256, vocab=128, seqs=(32, 64)))


def log(msg: str) -> None:
    """A progress line with the seconds since the start, flushed (a run cut short shows where)."""
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


@dataclass
class Ctx:
    """Where the sections run and how long they may take."""

    device: str  # "cuda:0", or "cpu" in the dry run
    dry: bool
    deadline_s: float  # seconds after the start: later sections are skipped
    t0: float = field(default_factory=time.monotonic)
    section_end: float = math.inf
    section_budget: float = 0.0
    shared: dict[str, Any] = field(default_factory=dict)  # one section's numbers for another

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def past_deadline(self) -> bool:
        return self.elapsed() > self.deadline_s

    def start_section(self, budget: float) -> None:
        self.section_budget = budget
        self.section_end = time.monotonic() + budget

    def over_budget(self) -> bool:
        """True once the section's budget or the global deadline has passed: a section checks
        this between its cases and records the cases it left out."""
        return time.monotonic() > self.section_end or self.past_deadline()

    def size(self, sizes: tuple[dict, dict]) -> dict:
        return dict(sizes[1] if self.dry else sizes[0])

    def autocast(self, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
        """torch.autocast on this device in `dtype`, or nothing for None."""
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda" if self.cuda else "cpu", dtype=dtype)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def fresh_thread_state() -> None:
    """Grad mode on, no autocast: what a section or an exactness case starts from, whatever a
    failure before it left behind."""
    torch.set_grad_enabled(True)
    for device_type in ("cpu", "cuda"):
        torch.set_autocast_enabled(device_type, False)


def release(ctx: Ctx) -> None:
    """Free what the last section left (its models are out of scope once it returns)."""
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


# -- models -------------------------------------------------------------------------------

def llama(*, hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, seq: int,
          **_: Any) -> torch.nn.Module:
    """transformers' LlamaForCausalLM from a config: random weights, no cache, tied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
                      max_position_embeddings=max(seq, 64), use_cache=False,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def gpt2(*, hidden: int, layers: int, heads: int, vocab: int, seq: int,
         **_: Any) -> torch.nn.Module:
    """transformers' GPT2LMHeadModel from a config: random weights, no cache, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=vocab,
                     n_positions=max(seq, 64), use_cache=False, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def own_loss(out: Any, _target: Any) -> torch.Tensor:
    """The model's own loss, computed from `labels=` inside its forward."""
    return out.loss


def token_ids(vocab: int, batch: int, seq: int, device: str, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, seq), generator=gen).to(device)


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- the reference and errors -------------------------------------------------------------

def plain_step(model: torch.nn.Module, ids: torch.Tensor, m: int, ctx: Ctx,
               amp: torch.dtype | None = None) -> torch.Tensor:
    """The unsplit model's training step on the pipeline's micro-batches (`torch.chunk` of the
    batch): gradients of the mean micro-batch loss; returns that mean."""
    model.zero_grad(set_to_none=True)
    losses = []
    with ctx.autocast(amp):
        for chunk in ids.chunk(m):
            loss = model(chunk, labels=chunk).loss
            (loss / m).backward()
            losses.append(loss.detach())
    return torch.stack(losses).mean()


def reference(model: torch.nn.Module, ids: torch.Tensor, m: int, ctx: Ctx,
              amp: torch.dtype | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, {name: grad}) of the plain step on a copy of `model`."""
    ref = copy.deepcopy(model)
    loss = plain_step(ref, ids, m, ctx, amp)
    return loss, {n: p.grad.detach().clone() for n, p in ref.named_parameters()
                  if p.grad is not None}


def rel_error(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """max |got - ref| / max(max |ref|, floor), in float64."""
    got, ref = got.detach().double().to(ref.device), ref.detach().double()
    scale = max(ref.abs().max().item(), floor) or 1.0
    return (got - ref).abs().max().item() / scale


def grad_errors(named: Iterable[tuple[str, torch.nn.Parameter]],
                ref: dict[str, torch.Tensor], floor: float = 1e-6) -> tuple[float, str, int]:
    """(largest relative gradient error over the parameters, its parameter, parameters
    compared). A gradient is compared relative to its own largest entry, or to `floor` times
    the largest reference gradient where that is larger (a gradient zero in exact arithmetic
    is rounding noise). A parameter missing a gradient on either side counts as error 1."""
    least = floor * max((g.abs().max().item() for g in ref.values()), default=0.0)
    worst, name_of, count = 0.0, "", 0
    seen = set()
    for name, p in named:
        seen.add(name)
        r = ref.get(name)
        if r is None and p.grad is None:
            continue
        err = 1.0 if r is None or p.grad is None else rel_error(p.grad, r, least)
        count += 1
        if err > worst or not name_of:
            worst, name_of = err, name
    missing = [n for n in ref if n not in seen]
    if missing:
        worst, name_of = 1.0, f"not in the pipeline: {missing[0]}"
    return worst, name_of, count


# -- timing ---------------------------------------------------------------------------------

def timed(fn: Callable[[], Any], ctx: Ctx, *, reps: int, warmup: int = 1,
          inner: int = 1) -> list[float]:
    """Seconds per call of `fn`, `reps` samples of `inner` calls each, after `warmup` calls;
    the device is synchronised around each sample (all streams, so device threads' work
    counts)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        ctx.sync()
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        ctx.sync()
        samples.append((time.perf_counter() - t) / inner)
    return samples


def alternating(fns: dict[str, Callable[[], Any]], ctx: Ctx, *, reps: int,
                warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per call of each function, run in turn `reps` times (drift hits all alike)."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(reps + warmup):
        for key, fn in fns.items():
            ctx.sync()
            t = time.perf_counter()
            fn()
            ctx.sync()
            if i >= warmup:
                out[key].append(time.perf_counter() - t)
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> str:
    """min/max around the median in percent."""
    m = med(xs)
    return f"{(min(xs) / m - 1) * 100:+.0f}/{(max(xs) / m - 1) * 100:+.0f}%" if m else "-"


def fit(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return (sum((a - mx) * (b - my) for a, b in zip(xs, ys))
            / sum((a - mx) ** 2 for a in xs))
