"""Run a test body on N ranks of a real torch.distributed process group over loopback.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, each initialising a process group on a
free local port, calls ``fn(rank, world_size, *args)`` (a module-level function, picklable), and returns the
ranks' return values in rank order. An exception on any rank fails the caller with that rank's traceback; a
rank that hangs is killed after ``timeout`` seconds.

``DEVICE`` (environment variable ``ROPE_EXT_DIST_DEVICE``, default ``cpu``) is where the tests put
their tensors: ``cpu`` uses gloo; ``cuda`` (benchmarks/gpu_check.sh) uses NCCL when there is a GPU per
rank, else gloo over CUDA tensors with the ranks sharing the GPUs.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

DEVICE = os.environ.get("ROPE_EXT_DIST_DEVICE", "cpu")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        backend = "gloo"
        if DEVICE == "cuda":
            n = torch.cuda.device_count()
            torch.cuda.set_device(rank % n)
            backend = "nccl" if n >= world_size else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            queue.put((rank, True, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  (reported to the parent, which fails the test)
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
