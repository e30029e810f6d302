"""Spawn gloo ranks on CPU for multi-rank tests, with a hard timeout.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, each initialising a gloo group
and calling ``fn(rank, world_size, *args)`` (a module-level function); returns the list of per-rank
return values. If any rank raises, the others are killed at once (a rank stuck in a collective never
hangs the test) and an AssertionError carries every rank's traceback.
"""
from __future__ import annotations

import os
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp


def _worker(fn, rank, world_size, store_path, args, results, timeout_s):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # A file store, not a TCP one on a port picked free in the parent: the other xdist worker's ranks
        # could take that port before rank 0 listened (EADDRINUSE, a CI failure)
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timedelta(seconds=timeout_s))   # (init_process_group sets it only on its own stores)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
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
    store_dir = tempfile.mkdtemp(prefix="seqpar-test-ranks-")
    store_path = os.path.join(store_dir, "gloo-store")
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store_path, args, results, timeout_s),
                         daemon=True) for r in range(world_size)]
    outputs, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
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
        shutil.rmtree(store_dir, ignore_errors=True)
