"""Spawn real torch.distributed processes (gloo on loopback) for tests."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn, world_size: int, *args, timeout: float = 180.0) -> list:
    """Run fn(rank, *args) on `world_size` gloo ranks; returns each rank's result.

    A rank that raised returns {"error": message}; a rank that died returns {"died": exitcode}.
    """
    port = free_port()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, port, tmp, args))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        results = []
        for rank, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
                results.append({"died": "hung"})
                continue
            path = os.path.join(tmp, f"rank{rank}.pt")
            if os.path.exists(path):
                results.append(torch.load(path, weights_only=False))
            else:
                results.append({"died": p.exitcode})
        return results


def _entry(fn, rank, world_size, port, tmp, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
    try:
        if dist.is_initialized() and "error" not in result:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
