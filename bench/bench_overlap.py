#!/usr/bin/env python3
"""Benchmark: GEMMs overlapped with the sequence-parallel all-gather / reduce-scatter (issue 5).

Parts (``--part``: ``all`` (the default) or a comma-separated list; rows appended to
``<out>/bench_overlap.csv``):

``gemm`` (GPU; device time, :func:`seqpar.bench.timing.device_time`: calls back to back with the host
    ahead, so a chunk GEMM of 10-30 us is timed without the host's launch gaps; the eager call time, CUDA
    events around one call, beside it as ``call_ms``): the cost of chunking. For every linear layer of the
    paper's models (22B, 175B, 530B; per-GPU shards at t = 8, s = 2048, micro-batch b from the paper's Table 3)
    and each chunked pass -- forward and input gradient of both ops -- the plain GEMM over all s*b rows
    vs the same GEMM as t row chunks written into slices of one output (what the overlapped path runs;
    beside it t/2 merged chunks and, on a GPU, the t chunks on two streams: see chunk_variants),
    and the extra "sum of t partials" of the pairwise reduce-scatters (matmul_reduce_scatter forward,
    all_gather_matmul input gradient); plain times of the weight gradients for the projection. bf16.
    Without CUDA this part says so and is skipped; ``--quick`` runs it on CPU with tiny shapes as a
    smoke test.
``gloo`` (CPU, 2 and 4 gloo ranks, one thread each, each rank's threads bound to one core unless
    ``--no-pin``; median over iterations of the slowest rank):
    all_gather_matmul and matmul_reduce_scatter, forward + backward and forward alone, plain
    (ChunkPlan(1)) vs overlapped (ChunkPlan(t)), plus the same GEMMs alone (no group, same FLOPs) and
    the plain path's collectives alone; overlap hides communication when overlapped < gemm + comm.
    Then two TransformerLayers with sequence parallelism, ``overlap_comm`` False vs True (the op
    heuristic picks).
    The layers also run with every collective and transfer turned into a no-op ("compute alone"),
    which gives the communication the plain layer exposes and the share of it overlapping hides.
    Speedups are paired (:func:`seqpar.bench.timing.paired_speedup`): the median over iterations of
    plain / overlapped, with a bootstrap 95% interval; "overlapped is faster" means its low end > 1.
``project``: a model of one GPU's step, for the paper's models at t = 8. Two resources in program
    order: the compute stream (GEMMs, sums) and the NVLink egress (every transfer, p2p or collective,
    one at a time at ``--bandwidth-gbs`` GB/s plus ``--latency-us`` per transfer). A transfer starts
    when the link is free and every compute op issued before it has finished (NCCL's stream waits on
    the current stream at issue); ``wait`` makes the compute stream wait for a transfer. The schedules
    are exactly the ops' loops (seqpar/ops/comm_matmul.py) under the plan ``overlap=True`` picks on a
    GPU (``ChunkPlan.choose``), and the plain path (bulk collectives: one transfer of (t-1) shards;
    backward of all_gather_matmul overlaps them with the GEMMs as Megatron does, which the GPU plan
    keeps; the chunked alternative it rejects is reported as ``chunked_bwd_us``). GEMM times come
    from the ``gemm`` part of this run (provider "measured"), else from ``--tflops`` (provider
    "assumed"); sums from ``--hbm-gbs``. Reports, per linear and pass and per
    model layer (2 all_gather_matmul + 2 matmul_reduce_scatter, fwd + bwd): time plain vs overlapped,
    speedup, and the share of the communication hidden = 1 - (overlapped - its compute) / comm.

Usage:
    python bench/bench_overlap.py                       # all parts, rows to bench/results/
    python bench/bench_overlap.py --part gloo --world-sizes 2,4
    python bench/bench_overlap.py --part gemm,project   # the GPU's parts (bench/gpu_suite.sh)
    python bench/bench_overlap.py --quick               # CPU smoke test of every part (tiny shapes; no rows
                                                        # written unless --out is given)
    python bench/bench_overlap.py --out DIR             # rows to DIR/bench_overlap.csv (bench/gpu_suite.sh)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from seqpar.bench.options import comma_list  # noqa: E402
from seqpar.bench.results import ResultRows  # noqa: E402
from seqpar.bench.timing import device_time, median_ms, paired_speedup  # noqa: E402
from seqpar.parallel.overlap import ChunkPlan  # noqa: E402

# The paper's Table 3: (hidden, heads, micro-batch); s = 2048, t = 8 for all
MODELS = {"22B": (6144, 64, 4), "175B": (12288, 96, 1), "530B": (20480, 128, 1)}
SEQ, TP = 2048, 8
# (op, pass) whose GEMM the overlapped path splits into t row chunks (seqpar/ops/comm_matmul.py)
CHUNKED = {("ag", "fwd"), ("ag", "dgrad"), ("rs", "fwd"), ("rs", "dgrad")}
# (op, pass) whose chunks are partials summed by the pairwise reduce-scatter
SUMMED = {("ag", "dgrad"), ("rs", "fwd")}


def linears(h: int, t: int) -> List[Tuple[str, str, int, int]]:
    """(name, op, k, n) per linear of one layer, per-GPU shard: op 'ag' = all_gather_matmul, 'rs' =
    matmul_reduce_scatter; weight [n, k]."""
    return [("qkv", "ag", h, 3 * h // t), ("proj", "rs", h // t, h),
            ("fc1", "ag", h, 4 * h // t), ("fc2", "rs", 4 * h // t, h)]


# ---- part 1: chunked GEMM cost on one GPU -------------------------------------------------------------

def chunk_variants(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, t: int, device: torch.device
                   ) -> Dict[str, Callable[[], None]]:
    """``a @ w`` into ``out`` in row chunks: "chunked x{t}" (t GEMMs one after another: what the overlapped
    path runs), and the two ways to win back what small chunks lose to wave quantisation (a [256 x k] chunk
    GEMM has too few 128 x 128 output tiles to fill the SMs): "chunked x{t/2}" (pairs merged: half the
    overlap granularity) and, on a GPU, "chunked x{t} on 2 streams" (consecutive chunks overlap on the
    SMs, as they could once their inputs have arrived)."""
    m, kk = a.shape

    def chunked(n):
        o, x = out.view(n, m // n, -1), a.view(n, m // n, kk)
        return lambda: [torch.mm(x[i], w, out=o[i]) for i in range(n)]

    variants = {f"chunked x{t}": chunked(t)}
    if t % 2 == 0:
        variants[f"chunked x{t // 2}"] = chunked(t // 2)
    if device.type == "cuda":
        main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
        out3, a3 = out.view(t, m // t, -1), a.view(t, m // t, kk)

        def two_streams():
            side.wait_stream(main)
            for i in range(t):
                with torch.cuda.stream(main if i % 2 == 0 else side):
                    torch.mm(a3[i], w, out=out3[i])
            main.wait_stream(side)

        variants[f"chunked x{t} on 2 streams"] = two_streams
    return variants


def part_gemm(args, rows: ResultRows) -> Dict[Tuple, float]:
    """Returns {(model, linear, pass, kind): ms} with kind in plain / chunked / sum."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.quick:
        print("[gemm] needs a CUDA device (none found): skipped; --quick runs a CPU smoke test")
        return {}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    warmup, reps = (2, 3) if args.quick else (10, 50)
    measured = {}

    def timed(cfg: str, provider: str, fn: Callable[[], object]) -> float:
        """Device ms of ``fn`` (the metric the targets read), with the eager call time beside it. Timed one
        call at a time, a chunked variant's eight small GEMMs waited on the host's launches: the 22B
        projection's input gradient read 0.72 of plain in one H200 run and 0.56 in another."""
        call = median_ms(fn, device, warmup, reps)
        ms = device_time(fn, device).ms if device.type == "cuda" else call
        rows.add("gemm", cfg, provider, "call_ms", call)
        return ms

    print(f"[gemm] {device} {dtype}: plain vs {TP} row chunks (ms, (TFLOP/s), chunked/plain throughput)")
    for model, (h, _, b) in MODELS.items():
        seq = SEQ
        if args.quick:        # same structure, tiny sizes
            h, seq = h // 64, 64
        R, t = seq * b, TP
        for name, op, k, n in linears(h, t):
            # forward: [R, k] @ [k, n]; input gradient: [R, n] @ [n, k]; weight gradient [n, R] @ [R, k]
            for pss, (m, kk, nn_) in (("fwd", (R, k, n)), ("dgrad", (R, n, k)), ("wgrad", (n, R, k))):
                a = torch.randn(m, kk, device=device, dtype=dtype)
                w = torch.randn(kk, nn_, device=device, dtype=dtype)
                out = torch.empty(m, nn_, device=device, dtype=dtype)
                flops = 2.0 * m * kk * nn_
                cfg = f"{model} {name} {pss} [{m}x{kk}]@[{kk}x{nn_}]"
                ms_p = timed(cfg, "plain", lambda: torch.mm(a, w, out=out))
                rows.add("gemm", cfg, "plain", "ms", ms_p)
                rows.add("gemm", cfg, "plain", "TFLOP/s", flops / ms_p / 1e9)
                measured[(model, name, pss, "plain")] = ms_p
                line = f"  {cfg:48s} plain {ms_p:8.3f} ({flops / ms_p / 1e9:6.1f})"
                if (op, pss) in CHUNKED:
                    for variant, fn in chunk_variants(a, w, out, t, device).items():
                        ms_c = timed(cfg, variant, fn)
                        rows.add("gemm", cfg, variant, "ms", ms_c)
                        rows.add("gemm", cfg, variant, "TFLOP/s", flops / ms_c / 1e9)
                        rows.add("gemm", cfg, variant, "throughput_vs_plain", ms_p / ms_c)
                        if variant == f"chunked x{t}":     # what the overlapped path runs
                            measured[(model, name, pss, "chunked")] = ms_c
                            line += f"  chunked {ms_c:8.3f} ({flops / ms_c / 1e9:6.1f})  ratio {ms_p / ms_c:5.3f}"
                        else:
                            line += f"  {variant.split(' ', 1)[1]} {ms_p / ms_c:5.3f}"
                if (op, pss) in SUMMED:           # the pairwise reduce-scatter's sum of t partials
                    parts = torch.randn(t, m // t, nn_, device=device, dtype=dtype)
                    red = torch.empty(m // t, nn_, device=device, dtype=dtype)
                    ms_s = timed(cfg, "partials-sum", lambda: torch.sum(parts, 0, out=red))
                    rows.add("gemm", cfg, "partials-sum", "ms", ms_s)
                    measured[(model, name, pss, "sum")] = ms_s
                    line += f"  +sum {ms_s:.3f}"
                print(line)
    return measured


# ---- part 2: CPU gloo, plain vs overlapped -----------------------------------------------------------

def _timed(fns: Dict[str, object], iters: int, warmup: int) -> Dict[str, List[float]]:
    """Per function, the slowest rank's time (ms) of every iteration; the functions take turns within
    every iteration, so a load change on the machine hits them alike (and pairs them for
    :func:`seqpar.bench.timing.paired_speedup`)."""
    import torch.distributed as dist

    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times[name].append(dt.item() * 1e3)
    return times


def _pin_to_core(rank: int) -> None:
    """Bind every thread of this rank (its compute thread and gloo's) to core ``rank % cores``, as a
    CPU launcher binds ranks: the GEMM then shares its core only with its own rank's transfers, not
    with threads the scheduler migrates in. Linux only (elsewhere a no-op)."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return
    cores = sorted(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {cores[rank % len(cores)]})
        except OSError:      # a thread that just exited
            pass


class _NoTransfer:
    def wait(self) -> bool:
        return True


@contextlib.contextmanager
def _without_communication():
    """Every collective and transfer the layer issues becomes a no-op (results are garbage): what is
    left is the layer's own compute, plain or chunked, to tell how much communication was hidden."""
    import torch.distributed as dist

    import seqpar.parallel.state as state

    def skip(*args, async_op=False, **kwargs):
        return _NoTransfer() if async_op else None

    saved = (state._all_gather_single, state._reduce_scatter_single, dist.all_reduce, dist.batch_isend_irecv)
    state._all_gather_single = state._reduce_scatter_single = dist.all_reduce = skip
    dist.batch_isend_irecv = lambda ops: [_NoTransfer()]
    try:
        yield
    finally:
        state._all_gather_single, state._reduce_scatter_single, dist.all_reduce, dist.batch_isend_irecv = saved


def _gloo_worker(rank, t, op_configs, layer_cfgs, iters, layer_iters, warmup, pin):
    import torch.distributed as dist

    import seqpar
    from seqpar.ops import all_gather_matmul, matmul_reduce_scatter
    from seqpar.parallel.overlap import record_schedule
    from seqpar.parallel.state import agreement_checked, all_gather_seq, reduce_scatter_seq

    group = dist.group.WORLD
    if pin:
        _pin_to_core(rank)
    torch.manual_seed(rank)
    results = []
    for rows_local, k, n in op_configs:
        R = rows_local * t
        # all_gather_matmul: x_shard [rows, 1, k], w [n, k]; matmul_reduce_scatter: x [R, 1, k], w [n, k]
        x_shard, x_full = torch.randn(rows_local, 1, k, requires_grad=True), torch.randn(R, 1, k, requires_grad=True)
        w = torch.randn(n, k, requires_grad=True)
        gy_full, gy_shard = torch.randn(R, 1, n), torch.randn(rows_local, 1, n)

        # The ops as a layer runs them: without their per-call input agreement (the layer's check covers it)
        def ag(plan):
            with agreement_checked():
                all_gather_matmul(x_shard, w, group=group, overlap=plan).backward(gy_full)

        def rs(plan):
            with agreement_checked():
                matmul_reduce_scatter(x_full, w, group=group, overlap=plan).backward(gy_shard)

        def gemm_only():      # the same FLOPs with no communication (either op: R x k x n, fwd + bwd)
            torch.nn.functional.linear(x_full, w).backward(gy_full)

        x_flat_full = torch.randn(R, 1, k)

        def comm_ag():        # the plain path's collectives: gather, re-gather, reduce-scatter of grad_x
            all_gather_seq(x_shard.detach(), group)
            all_gather_seq(x_shard.detach(), group)
            reduce_scatter_seq(x_flat_full, group)

        y_full = torch.randn(R, 1, n)

        def comm_rs():        # reduce-scatter of the output, all-gather of its gradient
            reduce_scatter_seq(y_full, group)
            all_gather_seq(gy_shard, group)

        @torch.no_grad()
        def ag_fwd(plan):
            with agreement_checked():
                all_gather_matmul(x_shard, w, group=group, overlap=plan)

        @torch.no_grad()
        def rs_fwd(plan):
            with agreement_checked():
                matmul_reduce_scatter(x_full, w, group=group, overlap=plan)

        @torch.no_grad()
        def gemm_only_fwd():
            torch.nn.functional.linear(x_full, w)

        def comm_ag_fwd():
            all_gather_seq(x_shard.detach(), group)

        def comm_rs_fwd():
            reduce_scatter_seq(y_full, group)

        cfg = f"t={t} rows/rank={rows_local} k={k} n={n}"
        for op_name, passes, fn, gemm, comm in (
                ("all_gather_matmul", "fwd+bwd", ag, gemm_only, comm_ag),
                ("matmul_reduce_scatter", "fwd+bwd", rs, gemm_only, comm_rs),
                ("all_gather_matmul", "fwd", ag_fwd, gemm_only_fwd, comm_ag_fwd),
                ("matmul_reduce_scatter", "fwd", rs_fwd, gemm_only_fwd, comm_rs_fwd)):
            m = _timed({"plain": lambda: fn(ChunkPlan(1)), "overlapped": lambda: fn(ChunkPlan(t)),
                        "gemm_only": gemm, "comm_only": comm}, iters, warmup)
            results.append((f"{op_name} {passes} {cfg}", m, None))
    for h, heads, seq, b in layer_cfgs:
        steps, plans = {}, {}
        for overlap in (False, True):
            seqpar.manual_seed(0)
            cfg = seqpar.TransformerConfig(hidden_size=h, num_attention_heads=heads, sequence_parallel=True,
                                           overlap_comm=overlap)
            layer = seqpar.TransformerLayer(cfg, tp_group=group)
            x = torch.randn(seq // t, b, h, requires_grad=True)
            gy = torch.randn(seq // t, b, h)
            steps[overlap] = lambda layer=layer, x=x, gy=gy: layer(x).backward(gy)
            with record_schedule() as ev:
                steps[overlap]()
            plans[overlap] = sum(1 for e in ev if e[0] == "exchange")

        def compute_only(step):
            with _without_communication():
                step()

        m = _timed({"plain": steps[False], "overlapped": steps[True],
                    "plain_compute_only": lambda: compute_only(steps[False]),
                    "overlapped_compute_only": lambda: compute_only(steps[True])}, layer_iters, warmup)
        results.append((f"TransformerLayer SP fwd+bwd t={t} h={h} heads={heads} s={seq} b={b}", m,
                        plans[True]))
    return results


def part_gloo(args, rows: ResultRows) -> None:
    from tests.distributed.launcher import run_ranks

    if args.quick:
        op_configs, layer_cfgs, iters, layer_iters, warmup = [(16, 32, 24)], [(32, 4, 32, 1)], 2, 2, 1
    else:
        op_configs = [(512, 1024, 256), (512, 1024, 1024)]
        # h=512 layers (a = 8, fp32, no dropout): s = 1024 is attention-heavy on a CPU (5as/h = 80);
        # s = 256, b = 4 has the same tokens and a bigger share of GEMM + communication
        layer_cfgs = [(512, 8, 1024, 1), (512, 8, 256, 4)]
        iters, layer_iters, warmup = args.iters, args.layer_iters, 2
    for t in args.world_sizes:
        print(f"[gloo] {t} ranks, one thread each{', pinned one per core' if args.pin else ''}: ms, median (min) "
              f"over iterations of the slowest rank; speedup = median of per-iteration plain/overlapped "
              f"[95% CI] (wins)")
        res = run_ranks(_gloo_worker, t, op_configs, layer_cfgs, iters, layer_iters, warmup, args.pin,
                        timeout_s=3600)[0]
        for cfg, times, transfers in res:
            cfg += " pinned" if args.pin else ""
            med = {name: statistics.median(v) for name, v in times.items()}
            low = {name: min(v) for name, v in times.items()}
            for name in times:
                rows.add("gloo", cfg, name, "median_ms", med[name])
                rows.add("gloo", cfg, name, "min_ms", low[name])
            sp = paired_speedup(times["plain"], times["overlapped"])
            for key in ("median", "ci_low", "ci_high", "wins", "pairs"):
                rows.add("gloo", cfg, "overlapped", f"speedup_vs_plain_{key}", sp[key])
            line = (f"  {cfg:66s} plain {med['plain']:7.2f} ({low['plain']:7.2f})  overlapped "
                    f"{med['overlapped']:7.2f} ({low['overlapped']:7.2f})  speedup {sp['median']:5.3f} "
                    f"[{sp['ci_low']:5.3f}, {sp['ci_high']:5.3f}] ({sp['wins']:.0%} of {int(sp['pairs'])})")
            if transfers is None:
                line += (f"  | gemm {med['gemm_only']:7.2f} + comm {med['comm_only']:7.2f} = "
                         f"{med['gemm_only'] + med['comm_only']:7.2f}")
            else:
                # communication the plain layer exposes, and the share of it the overlapped layer hides
                comm = med["plain"] - med["plain_compute_only"]
                hidden = (med["plain"] - med["overlapped"]) / comm if comm > 0 else float("nan")
                rows.add("gloo", cfg, "overlapped", "p2p_transfers", float(transfers))
                rows.add("gloo", cfg, "plain", "exposed_comm_ms", comm)
                rows.add("gloo", cfg, "overlapped", "comm_hidden", hidden)
                line += (f"  | compute alone {med['plain_compute_only']:7.2f} (chunked "
                         f"{med['overlapped_compute_only']:7.2f}), communication {comm:6.2f}, hidden {hidden:5.1%}"
                         f", {transfers} transfers")
            print(line)


# ---- part 3: projection --------------------------------------------------------------------------------

class _Sim:
    """One GPU: a compute stream and the link egress, ops in program order (see module docstring)."""

    def __init__(self):
        self.compute = self.link = self.compute_busy = self.link_busy = 0.0

    def gemm(self, dur):
        self.compute += dur
        self.compute_busy += dur

    def send(self, dur) -> float:
        start = max(self.link, self.compute)
        self.link = start + dur
        self.link_busy += dur
        return self.link

    def wait(self, end: Optional[float]):
        if end is not None:
            self.compute = max(self.compute, end)

    @property
    def total(self):
        return max(self.compute, self.link)


def _schedule(op, pss, plan, t, T):
    """Replay one pass of one op under ``plan`` (a ChunkPlan) on a fresh _Sim. T: durations (us)
    g_fwd/g_dgrad (chunk), G_fwd/G_dgrad (plain), W (weight gradient), c (one shard transfer), C (bulk
    collective), sum (partials sum)."""
    s = _Sim()
    if not plan.overlapped or ((op, pss) == ("ag", "bwd") and plan.bulk_ag_backward):
        if op == "ag" and pss == "fwd":
            s.wait(s.send(T["C"]))
            s.gemm(T["G_fwd"])
        elif op == "rs" and pss == "fwd":
            s.gemm(T["G_fwd"])
            s.wait(s.send(T["C"]))
        elif op == "ag":              # Megatron order: re-gather || dgrad, reduce-scatter || wgrad
            gather = s.send(T["C"])
            s.gemm(T["G_dgrad"])
            scatter = s.send(T["C"])
            s.wait(gather)
            s.gemm(T["W"])
            s.wait(scatter)
        else:
            s.wait(s.send(T["C"]))
            s.gemm(T["G_dgrad"])
            s.gemm(T["W"])
        return s
    P = plan.prefetch
    if (op, pss) in (("ag", "fwd"), ("rs", "bwd")):      # _gather_chunks: transfers || chunk GEMMs
        g = T["g_fwd"] if pss == "fwd" else T["g_dgrad"]
        ends, issued = [], 0
        for j in range(t):
            while issued < min(j + P, t - 1):
                ends.append(s.send(T["c"]))
                issued += 1
            if j > 0:
                s.wait(ends[j - 1])
            s.gemm(g)
        if pss == "bwd":
            s.gemm(T["W"])
        return s
    # _reduce_scatter_chunks: partial j sent right after its GEMM; all_gather_matmul's backward first
    # issues the t-1 re-gather transfers and runs the weight gradient beside the last partials
    regather = [s.send(T["c"]) for _ in range(t - 1)] if op == "ag" else []
    g = T["g_fwd"] if pss == "fwd" else T["g_dgrad"]
    ends = []
    for j in range(t):
        s.gemm(g)
        if j == t - 1:
            break
        if j >= P:
            s.wait(ends[j - P])
        ends.append(s.send(T["c"]))
    if regather:
        for end in regather:
            s.wait(end)
        s.gemm(T["W"])
    for end in ends:
        s.wait(end)
    s.gemm(T["sum"])
    return s


def part_project(args, rows: ResultRows, measured: Dict[Tuple, float]) -> None:
    bw, lat, t, e = args.bandwidth_gbs * 1e3, args.latency_us, TP, 2     # bytes/us; bf16
    provider = "measured" if measured else "assumed"
    print(f"[project] t={t}, link {args.bandwidth_gbs} GB/s per direction + {lat} us per transfer, GEMM times "
          + ("measured above" if measured else f"assumed at {args.tflops} TFLOP/s, sums at {args.hbm_gbs} GB/s"))
    for model, (h, _, b) in MODELS.items():
        R = SEQ * b
        tot = {False: 0.0, True: 0.0}
        comm_total = compute_ovl = 0.0
        for name, op, k, n in linears(h, t):
            def gemm_us(pss, kind, m, kk, nn_):
                key = (model, name, pss, kind)
                if key in measured:
                    return measured[key] * 1e3
                return 2.0 * m * kk * nn_ / (args.tflops * 1e6)
            shard_dim = k if op == "ag" else n                # x shards / grad_x partials vs y partials / grad_y shards
            c = R // t * shard_dim * e / bw + lat
            C = (t - 1) * R // t * shard_dim * e / bw + lat
            sum_us = measured.get((model, name, "fwd" if op == "rs" else "dgrad", "sum"))
            sum_us = sum_us * 1e3 if sum_us is not None else (t + 1) * R // t * shard_dim * e / (args.hbm_gbs * 1e3)
            T = dict(g_fwd=gemm_us("fwd", "chunked", R, k, n) / t, G_fwd=gemm_us("fwd", "plain", R, k, n),
                     g_dgrad=gemm_us("dgrad", "chunked", R, n, k) / t, G_dgrad=gemm_us("dgrad", "plain", R, n, k),
                     W=gemm_us("wgrad", "plain", n, R, k), c=c, C=C, sum=sum_us)
            # the plan overlap=True picks on a GPU for this linear (plain where the chunks are too small)
            plan = ChunkPlan.choose(True, t=t, chunk_rows=R // t, k=k, n=n, device=torch.device("cuda"))
            for pss in ("fwd", "bwd"):
                plain, ovl = _schedule(op, pss, ChunkPlan(1), t, T), _schedule(op, pss, plan, t, T)
                if (op, pss) == ("ag", "bwd") and plan.bulk_ag_backward:   # the alternative it rejects
                    chunked = _schedule(op, pss, dataclasses.replace(plan, bulk_ag_backward=False), t, T)
                    rows.add("project", f"{model} {name} {pss} t={t} bw={args.bandwidth_gbs}GB/s", provider,
                             "chunked_bwd_us", chunked.total)
                hidden = 1.0 - (ovl.total - ovl.compute_busy) / plain.link_busy
                cfg = f"{model} {name} {pss} t={t} bw={args.bandwidth_gbs}GB/s"
                rows.add("project", cfg, provider, "plain_us", plain.total)
                rows.add("project", cfg, provider, "overlapped_us", ovl.total)
                rows.add("project", cfg, provider, "comm_hidden", hidden)
                rows.add("project", cfg, provider, "speedup", plain.total / ovl.total)
                print(f"  {cfg:44s} plain {plain.total:8.1f} us  overlapped {ovl.total:8.1f} us  "
                      f"speedup {plain.total / ovl.total:5.3f}  comm {plain.link_busy:7.1f} us, hidden {hidden:6.1%}")
                tot[False] += plain.total
                tot[True] += ovl.total
                comm_total += plain.link_busy
                compute_ovl += ovl.compute_busy
        hidden = 1.0 - (tot[True] - compute_ovl) / comm_total
        cfg = f"{model} layer linears fwd+bwd t={t} bw={args.bandwidth_gbs}GB/s"
        rows.add("project", cfg, provider, "plain_us", tot[False])
        rows.add("project", cfg, provider, "overlapped_us", tot[True])
        rows.add("project", cfg, provider, "comm_hidden", hidden)
        rows.add("project", cfg, provider, "speedup", tot[False] / tot[True])
        print(f"  => {cfg}: plain {tot[False]:.0f} us, overlapped {tot[True]:.0f} us, speedup "
              f"{tot[False] / tot[True]:.3f}, communication hidden {hidden:.1%}")


PARTS = ("gemm", "gloo", "project")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", default="all", help=f"all, or a comma-separated list of {', '.join(PARTS)}")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few iterations: a CPU smoke test")
    p.add_argument("--out", help="directory for bench_overlap.csv, or a .csv path (rows are appended; default "
                                 "bench/results/, and with --quick nothing unless --out is given)")
    p.add_argument("--world-sizes", default="2,4", help="gloo ranks to run, comma separated")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per gloo op measurement")
    p.add_argument("--layer-iters", type=int, default=80, help="timed iterations per gloo layer measurement")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave gloo ranks unpinned (default: each rank's threads bound to core rank %% cores)")
    p.add_argument("--bandwidth-gbs", type=float, default=450.0,
                   help="link bandwidth per direction for the projection (NVLink 4: 450 GB/s)")
    p.add_argument("--latency-us", type=float, default=8.0, help="fixed cost per transfer in the projection")
    p.add_argument("--tflops", type=float, default=600.0,
                   help="GEMM throughput assumed by the projection when the gemm part did not run")
    p.add_argument("--hbm-gbs", type=float, default=3350.0,
                   help="memory bandwidth assumed for the partials sum when not measured")
    args = p.parse_args(argv)
    args.part = list(PARTS) if args.part == "all" else args.part.split(",")
    unknown = [part for part in args.part if part not in PARTS]
    if unknown:
        p.error(f"unknown --part {unknown}; choose all or a comma-separated list of {', '.join(PARTS)}")
    args.world_sizes = comma_list(p, "--world-sizes", args.world_sizes, check=lambda w: w >= 2, what="sizes >= 2")
    if args.iters < 2 or args.layer_iters < 2:
        p.error(f"--iters and --layer-iters must be >= 2, got {args.iters} and {args.layer_iters}")
    for name, value, allow_zero in (("bandwidth-gbs", args.bandwidth_gbs, False), ("tflops", args.tflops, False),
                                    ("hbm-gbs", args.hbm_gbs, False), ("latency-us", args.latency_us, True)):
        if not (math.isfinite(value) and (value > 0 or (allow_zero and value == 0))):
            p.error(f"--{name} must be finite and {'non-negative' if allow_zero else 'positive'}, got {value}")
    return args


def main(argv=None):
    args = parse_args(argv)
    # the CPU's 1-minute load average goes with the rows: gloo timings on a shared machine are noisy
    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    device = (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu") + f" ({os.cpu_count()} cores{load})"
    rows = ResultRows(device + (" quick" if args.quick else ""), "bench_overlap",
                      ("part", "config", "provider", "metric", "value"))
    measured = {}
    with rows.sweep():
        if "gemm" in args.part:
            measured = part_gemm(args, rows)
        if "gloo" in args.part:
            part_gloo(args, rows)
        if "project" in args.part:
            part_project(args, rows, {} if args.quick else measured)
    status = rows.finish(args.out, args.quick)   # a --quick run writes only where --out says
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
