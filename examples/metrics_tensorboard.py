"""Watch a pipeline train: `pipe.metrics()` to TensorBoard, progress on the terminal, and one
step under torch.profiler with its chrome trace.

    pip install 'pipecompile[tensorboard]'
    python examples/metrics_tensorboard.py --logdir runs/pipe
    tensorboard --logdir runs/pipe

Each step logs the flat dict `pipe.metrics()` gives (loss, step_time_s, bubble_fraction,
samples_per_s, tokens_per_s, bytes_sent, peak_memory_bytes/device{d}) with torch's
`SummaryWriter`. Compile's passes log at INFO as they end (`logging.basicConfig`). The last step
runs under `torch.profiler.profile`: its trace (`profile.json`) shows every action as a
``PP:<action>`` range holding the operators it ran; `pipe.write_chrome_trace` writes the
pipeline's own view of that step (`step.json`: a row per device, arrows from sends to
receives). Under torchrun run it on every rank; rank 0 writes the pipeline trace.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch

import pipecompile as pc
from pipecompile import zoo
from pipecompile.errors import require


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", default="runs/pipecompile")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args(argv)
    require("tensorboard", purpose="logging metrics to TensorBoard")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from torch.utils.tensorboard import SummaryWriter

    torch.manual_seed(0)
    vocab, seq, batch = 64, 16, 8
    model = zoo.GPT(vocab=vocab, dim=32, layers=4, heads=2, seq=seq)
    x = torch.randint(0, vocab, (batch, seq))
    pipe = pc.compile(model, (x,), devices=args.devices, loss_fn=zoo.lm_loss)
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    writer = SummaryWriter(args.logdir)
    metrics: dict[str, float] = {}
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1))
        last = step == args.steps - 1
        with (torch.profiler.profile() if last else _nothing()) as prof:
            pipe.step(tokens[:, :-1], target=tokens[:, 1:])
        opt.step()
        opt.zero_grad()
        metrics = pipe.metrics()
        for name, value in metrics.items():
            writer.add_scalar(name, value, step)
    writer.close()
    prof.export_chrome_trace(os.path.join(args.logdir, "profile.json"))
    pipe.write_chrome_trace(os.path.join(args.logdir, "step.json"))
    logging.getLogger("example").info("last step: %s", ", ".join(
        f"{k} {v:.4g}" for k, v in metrics.items()))
    return metrics


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
