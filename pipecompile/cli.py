"""The `pipecompile` command (also `python -m pipecompile`).

    pipecompile inspect FILE.py:FACTORY --devices 4 [--schedule 1f1b] [--microbatches 8]
                        [--code] [--runtime] [--draw partition.svg] [--json]
    pipecompile plan    FILE.py:FACTORY ... [--gantt timeline.png] [--json]
    pipecompile plan    FILE.py:FACTORY --devices 32 --device h100 [--arg layers=80]
    pipecompile plan    FILE.py:FACTORY --device h100 --nodes 8 --per-node 8 --global-batch 128
    pipecompile export  FILE.py:FACTORY ... [--onnx DIR] [--save DIR] [--json]

FACTORY is a function in FILE.py returning `(model, example_inputs)` or `(model,
example_inputs, example_kwargs)`; the model is compiled as `pipecompile.compile(model,
example_inputs, example_kwargs, devices=..., microbatches=..., schedule=...)`.

`inspect` prints the stage table, each cut's boundary tensors (name, shape, dtype, bytes per
micro-batch), with --code each stage's graph code and with --runtime each device's generated
training step. `plan` prints the schedule as an action grid, the predicted step time, bubble
and peak in-flight micro-batches per stage, and the plans the search compared (--schedule and
--microbatches default to "auto"); --gantt draws the predicted timeline. `export` writes ONNX
files and a manifest (--onnx) and/or the saved program (--save, read back by
`pipecompile.load`). --json prints one JSON object on stdout instead of text. Progress goes to
stderr: on a terminal a progress bar (passes done, or a long search's count of candidates),
otherwise pipecompile's INFO log lines, each pass as it ends with its time. Any failure (a bad
FILE, FACTORY or option, a model that cannot be compiled) prints a one-line error on stderr and
exits with status 2; --debug prints the traceback first. `--version` prints the version.

`--device NAME` plans for --devices devices of a named preset (`pipecompile.planner.hardware`: h100,
a100; `--link nvlink` or `infiniband`) that need not be on this machine: nothing is measured or
run, and `plan` prints the stage table (each stage's memory and the predicted step) and
`pipe.explain()` instead of the action grid. `--arg KEY=VALUE` (repeatable) passes a keyword
argument to FACTORY (a Python literal, else the string). `--optimizer adamw` counts that
optimizer's state in each stage's memory (default: none). `--nodes N --per-node K` plan a
cluster of N x K devices of `--device` (`pipecompile.cluster`): the layout, P pipeline stages
x D replicas with FSDP or not, is searched for the global batch (`--global-batch B` passes
batch=B to FACTORY), and `plan` prints the layouts compared.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib.util
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

from .errors import PipecompileError
from .ir.formats import format_bytes
from .ir.progress import reporting_every
from .outputs.progress_bar import ProgressBar, progress_handler
from .outputs.report import explain_search
from .outputs.table import format_table
from .schedule.schedules import SCHEDULE_NAMES

__all__ = ["main"]

log = logging.getLogger("pipecompile.cli")
_BAR_EVERY_S = 0.2  # seconds between two counts of a long loop while a bar is drawn


class UsageError(Exception):
    """A mistake on the command line: reported in one line, exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        # progress on stderr; stray prints (from libraries) must not spoil --json on stdout
        with _progress_on_stderr(), contextlib.redirect_stdout(sys.stderr):
            result, text = args.command(args)
    except Exception as error:  # noqa: BLE001 - every failure is one line and status 2
        if args.debug:
            traceback.print_exc()
        message = " ".join(str(error).split())
        if not isinstance(error, (UsageError, PipecompileError)):  # not ours: say what it is
            message = f"{type(error).__name__}: {message}"
            if not args.debug:
                message += " (--debug shows the traceback)"
        print(f"pipecompile: error: {message}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else text)
    return 0


# -- commands ----------------------------------------------------------------------------------


def _inspect(args: argparse.Namespace) -> tuple[dict, str]:
    from .outputs.cuts import cuts

    pipe = _compile(args)
    program = pipe.program
    boundary = cuts(program, microbatches=pipe.plan.resolved.microbatches)
    result: dict[str, Any] = {
        "stages": [_stage_json(s, program) for s in program.stages],
        "cuts": [{"index": c.index, "after_block": c.block_name, "bytes": c.nbytes,
                  "values": [{"name": v.name, "shape": list(v.shape),
                              "microbatch_shape": list(v.microbatch_shape), "dtype": v.dtype,
                              "bytes": v.nbytes, "producer": v.producer,
                              "consumers": list(v.consumers)} for v in c.values]}
                 for c in boundary],
        "predicted": _predicted_json(pipe),
    }
    lines = [str(pipe), "", "cuts (tensors sent between stages, per micro-batch):"]
    for c in boundary:
        lines.append(f"  cut {c.index} (stage {c.index} | {c.index + 1}, after {c.block_name}): "
                     f"{len(c.values)} value{'s' if len(c.values) != 1 else ''}, "
                     f"{format_bytes(c.nbytes)}")
        rows = [(v.name, "[" + ", ".join(map(str, v.shape)) + "]",
                 "= (" + ", ".join(map(str, v.microbatch_shape)) + ")", v.dtype,
                 format_bytes(v.nbytes), f"stage {v.producer} -> {', '.join(map(str, v.consumers))}")
                for v in c.values]
        lines += format_table(rows, indent=4)
    if args.code:
        # the forward training runs (direct calls), not the GraphModule's own code
        result["code"] = {str(s.index): pipe.stage_code(s.index) for s in program.stages}
        for s in program.stages:
            lines += ["", f"# stage {s.index} ({s.device}): its training forward",
                      result["code"][str(s.index)].strip("\n")]
    if args.runtime:
        devices = range(pipe.schedule.num_devices)
        result["runtime_code"] = {str(d): pipe.runtime_code(d) for d in devices}
        for d in devices:
            lines += ["", f"# device {d}: its generated training step",
                      pipe.runtime_code(d).strip("\n")]
    if args.draw:
        log.info("drawing the partition")
        result["drawing"] = pipe.draw(args.draw)
        lines += ["", f"partition drawn to {args.draw}"]
    return result, "\n".join(lines)


def _plan(args: argparse.Namespace) -> tuple[dict, str]:
    pipe = _compile(args)
    schedule = pipe.schedule
    result = {"schedule": {"name": schedule.name, "num_stages": schedule.num_stages,
                           "num_microbatches": schedule.num_microbatches,
                           "stage_to_device": list(schedule.stage_to_device),
                           "actions": [[str(a) for a in row] for row in schedule.actions]},
              **_predicted_json(pipe)}
    search = pipe.plan.search
    if search is not None:  # as a saved plan holds it: seconds, bytes, the winner first
        result["search"] = search.to_dict()
    if args.device:  # hardware that is not here: the stage table and the pass log
        result["devices"] = [dict(name=d.name, hardware=d.hardware, flops=d.flops,
                                  memory=d.memory, bandwidth=d.bandwidth, latency=d.latency)
                             for d in pipe.plan.resolved.devices]
        layout = pipe.layout
        result["layout"] = {"pipeline": layout.pipeline, "data_parallel": layout.data_parallel,
                            "fsdp": layout.fsdp, "inner": layout.inner}
        return result, "\n".join([str(pipe), "", pipe.explain()])
    lines = [str(schedule), ""]
    if pipe.predicted is not None:
        lines += [f"predicted step time  {pipe.predicted.makespan * 1e3:.3f} ms",
                  f"bubble               {pipe.predicted.bubble_fraction:.1%}",
                  "peak in-flight micro-batches per stage: "
                  + ", ".join(f"{s}: {n}" for s, n in enumerate(result["peak_inflight"]))]
    if args.gantt:
        log.info("drawing the predicted timeline")
        result["gantt"] = pipe.plot_timeline(args.gantt)
        lines.append(f"Gantt chart written to {args.gantt}")
    lines += ["", explain_search(search)]
    return result, "\n".join(lines)


def _export(args: argparse.Namespace) -> tuple[dict, str]:
    if not args.onnx and not args.save:
        raise UsageError("export needs --onnx DIR and/or --save DIR")
    pipe = _compile(args)
    result, lines = {}, []
    if args.onnx:
        start = time.perf_counter()
        log.info("exporting %d stages to ONNX in %s", len(pipe.program.stages), args.onnx)
        result["onnx"] = pipe.export_onnx(args.onnx)
        log.info("exported in %.1f s", time.perf_counter() - start)
        lines.append(f"ONNX manifest: {result['onnx']}")
    if args.save:
        log.info("saving the staged program in %s", args.save)
        result["save"] = pipe.save(args.save)
        lines.append(f"saved program: {result['save']} (load with pipecompile.load)")
    return result, "\n".join(lines)


# -- helpers -----------------------------------------------------------------------------------


def _compile(args: argparse.Namespace):
    import pipecompile

    arguments = dict(args.arg)
    if args.global_batch is not None:
        arguments["batch"] = args.global_batch
    model, inputs, kwargs = _call_factory(args.target, arguments)
    devices: Any = args.devices
    layout: dict[str, Any] = {}
    if args.nodes is not None or args.per_node is not None:  # a cluster: the layout searched
        if not args.device:
            raise UsageError("--nodes/--per-node plan a cluster of a preset: give --device "
                             "NAME too (h100, h200, a100)")
        devices = pipecompile.cluster(args.device, nodes=args.nodes or 1,
                                      per_node=args.per_node or 8)
        layout = dict(data_parallel="auto", fsdp="auto")
    elif args.device:
        devices = [pipecompile.preset(args.device, link=args.link)] * args.devices
    log.info("compiling %s for %d %s (capture, cost, partition, split)", type(model).__name__,
             len(devices) if layout else args.devices,
             devices[0].hardware if args.device else "devices")
    start = time.perf_counter()
    pipe = pipecompile.compile(model, inputs, kwargs, devices=devices,
                               microbatches=args.microbatches, schedule=args.schedule,
                               capture=args.capture,
                               optimizer=None if args.optimizer == "none"
                               else functools.partial(_optimizer, args.optimizer), **layout)
    log.info("compiled in %.1f s", time.perf_counter() - start)
    return pipe


def _call_factory(target: str, arguments: dict[str, Any] | None = None
                  ) -> tuple[Any, tuple, dict]:
    """Import FILE.py and call FACTORY(**arguments); check what it returns."""
    import torch

    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise UsageError(f"{target!r} is not FILE.py:FACTORY (e.g. examples/factories.py:gpt2)")
    file = Path(path)
    if not file.is_file():
        raise UsageError(f"{path}: no such file")
    log.info("loading %s", target)
    spec = importlib.util.spec_from_file_location(f"_pipecompile_factory_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise UsageError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(file.parent.resolve()))  # let the file import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - any failure of the user's file
        raise UsageError(f"importing {path} failed: {type(error).__name__}: {error}") from None
    finally:
        sys.path.pop(0)
    factory = getattr(module, name, None)
    if not callable(factory):
        found = sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_") and getattr(v, "__module__", None)
                       == module.__name__)
        raise UsageError(f"{path} has no function {name!r}; functions there: "
                         f"{', '.join(found) or 'none'}")
    arguments = arguments or {}
    call = f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"
    log.info("building the model: %s", call)
    try:
        made = factory(**arguments)
    except Exception as error:  # noqa: BLE001
        raise UsageError(f"{call} raised {type(error).__name__}: {error}") from None
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise UsageError(f"{name}() returned {type(made).__name__}; return (model, "
                         f"example_inputs) or (model, example_inputs, example_kwargs)")
    model, inputs, kwargs = (*made, {}) if len(made) == 2 else made
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{name}() returned a {type(model).__name__} as the model; expected a "
                         f"torch.nn.Module")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)) or not isinstance(kwargs or {}, dict):
        raise UsageError(f"{name}() must return example_inputs as a tuple and example_kwargs as "
                         f"a dict")
    return model, tuple(inputs), dict(kwargs or {})


def _stage_json(stage, program) -> dict[str, Any]:
    blocks = program.linear.blocks
    c = stage.cost
    return {"index": stage.index, "device": str(stage.device),
            "blocks": [blocks[b].name for b in stage.blocks],
            "inputs": list(stage.inputs), "outputs": list(stage.outputs),
            "parameters": c.params if c else None,
            "forward_flops": c.forward_flops if c else None,
            "forward_time_s": c.forward_time if c else None,
            "backward_time_s": c.backward_time if c else None,
            "memory_bytes": c.memory if c else None,
            "inflight": c.inflight if c else None}


def _predicted_json(pipe) -> dict[str, Any]:
    t = pipe.predicted
    if t is None:
        return {"step_time_s": None, "bubble_fraction": None, "peak_inflight": None}
    return {"step_time_s": t.makespan, "bubble_fraction": t.bubble_fraction,
            "peak_inflight": [t.peak_inflight(s) for s in range(len(pipe.program.stages))]}


@contextlib.contextmanager
def _progress_on_stderr():
    """Show pipecompile's INFO log lines (progress) on stderr while a command runs: a bar
    rewritten in place on a terminal, plain lines otherwise (`outputs.progress_bar`)."""
    logger = logging.getLogger("pipecompile")
    saved = logger.level, logger.propagate
    handler = progress_handler(lambda: sys.stderr)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    # a bar wants frequent counts from the long loops; plain lines keep the library's pace
    every = (reporting_every(_BAR_EVERY_S) if isinstance(handler, ProgressBar)
             else contextlib.nullcontext())
    try:
        with every:
            yield
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _optimizer(name: str, params: list) -> Any:
    """The --optimizer NAME over `params` (its state is what the stages' memory counts)."""
    import torch

    return {"sgd": lambda: torch.optim.SGD(params, lr=0.01, momentum=0.9),
            "adam": lambda: torch.optim.Adam(params), "adamw": lambda: torch.optim.AdamW(params)
            }[name]()


def _argument(text: str) -> tuple[str, Any]:
    """KEY=VALUE of --arg: the value as a Python literal (8, 0.5, 'x', True), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. layers=8)")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def _version() -> str:
    from . import __version__

    return __version__


def _count_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count or 'auto'") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipecompile", description="Compile a PyTorch model into a pipeline and inspect, "
        "plan or export it.")
    parser.add_argument("--version", action="version", version=f"pipecompile {_version()}")
    commands = parser.add_subparsers(dest="name", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("target", metavar="FILE.py:FACTORY",
                        help="a function returning (model, inputs) or (model, inputs, kwargs)")
    common.add_argument("--devices", type=int, default=2, help="number of devices (default 2)")
    common.add_argument("--microbatches", type=_count_or_auto, default="auto",
                        help="a count or auto (default: auto, chosen by the planning search)")
    common.add_argument("--schedule", default="auto",
                        help=f"auto, {', '.join(SCHEDULE_NAMES)}, or a .csv/.txt file "
                             f"holding a written schedule (default auto)")
    common.add_argument("--capture", default="export", choices=("export", "fx"))
    common.add_argument("--device", metavar="NAME",
                        help="plan for devices of a named preset that need not be here "
                             "(h100, h200, a100); nothing is measured or run")
    common.add_argument("--link", default="nvlink", choices=("nvlink", "infiniband"),
                        help="the preset's link between pipeline devices (default nvlink)")
    common.add_argument("--nodes", type=int, metavar="N",
                        help="plan for a cluster of N nodes of --device (with --per-node): "
                             "the layout (pipeline x data parallel) is searched")
    common.add_argument("--per-node", type=int, metavar="K",
                        help="devices per node of the cluster (default 8)")
    common.add_argument("--global-batch", type=int, metavar="B",
                        help="the global batch: passed to FACTORY as batch=B")
    common.add_argument("--arg", type=_argument, action="append", default=[],
                        metavar="KEY=VALUE", help="a keyword argument for FACTORY (repeatable)")
    common.add_argument("--optimizer", default="none", choices=("none", "sgd", "adam", "adamw"),
                        help="count this optimizer's state in the stages' memory")
    common.add_argument("--json", action="store_true", help="print one JSON object")
    common.add_argument("--debug", action="store_true",
                        help="on an error, print its traceback before the one-line message")
    inspect_ = commands.add_parser("inspect", parents=[common],
                                  help="stage table, cuts and boundary tensors, code")
    inspect_.add_argument("--code", action="store_true", help="print each stage's graph code")
    inspect_.add_argument("--runtime", action="store_true",
                          help="print each device's generated training step")
    inspect_.add_argument("--draw", metavar="PATH", help="draw the partition (.svg or .png)")
    inspect_.set_defaults(command=_inspect)
    plan = commands.add_parser("plan", parents=[common],
                               help="schedule grid, predicted step time, bubble, in-flight")
    plan.add_argument("--gantt", metavar="PATH", help="draw the predicted timeline (.png/.svg)")
    plan.set_defaults(command=_plan)
    export = commands.add_parser("export", parents=[common], help="ONNX files and/or saved program")
    export.add_argument("--onnx", metavar="DIR", help="write stageN.onnx and manifest.json")
    export.add_argument("--save", metavar="DIR", help="write the program for pipecompile.load")
    export.set_defaults(command=_export)
    return parser
