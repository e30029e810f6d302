"""Spawn gloo ranks on CPU for multi-rank tests, with a hard timeout.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, each initialising a gloo group
and calling ``fn(rank, world_size, *args)`` (a module-level function); returns the list of per-rank
return values. If any rank raises, the others are killed at once (a rank stuck in a collective never
hangs the test) and an AssertionError carries every rank's traceback.
"""
from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, results, timeout_s):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        out = fn(rank, world_size, *args)
        results.put((rank, "ok", out))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout_s: float = 180.0):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, timeout_s), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(outputs) - set(errors))} "
                                     f"timed out after {timeout_s}s; errors so far: {errors}")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and p.exitcode not in (0, None) and r not in outputs and r not in errors]
                if dead:
                    raise AssertionError(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
                continue
            if status == "ok":
                outputs[rank] = payload
            else:
                errors[rank] = payload
                break  # one failure is enough: the others may be stuck in a collective
        if errors:
            raise AssertionError("rank failure:\n" + "\n".join(f"--- rank {r}\n{tb}" for r, tb in errors.items()))
        for p in procs:
            p.join(timeout=30)
        return [outputs[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
