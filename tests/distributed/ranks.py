"""Start real torch.distributed processes (gloo on loopback) for tests.

The ranks are forked from a forkserver that imported torch, pipecompile and the test models
once per test process (`_PRELOAD`), so a job starts in well under a second instead of paying
those imports again in every rank (seconds each, and more on a loaded machine). The server
runs no model: besides imports it only measures this machine's rates once, as a rank would
(tests/distributed/warm_server.py; about 1 s of CPU and 3 s of waiting saved in every rank),
so what a rank computes does not depend on the jobs before it. Each rank gets the caller's
environment and working directory and torch's fresh-process random state, as a spawned process
would.

A job given `warm` (`plan_first` and the cases modules' `plan_*`) first plans its models once
in one process forked from the server, then forks its ranks from that process: each rank
rebinds the kept captures and reads the kept symbolic costs instead of computing them again
(on 2 cores, 4 ranks capturing one model took as long as 2 captures in a row).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once by the forkserver; an import that fails there is retried in the rank
_PRELOAD = ["torch", "torch.distributed", "pipecompile", "tests.distributed.ranks", "tests.support.models",
            "transformers", "transformers.models.gpt2.modeling_gpt2",
            "tests.distributed.warm_server"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts (the first job)
    return ctx


def run_ranks(fn, world_size: int, *args, timeout: float = 900.0, warm=None) -> list:
    """Run fn(rank, *args) on `world_size` gloo ranks; returns each rank's result.

    A rank that raised returns {"error": message}; a rank that died returns {"died": exitcode};
    a rank still running `timeout` seconds after the start returns {"died": "hung"}. The limit
    only catches a hang: it is far above what a job takes on a loaded machine, so that how
    busy the machine is never decides a result.

    With `warm`, one process first runs warm() (it plans the job's models on one
    process, keeping their captures and symbolic costs in `pipecompile.default_cache`) and
    forks the ranks from itself: each rank finds them there instead of capturing and costing
    every model again, world_size times over on these 2 cores. A rank computes exactly what
    it would without (the kept captures are rebound to its own model: capture/reuse.py).
    """
    port = free_port()
    ctx = _context()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        setup = (port, tmp, args, env, os.getcwd(), list(sys.path))
        if warm is None:
            procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, *setup))
                     for rank in range(world_size)]
        else:  # one parent warms up, then forks the ranks (its process group: see below)
            procs = [ctx.Process(target=_warmed_job, args=(fn, warm, world_size, *setup))]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = any(p.is_alive() for p in procs)
        for p in procs:
            if p.is_alive():
                if warm is not None:  # the parent and the ranks it forked
                    os.killpg(p.pid, signal.SIGKILL)
                p.kill()
                p.join()
        results = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pt")
            if os.path.exists(path):
                results.append(torch.load(path, weights_only=False))
            elif hung:
                results.append({"died": "hung"})
            else:
                results.append({"died": procs[rank].exitcode if warm is None
                                else _exit_status(tmp, rank)})
        return results


def plan_first(model, args, kwargs=None, **options) -> None:
    """A `warm` for `run_ranks` (through functools.partial): compile's passes for `model` on
    (args, kwargs) with `options`, on this one process (a plan: no pipeline, no thread left to
    fork), so that the ranks forked after find its capture and symbolic costs in their cache.
    Give one replica's batch and the options that shape the capture and the blocks (devices,
    microbatches, loss_fn); a difference only costs the ranks their own capture again."""
    from pipecompile.ir.records import Example
    from pipecompile.planner.recipe import plan_for
    from pipecompile.planner.request import Request

    plan_for(Example(model, tuple(args), dict(kwargs or {}), None), Request.of(**options))


def _warmed_job(fn, warm, world_size, port, tmp, args, env, cwd, path):
    """The parent of a warmed job: warm() with the ranks' settings, then fork each rank
    (plain fork: it inherits the warmed cache) and wait for them. A failing warm-up fails
    every rank with its error. Its own process group lets the caller kill the whole job."""
    os.setpgid(0, 0)
    _fresh_process(env, cwd, path)
    try:
        warm()
    except BaseException as exc:  # noqa: BLE001 - reported to the test as every rank's error
        result = {"error": f"warm-up: {type(exc).__name__}: {exc}",
                  "trace": traceback.format_exc()}
        for rank in range(world_size):
            torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
        return
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                _entry(fn, rank, world_size, port, tmp, args, env, cwd, path)
                status = 0
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        children[pid] = rank
    while children:
        pid, status = os.wait()
        rank = children.pop(pid)
        with open(os.path.join(tmp, f"exit{rank}"), "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))


def _exit_status(tmp: str, rank: int):
    """A forked rank's exit code as its parent recorded it (None: the parent died first)."""
    try:
        with open(os.path.join(tmp, f"exit{rank}")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _fresh_process(env, cwd, path) -> None:
    """The caller's environment, directory and import path, one thread, and keeping
    captures: what a rank starts from, whichever process it was forked from."""
    os.environ.clear()  # the caller's environment now, not the server's when it started
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    torch.set_num_threads(1)
    # a job's cases compile a few architectures again and again: each rank keeps its captures
    # and rebinds them to the next model of the same architecture (as the suite's workers do:
    # tests/conftest.py)
    import pipecompile

    pipecompile.default_cache.captures = 32


def _entry(fn, rank, world_size, port, tmp, args, env, cwd, path):
    _fresh_process(env, cwd, path)
    torch.manual_seed(torch.initial_seed())  # the random state of a fresh process
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        # rendezvous through a file of this job's own directory: no port is chosen before it
        # is bound, so no other process can take it in between (MASTER_PORT stays set only
        # because the library reads torchrun's variables to know it runs as one of several)
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                                rank=rank, world_size=world_size)
        result = fn(rank, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
    try:
        if dist.is_initialized() and "error" not in result:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
