"""Helpers shared by the benchmark scripts: models, statistics, tables, spawning gloo ranks.

Not a benchmark itself. The scripts import it as `_common` (they run as `python bench/x.py`, so
bench/ is on sys.path) and it puts the repository root on sys.path, as bench/distributed.py does.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
import sys
import traceback
from typing import Any, Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pipecompile import zoo  # noqa: E402

__all__ = ["ROOT", "machine", "med", "spread", "fmt_ms", "table", "spawn", "free_port",
           "gpt2", "bert", "ce", "block_names", "loadavg", "gpt", "pipelining_stage"]


def machine() -> str:
    """One line naming the machine and the versions (for the top of every result table)."""
    import transformers

    return (f"{platform.machine()} {os.cpu_count()}-core CPU, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, python {platform.python_version()}, "
            f"pipecompile {_revision()}")


def _revision() -> str:
    import subprocess

    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "pipecompile"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def loadavg() -> str:
    """The 1-minute load average (other work on this machine makes timings noisy)."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def spread(xs: Sequence[float]) -> str:
    """'min-max' of the samples as a percentage around the median: how noisy the number is."""
    m = med(xs)
    if not m:
        return "-"
    return f"{(min(xs) / m - 1) * 100:+.0f}/{(max(xs) / m - 1) * 100:+.0f}%"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A GitHub-markdown table (readable as plain text too)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(lines)


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def gpt2(*, layers: int, dim: int, heads: int, vocab: int, seq: int, tied: bool = False):
    """transformers GPT-2 from a small config: random weights, no cache, no dropout.

    Returns (model, loss_fn). The loss accepts the model's output object (pipecompile gives
    the model's own output structure) or a bare logits tensor / tuple (what
    torch.distributed.pipelining's traced last stage returns)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab,
                     n_positions=seq, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg), _lm_loss_any


def _lm_loss_any(out: Any, target: torch.Tensor) -> torch.Tensor:
    if hasattr(out, "logits"):
        out = out.logits
    elif isinstance(out, (tuple, list)):
        out = out[0]
    return ce(out, target)


def bert(*, layers: int, dim: int, heads: int, vocab: int, seq: int):
    """transformers BERT encoder from a small config; loss = MSE of the last hidden state."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=4 * dim, vocab_size=vocab, max_position_embeddings=seq,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

    def loss_fn(out, y):
        return F.mse_loss(out.last_hidden_state, y) + out.pooler_output.pow(2).mean()

    return BertModel(cfg), loss_fn


def block_names(pipe) -> list[str]:
    """Per stage, 'first..last' block names of a compiled pipeline (which split it used)."""
    blocks = pipe.program.linear.blocks
    out = []
    for s in pipe.program.stages:
        first, last = blocks[s.blocks[0]].name, blocks[s.blocks[-1]].name
        out.append(first if first == last else f"{_short(first)}..{_short(last)}")
    return out


def _short(name: str) -> str:
    return name if len(name) <= 24 else name[:21] + "..."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable, world: int, *args: Any, timeout: float = 1800.0) -> list[Any]:
    """Run fn(rank, world, *args) on `world` gloo ranks (spawned processes, one intra-op thread
    each); returns every rank's return value. A rank that raised re-raises here."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, rank, world, port, args, queue))
             for rank in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in procs:
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def _entry(fn, rank, world, port, args, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        queue.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported by the launching process
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def gpt(*, vocab: int, dim: int, layers: int, heads: int, seq: int, tied: bool = False):
    return zoo.GPT(vocab=vocab, dim=dim, layers=layers, heads=heads, seq=seq, tied=tied)


def pipelining_stage(model: torch.nn.Module, x: torch.Tensor, cut: str, rank: int,
                     microbatches: int, schedule: str, loss_fn: Callable) -> tuple[Any, Any]:
    """torch.distributed.pipelining's own front end on 2 ranks: `pipeline()` traces `model` and
    cuts it before module `cut`; returns (this rank's stage, its gpipe / 1f1b schedule)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    pipe = pipeline(model, mb_args=(x.chunk(microbatches)[0],),
                    split_spec={cut: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return stage, cls(stage, n_microbatches=microbatches, loss_fn=loss_fn)


def timed(step: Callable[[], Any], steps: int) -> tuple[float, float]:
    """(wall, this process's CPU) seconds per step over `steps` steps between two barriers. CPU
    time counts every thread of the rank (gloo's, pipecompile's waiter)."""
    import time

    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    c1 = time.process_time()
    dist.barrier()
    return (time.perf_counter() - t0) / steps, (c1 - c0) / steps
