"""Where compile on CUDA replaced the symbolic batch by the example's (bench/RESULTS.md, the
section "The batch replaced on CUDA"), pinned on a GPU in under a minute:

    PYTHONPATH=. python bench/cuda_batch_probe.py [OUT.json]            # on a GPU
    PYTHONPATH=. python bench/cuda_batch_probe.py --device cpu --tiny   # the same code on a CPU

The 2-layer Llama of bench/gpu.py's memory section (hidden 768, 12 heads, ffn 2048, vocab
32000, float32), example 16 x 512, captured on the device, then its blocks costed twice on
fake tensors (`passes.annotate.symbolic_block_costs`), each on a fresh capture:

    threaded  autograd's multithreading left on: on CUDA the engine runs each backward on its
              device thread, where the shape environment's guard suppression (thread-local)
              does not hold; the cost pass before the fix
    fixed     the cost pass as it is (`passes.fake_values.unguarded`: backward on this thread)

Every replacement of a size symbol by a number made in the capture's shape environment is
recorded with the thread it was made on, the autograd node running (the backward op), and the
stack's last frames, with the cost pass's fallbacks (a block that failed with symbolic sizes,
and why); then a full `pc.compile` (m=4, 1f1b, AdamW) reports its shape
environment's replacements and the layer's FLOPs. Writes JSON to OUT (default stdout).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

import sympy
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu_common import llama, own_loss, token_ids  # noqa: E402

import pipecompile as pc  # noqa: E402
import pipecompile.passes.annotate as annotate  # noqa: E402
import pipecompile.passes.fake_values as fake_values  # noqa: E402
from pipecompile.capture.capture import capture  # noqa: E402
from pipecompile.passes.linearize import linearize  # noqa: E402

FULL = dict(hidden=768, layers=2, heads=12, kv=12, ffn=2048, vocab=32000, seq=512, batch=16)
TINY = dict(hidden=64, layers=2, heads=4, kv=4, ffn=128, vocab=256, seq=32, batch=16)


class _Kept(logging.Handler):
    """Keeps the messages logged to it (the first 2,000 characters of each)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:2000])


def _env_of(captured: Any) -> Any:
    node = next(iter(captured.module.graph.find_nodes(op="placeholder")))
    return node.meta["val"].fake_mode.shape_env


@contextlib.contextmanager
def _spy(envs: list, found: list) -> Iterator[None]:
    """Record every replacement of a symbol by a number made in one of `envs`, and (last in
    `found`) how many times a guard's suppression was checked, by thread and outcome (each
    `suppress_guards()` entered reads it once, unsuppressed: the block's runs, a few)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    original = ShapeEnv._set_replacement

    def spy(self: Any, a: Any, tgt: Any, msg: str) -> Any:
        if any(self is e for e in envs) and getattr(tgt, "is_number", False):
            node = torch._C._current_autograd_node()
            frames = traceback.format_stack(limit=14)[:-1]
            found.append(dict(symbol=str(a), value=str(tgt), how=msg,
                              main_thread=threading.current_thread() is threading.main_thread(),
                              thread=threading.current_thread().name,
                              autograd_node=node.name() if node is not None else None,
                              stack="".join(frames)))
        return original(self, a, tgt, msg)

    suppressed = ShapeEnv._suppress_guards_tls
    checks: dict[str, int] = {}

    def counted() -> bool:
        held = suppressed()
        key = (f"{'main' if threading.current_thread() is threading.main_thread() else 'other'}"
               f" thread, {'suppressed' if held else 'unsuppressed'}")
        checks[key] = checks.get(key, 0) + 1
        return held

    ShapeEnv._set_replacement = spy  # type: ignore[method-assign]
    ShapeEnv._suppress_guards_tls = staticmethod(counted)  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShapeEnv._set_replacement = original  # type: ignore[method-assign]
        ShapeEnv._suppress_guards_tls = staticmethod(suppressed)  # type: ignore[method-assign]
        found.append(dict(guard_checks=checks))


@contextlib.contextmanager
def _threaded_backward() -> Iterator[None]:
    """The cost pass before the fix: guards suppressed on this thread only (both users of
    `unguarded`: `run_on_fakes` and the block's run)."""
    fixed = fake_values.unguarded

    @contextlib.contextmanager
    def old(mode: Any) -> Iterator[None]:
        env = getattr(mode, "shape_env", None)
        with env.suppress_guards() if env is not None else contextlib.nullcontext():
            yield

    annotate.unguarded = fake_values.unguarded = old  # type: ignore[assignment]
    try:
        yield
    finally:
        annotate.unguarded = fake_values.unguarded = fixed  # type: ignore[assignment]


def _costing(model: torch.nn.Module, ids: torch.Tensor, threaded: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    captured = capture(model, (ids,), {"labels": ids})
    env = _env_of(captured)
    after_capture = {str(k): str(v) for k, v in env.replacements.items()}
    linear = linearize(captured)
    found: list[dict[str, Any]] = []
    logged = _Kept()  # the cost pass's fallbacks: a block that failed with symbolic sizes
    loggers = [logging.getLogger(n) for n in (annotate.__name__, fake_values.__name__)]
    for logger in loggers:
        logger.addHandler(logged)
        logger.setLevel(logging.INFO)
    try:
        with _spy([env], found), (_threaded_backward() if threaded
                                  else contextlib.nullcontext()):
            costs = annotate.symbolic_block_costs(linear)
    finally:
        for logger in loggers:
            logger.removeHandler(logged)
    batch = captured.batch_symbol
    return dict(
        seconds=round(time.perf_counter() - t0, 1), batch_symbol=str(batch),
        replacements_after_capture=after_capture,
        replacements_after_costing={str(k): str(v) for k, v in env.replacements.items()},
        made=found, fallbacks=logged.messages,
        attention_ops=sorted({str(n.target) for n in captured.module.graph.nodes
                              if n.op == "call_function" and "attention" in str(n.target)}),
        blocks=[dict(name=b.name, forward_flops=str(c.forward_flops),
                     activation_bytes=str(c.activation_bytes),
                     symbolic=batch in sympy.sympify(c.forward_flops).free_symbols
                     or batch in sympy.sympify(c.activation_bytes).free_symbols)
                for b, c in zip(linear.blocks, costs)])


def _compile(model: torch.nn.Module, ids: torch.Tensor, device: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    pipe = pc.compile(model, (ids,), {"labels": ids}, devices=[device], microbatches=4,
                      schedule="1f1b", loss_fn=own_loss, checkpoint=False,
                      optimizer=lambda p: torch.optim.AdamW(p), cache=None)
    env = _env_of(pipe.plan.captured)
    return dict(seconds=round(time.perf_counter() - t0, 1),
                replacements={str(k): str(v) for k, v in env.replacements.items()},
                layer_forward_flops=[str(c.forward_flops) for b, c in
                                     zip(pipe.plan.linear.blocks, pipe.plan.costs.symbolic)
                                     if "layers." in b.name],
                predicted_memory=[s.cost.memory for s in pipe.program.stages])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="JSON file (default: stdout)")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (a CPU check)")
    args = parser.parse_args()
    size = TINY if args.tiny else FULL
    torch.manual_seed(0)
    model = llama(**size).to(args.device)
    ids = token_ids(size["vocab"], size["batch"], size["seq"], args.device)
    result: dict[str, Any] = dict(device=args.device, torch=torch.__version__, size=size)
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(args.device)
    for name, threaded in (("threaded", True), ("fixed", False)):
        try:
            result[name] = _costing(model, ids, threaded)
        except Exception as exc:  # noqa: BLE001 - recorded; the next part runs
            result[name] = dict(error=f"{type(exc).__name__}: {exc}"[:2000])
    try:
        result["compile"] = _compile(model, ids, args.device)
    except Exception as exc:  # noqa: BLE001
        result["compile"] = dict(error=f"{type(exc).__name__}: {exc}"[:2000])
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text if not args.out else f"wrote {args.out}")


if __name__ == "__main__":
    main()
