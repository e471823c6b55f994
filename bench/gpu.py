"""pipecompile on one GPU, in one command: exactness on CUDA, runtime overhead, the H100 preset
against the GPU it runs on, memory against the planner's prediction, compiled stages.

    PYTHONPATH=. python bench/gpu.py OUTDIR            # on a one-GPU machine: about 4-5 min
    PYTHONPATH=. python bench/gpu.py OUTDIR --dry-run  # the same code paths on the CPU, tiny sizes

Writes OUTDIR/gpu.json (every number, the error text of any section that failed) and
OUTDIR/gpu.md (the same as tables), both rewritten after every section, so a run cut short
keeps what it measured. Sections, in order of priority (each in bench/_gpu_checks.py or
bench/_gpu_perf.py, each in its own try/except, each with a time budget; past the global
deadline the rest are skipped with a note):

    env        GPU name, capability, memory, torch / transformers / CUDA / NCCL versions
    kernels    every kernel price (passes/kernel_prices.py) against the kernel on the GPU at
               published runs' shapes: GEMMs by shape, attention by sequence / head dim / mask,
               memory-bound ops, the loss over a vocabulary, AdamW and clipping, the launch
               floor; the constants the measurements imply (bench/_gpu_kernels.py)
    exactness  GPT-2 and Llama (transformers, tiny configs) at 1 and 2 stages on one device
               (two device threads and streams), gpipe / 1f1b / zb-h1: loss and gradients
               against the unsplit model on the same micro-batches, float32 and bf16 autocast
    overhead   a ~100M-parameter Llama, one stage, pipe.step against the plain training step;
               the fixed cost per action from step time against micro-batch count
    preset     the H100 preset's prediction of forward+backward per micro-batch (100M Llama,
               one Llama-3-8B layer at sequence 2048 and 4096) against the GPU; matmul, SDPA
               and bandwidth microbenchmarks; the preset's constants as measured here
    memory     the allocator's peak against the planner's predicted memory, 1 and 2 stages
    tp         tensor parallelism (not in the package yet: skipped with a note)
    compiled   compile_stages=True on CUDA: exactness and speed against eager stages (last:
               inductor's compile cannot be stopped halfway)

Only the public API is used (`pc.compile`, `pipe.step`, `pipe.named_parameters`, the plan's
stage costs, `pc.preset`). Runs on torch >= 2.6 (the GPU machine has torch 2.11).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

import pipecompile as pc  # noqa: E402
import _gpu_checks as checks  # noqa: E402
import _gpu_kernels as kernel_checks  # noqa: E402
import _gpu_perf as perf  # noqa: E402
from _gpu_common import Ctx, fresh_thread_state, log, release  # noqa: E402

DEADLINE_S = 240.0  # past this, the remaining sections are skipped (the run fits ~4-5 min)
DRY_DEADLINE_S = 600.0
# seconds per section on the GPU (a section checks its budget between its cases)
BUDGETS = {"env": 10, "kernels": 90, "exactness": 40, "overhead": 30, "preset": 15, "memory": 10,
           "tp": 5, "compiled": 40}
# seconds a section needs before the deadline to start at all (compiling stages with inductor
# cannot be stopped halfway: it runs last, and only with this much time left)
NEEDS = {"compiled": 20.0}


def env(ctx: Ctx, out: dict[str, Any]) -> None:
    """Where this ran: the GPU and the versions."""
    import transformers

    out.update(python=platform.python_version(), torch=torch.__version__,
               transformers=transformers.__version__, cuda_runtime=torch.version.cuda,
               cuda_available=torch.cuda.is_available(), cpu_count=os.cpu_count(),
               device=ctx.device, dry_run=ctx.dry, revision=_revision())
    try:
        import torch.distributed as dist
        out["nccl_available"] = bool(dist.is_available() and dist.is_nccl_available())
        out["gloo_available"] = bool(dist.is_available() and dist.is_gloo_available())
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        out["distributed_error"] = repr(exc)
    if not torch.cuda.is_available():
        out["gpu"] = None
        return
    props = torch.cuda.get_device_properties(0)
    out.update(gpu=torch.cuda.get_device_name(0),
               capability=".".join(map(str, torch.cuda.get_device_capability(0))),
               gpu_memory_bytes=props.total_memory, gpu_count=torch.cuda.device_count())
    extras: dict[str, Callable[[], Any]] = {
        "multiprocessors": lambda: props.multi_processor_count,
        "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled,
        "tf32_matmul": lambda: torch.backends.cuda.matmul.allow_tf32,
        "nccl_version": torch.cuda.nccl.version,
        "free_memory_bytes": lambda: torch.cuda.mem_get_info()[0]}
    for key, read in extras.items():
        try:
            value = read()
            out[key] = ".".join(map(str, value)) if isinstance(value, tuple) else value
        except Exception as exc:  # noqa: BLE001 - an API this torch lacks: noted
            out[key] = f"unavailable: {exc!r}"


def tensor_parallel(ctx: Ctx, out: dict[str, Any]) -> None:
    import pipecompile as pc

    has = "tensor_parallel" in pc.compile.__code__.co_varnames
    out["note"] = ("compile() takes tensor_parallel: a PP x TP check belongs here" if has else
                   "no tensor parallelism in pipecompile yet: nothing to check")


SECTIONS: list[tuple[str, Callable[[Ctx, dict[str, Any]], None]]] = [
    ("env", env), ("kernels", kernel_checks.kernels), ("exactness", checks.exactness), ("overhead", perf.overhead),
    ("preset", perf.preset_vs_gpu), ("memory", checks.memory), ("tp", tensor_parallel),
    ("compiled", checks.compiled_stages)]


def _revision() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001 - no git on the machine
        return "?"


class Report:
    """The sections' results, written to OUTDIR/gpu.json and gpu.md after every section."""

    def __init__(self, outdir: str, argv: list[str]):
        os.makedirs(outdir, exist_ok=True)
        self.outdir = outdir
        self.data: dict[str, Any] = {"command": "python bench/gpu.py " + " ".join(argv),
                                     "started": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                              time.gmtime()),
                                     "sections": {}}

    def run(self, name: str, fn: Callable[[Ctx, dict[str, Any]], None], ctx: Ctx) -> None:
        out: dict[str, Any] = {}
        entry: dict[str, Any] = {"status": "running", "result": out}
        self.data["sections"][name] = entry
        needs = 0.0 if ctx.dry else NEEDS.get(name, 0.0)
        if ctx.elapsed() + needs > ctx.deadline_s:
            entry["status"] = "skipped"
            entry["note"] = (f"skipped: {ctx.elapsed():.0f} s past the start, {needs:.0f} s "
                             f"needed before the {ctx.deadline_s:.0f} s deadline")
            log(f"{name}: {entry['note']}")
            self.write()
            return
        ctx.start_section(BUDGETS[name] * (3 if ctx.dry else 1))
        log(f"{name}: start (budget {ctx.section_budget:.0f} s)")
        start = time.monotonic()
        try:
            fresh_thread_state()  # a section never starts in a state an earlier one left
            fn(ctx, out)
            entry["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - recorded; the next section runs
            entry["status"] = "error"
            entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            entry["traceback"] = traceback.format_exc()[-3000:]
            log(f"{name}: ERROR {entry['error'][:300]}")
        finally:
            entry["seconds"] = round(time.monotonic() - start, 2)
            release(ctx)
        log(f"{name}: {entry['status']} in {entry['seconds']:.1f} s")
        self.write()

    def write(self) -> None:
        self.data["written"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        path = os.path.join(self.outdir, "gpu.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(path + ".tmp", path)
        with open(os.path.join(self.outdir, "gpu.md"), "w") as f:
            f.write(markdown(self.data))


def markdown(data: dict[str, Any]) -> str:
    """The report as Markdown: per section its status, scalars, then each list of rows as a
    table."""
    env_result = data["sections"].get("env", {}).get("result", {})
    lines = [f"# pipecompile measured on {env_result.get('gpu') or 'CPU (dry run)'}", "",
             f"`{data['command']}`, started {data['started']}; torch "
             f"{env_result.get('torch', '?')}, transformers {env_result.get('transformers', '?')}",
             ""]
    for name, entry in data["sections"].items():
        lines += [f"## {name}: {entry['status']} ({entry.get('seconds', 0)} s)", ""]
        for key in ("note", "error"):
            if key in entry:
                lines += [f"{key}: {entry[key]}", ""]
        if "traceback" in entry:
            lines += ["```", entry["traceback"][-1500:], "```", ""]
        result = entry.get("result", {})
        scalars = {k: v for k, v in result.items() if not isinstance(v, (list, dict))}
        lines += [f"- {k}: {_fmt(v)}" for k, v in scalars.items()]
        for key, value in result.items():
            if isinstance(value, dict):
                lines += [f"- {key}: " + ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())]
        lines.append("")
        for key, value in result.items():
            if isinstance(value, list) and value and isinstance(value[0], dict):
                lines += [f"### {key}", "", *_table(value), ""]
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(rows: list[dict[str, Any]]) -> list[str]:
    header: list[str] = []
    for row in rows:
        header += [k for k in row if k not in header]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        out.append("| " + " | ".join(_fmt(row.get(k, "")).replace("|", "/").replace("\n", " ")
                                     for k in header) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same code paths on the CPU at tiny sizes (about a minute)")
    parser.add_argument("--sections", default=",".join(n for n, _ in SECTIONS),
                        help="comma-separated subset, in the default order")
    parser.add_argument("--deadline", type=float, default=None,
                        help=f"seconds after which sections are skipped ({DEADLINE_S:.0f})")
    opts = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    dry = opts.dry_run or not torch.cuda.is_available()
    deadline = opts.deadline or (DRY_DEADLINE_S if dry else DEADLINE_S)
    ctx = Ctx(device="cpu" if dry else "cuda:0", dry=dry, deadline_s=deadline)
    if dry:  # the sections compile the same tiny models again: reuse their captures (exact,
        # pipecompile/capture/reuse.py); the GPU run captures every model afresh, as users do
        pc.default_cache.captures = 16
    report = Report(opts.outdir, argv)
    if not opts.dry_run and dry:
        report.data["note"] = "no CUDA device: ran the dry run instead"
    log(f"bench/gpu.py -> {opts.outdir} on {ctx.device} (dry run: {dry}), "
        f"deadline {deadline:.0f} s")
    wanted = opts.sections.split(",")
    for name, fn in SECTIONS:
        if name in wanted:
            report.run(name, fn, ctx)
    report.data["total_seconds"] = round(ctx.elapsed(), 1)
    report.write()
    log(f"done in {ctx.elapsed():.0f} s: {os.path.join(opts.outdir, 'gpu.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
