"""Multi-rank (gloo, CPU) tests of all_gather_matmul / matmul_reduce_scatter, plain and ring-overlapped.

One spawn per world size runs every case (spawns are the expensive part):
* parity of the forward and of every gradient with a single-device fp64 reference built from the
  unsharded tensors, for the plain plan (chunks 1), the ring plan (chunks t) and ``overlap=True``;
  ugly shapes (odd s/t, k and n not multiples of 8), fp32 and bf16;
* the overlap order (``record_schedule``): the transfer of chunk i+1 is issued before the GEMM of
  chunk i and waited on only after it; a partial travels while the next one is computed; the
  re-gather of all_gather_matmul's backward travels during the input-gradient chunks and its last
  partials during the weight gradient (with ``bulk_ag_backward``: each async bulk collective is
  issued before the GEMM it hides behind);
* the number and size of collectives per forward / backward (torch.distributed patched in the rank
  process), and that only the plain path's tensors are saved for backward;
* subgroups that are not the world (t = 4 split in two groups of 2);
* one TransformerLayer with SP at t = 2: 4 all-gathers + 4 reduce-scatters + 2 backward re-gathers,
  all of them point-to-point sends when overlapped (the CPU plan), with equal results;
* under torch.autocast, fp32 operands computed in fp32 on every plan, the backward outside the block;
* outputs that take in-place ops on every path (they were views made inside the autograd Function on
  the ring path without a bias and the plain path with one: ``y.add_`` raised);
* cross-rank agreement naming a float on one rank and an int on another without printing a hash as a
  rank's value;
* input agreement (t = 2): uneven sequence shards, another n or dtype, or one rank's rejected argument
  in the comm GEMMs and the parallel linears are a ValueError on every rank before the first collective
  (gloo aborted the process, or returned a tensor of the wrong size), and so are differing overlap
  plans (another ``overlap``, or ``overlap=True`` sizing each rank's plan by its own weight shard),
  also under a dispatch mode such as FlopCounterMode, and a TransformerLayer under autocast on one rank
  only; uneven weight shards whose plans agree run; GPTModel's output GEMM, whose ranks hold different numbers of
  real vocabulary rows, picks one plan on every rank (it hung); how many agreements each entry
  point runs (one per op call and per standalone linear or block, none for a TransformerLayer's linears,
  inside ``agreement_checked()`` or with ``check_rank_inputs = False``);
* the device of the agreements' control tensors on an NCCL-only group (simulated): the group's bound device
  or the inputs', never the current device on every rank, and the CPU where the group has a CPU backend.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from seqpar.ops import all_gather_matmul, matmul_reduce_scatter
from seqpar.parallel.overlap import ChunkPlan, record_schedule
from seqpar.parallel.state import check_ranks_agree
from tests.distributed.launcher import run_ranks
from tests.tolerances import TOLERANCES, assert_close, assert_error_within

# (s_local, b, k, n): odd s/t, k and n not multiples of 8; AGMM uses n as n_local, MRS uses k as k_local
SHAPES = [(5, 3, 13, 11), (3, 1, 21, 6), (7, 2, 9, 17)]
DTYPES = [torch.float32, torch.bfloat16]


def _case_tensors(seed, t, s_local, b, k, n, dtype):
    """Unsharded inputs identical on every rank (same generator seed)."""
    g = torch.Generator().manual_seed(seed)
    s = s_local * t
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)  # noqa: E731
    return {
        # all_gather_matmul: x [s, b, k], W [t*n, k] (rank r owns rows r*n..), grad_y [s, b, t*n]
        "ag_x": mk(s, b, k).to(dtype), "ag_w": mk(t * n, k).to(dtype), "ag_b": mk(t * n).to(dtype),
        "ag_gy": mk(s, b, t * n).to(dtype),
        # matmul_reduce_scatter: x [s, b, t*k] (rank r owns columns r*k..), W [n, t*k], b [n], grad_y [s, b, n]
        "rs_x": mk(s, b, t * k).to(dtype), "rs_w": mk(n, t * k).to(dtype), "rs_b": mk(n).to(dtype),
        "rs_gy": mk(s, b, n).to(dtype),
    }


def _reference(T, r, t, s_local, n, k):
    """fp64 single-device results for rank r from the unsharded (dtype-rounded) tensors."""
    d = {key: v.double() for key, v in T.items()}
    rows, ncols, kcols = slice(r * s_local, (r + 1) * s_local), slice(r * n, (r + 1) * n), slice(r * k, (r + 1) * k)
    w_r, gy_r = d["ag_w"][ncols], d["ag_gy"][..., ncols]
    ag = {"y": d["ag_x"] @ w_r.t() + d["ag_b"][ncols],
          "gx": (d["ag_gy"] @ d["ag_w"])[rows],                                 # summed over all ranks' shards
          "gw": gy_r.reshape(-1, n).t() @ d["ag_x"].reshape(-1, d["ag_x"].shape[-1]),
          "gb": gy_r.reshape(-1, n).sum(0)}
    x_r, wk_r = d["rs_x"][..., kcols], d["rs_w"][:, kcols]
    gy_full = d["rs_gy"]
    rs = {"y": (d["rs_x"] @ d["rs_w"].t())[rows] + d["rs_b"],
          "gx": gy_full @ wk_r,
          "gw": gy_full.reshape(-1, gy_full.shape[-1]).t() @ x_r.reshape(-1, k),
          "gb": gy_full[rows].reshape(-1, gy_full.shape[-1]).sum(0)}
    return ag, rs


def _run_ag(T, r, t, s_local, n, group, overlap):
    x = T["ag_x"][r * s_local:(r + 1) * s_local].clone().requires_grad_()
    w = T["ag_w"][r * n:(r + 1) * n].clone().requires_grad_()
    b = T["ag_b"][r * n:(r + 1) * n].clone().requires_grad_()
    y = all_gather_matmul(x, w, b, group=group, overlap=overlap)
    y.backward(T["ag_gy"][..., r * n:(r + 1) * n])
    return {"y": y.detach(), "gx": x.grad, "gw": w.grad, "gb": b.grad}


def _run_rs(T, r, t, s_local, k, group, overlap):
    x = T["rs_x"][..., r * k:(r + 1) * k].clone().requires_grad_()
    w = T["rs_w"][:, r * k:(r + 1) * k].clone().requires_grad_()
    b = T["rs_b"].clone().requires_grad_()
    y = matmul_reduce_scatter(x, w, b, group=group, overlap=overlap)
    y.backward(T["rs_gy"][r * s_local:(r + 1) * s_local])
    return {"y": y.detach(), "gx": x.grad, "gw": w.grad, "gb": b.grad}


def _compare(got, plain, ref, dtype, what):
    """fp32: elementwise table tolerance. 16-bit: GEMM outputs carry one rounding per partial sum, so
    the error is bounded relative to the tensor's scale, and by 2x the plain path's own error."""
    for key in ("y", "gx", "gw", "gb"):
        name = f"{what} {key}"
        assert got[key].dtype == dtype and got[key].shape == ref[key].shape, (name, got[key].shape, ref[key].shape)
        assert torch.isfinite(got[key].float()).all(), name
        if dtype == torch.float32:
            assert_close(got[key], ref[key], dtype, msg=name)
            continue
        scale = ref[key].abs().max().item()
        err = (got[key].double() - ref[key]).abs().max().item()
        assert err <= TOLERANCES[dtype][1] * scale, f"{name}: error {err:.3e} > {TOLERANCES[dtype][1]} x {scale:.3e}"
        assert_error_within(got[key], plain[key], ref[key], factor=2.0, floor=2.0 ** -8 * scale, name=name)


def _parity(r, t):
    group = dist.group.WORLD
    plans = {"plain": ChunkPlan(1), "auto": True, "off": False}
    if t > 1:
        plans["chunked"] = ChunkPlan(t)
        plans["chunked-bulk-ag-backward"] = ChunkPlan(t, bulk_ag_backward=True)
    if t > 2:
        plans["chunked-prefetch-all"] = ChunkPlan(t, prefetch=t - 1)   # the GPU default schedule
    cases = 0
    for si, (s_local, b, k, n) in enumerate(SHAPES):
        for dtype in DTYPES:
            T = _case_tensors(1000 + si, t, s_local, b, k, n, dtype)
            ag_ref, rs_ref = _reference(T, r, t, s_local, n, k)
            ag_plain = _run_ag(T, r, t, s_local, n, group, ChunkPlan(1))
            rs_plain = _run_rs(T, r, t, s_local, k, group, ChunkPlan(1))
            for pname, plan in plans.items():
                tag = f"t={t} rank={r} shape={(s_local, b, k, n)} {dtype} plan={pname}"
                _compare(_run_ag(T, r, t, s_local, n, group, plan), ag_plain, ag_ref, dtype, "all_gather_matmul " + tag)
                _compare(_run_rs(T, r, t, s_local, k, group, plan), rs_plain, rs_ref, dtype, "matmul_reduce_scatter " + tag)
                cases += 1
    # no bias, and only one of (input, weight) requiring grad: the ring skips the unneeded ring
    s_local, b, k, n = SHAPES[0]
    T = _case_tensors(7, t, s_local, b, k, n, torch.float32)
    ag_ref, rs_ref = _reference(T, r, t, s_local, n, k)
    for plan in ([ChunkPlan(1), ChunkPlan(t)] if t > 1 else [ChunkPlan(1)]):
        for need in ("x", "w"):
            x = T["ag_x"][r * s_local:(r + 1) * s_local].clone().requires_grad_(need == "x")
            w = T["ag_w"][r * n:(r + 1) * n].clone().requires_grad_(need == "w")
            all_gather_matmul(x, w, group=group, overlap=plan).backward(T["ag_gy"][..., r * n:(r + 1) * n])
            got, ref = (x.grad, ag_ref["gx"]) if need == "x" else (w.grad, ag_ref["gw"])
            assert_close(got, ref, torch.float32, msg=f"ag only-{need} {plan}")
            assert (w.grad if need == "x" else x.grad) is None
            x = T["rs_x"][..., r * k:(r + 1) * k].clone().requires_grad_(need == "x")
            w = T["rs_w"][:, r * k:(r + 1) * k].clone().requires_grad_(need == "w")
            matmul_reduce_scatter(x, w, group=group, overlap=plan).backward(T["rs_gy"][r * s_local:(r + 1) * s_local])
            got, ref = (x.grad, rs_ref["gx"]) if need == "x" else (w.grad, rs_ref["gw"])
            assert_close(got, ref, torch.float32, msg=f"rs only-{need} {plan}")
    # Under torch.autocast the ops compute in their operands' dtype on every plan: the plain plan's matmuls
    # were autocast to bf16 (a bf16 output, and a backward outside the block failed on the fp32 weight)
    # while the chunked plan's out= GEMMs stayed fp32.
    for plan in ([ChunkPlan(1), ChunkPlan(t)] if t > 1 else [ChunkPlan(1)]):
        runs = []
        for autocast in (False, True):
            x = T["rs_x"][..., r * k:(r + 1) * k].clone().requires_grad_()
            w = T["rs_w"][:, r * k:(r + 1) * k].clone().requires_grad_()
            xa = T["ag_x"][r * s_local:(r + 1) * s_local].clone().requires_grad_()
            wa = T["ag_w"][r * n:(r + 1) * n].clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = matmul_reduce_scatter(x, w, group=group, overlap=plan)
                ya = all_gather_matmul(xa, wa, group=group, overlap=plan)
            y.backward(T["rs_gy"][r * s_local:(r + 1) * s_local])
            ya.backward(T["ag_gy"][..., r * n:(r + 1) * n])
            runs.append((y, ya, x.grad, w.grad, xa.grad, wa.grad))
        assert all(got.dtype == torch.float32 for got in runs[1]), plan
        torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0, msg=f"autocast {plan}")
    return cases


def _order(r, t):
    """The ring loops issue the transfer of the next chunk before the current GEMM, wait after it."""
    group = dist.group.WORLD
    s_local, b, k, n = SHAPES[0]
    T = _case_tensors(3, t, s_local, b, k, n, torch.float32)
    with record_schedule() as ev:
        _run_ag(T, r, t, s_local, n, group, ChunkPlan(t))
        _run_rs(T, r, t, s_local, k, group, ChunkPlan(t))

    def at(*event):
        hits = [i for i, e in enumerate(ev) if e[:3] == event]
        assert len(hits) == 1, (event, ev)
        return hits[0]

    for i in range(t - 1):
        # gathers: shard i+1 travels while the GEMM of shard i runs
        assert at("exchange", "ag_fwd", i) < at("gemm", "ag_fwd", i) < at("wait", "ag_fwd", i), ev
        assert at("exchange", "ag_grad_bwd", i) < at("gemm", "ag_grad_bwd", i) < at("wait", "ag_grad_bwd", i), ev
        # reduce-scatter: partial i travels while the GEMM of partial i+1 runs
        assert at("gemm", "rs_fwd", i) < at("exchange", "rs_fwd", i) < at("gemm", "rs_fwd", i + 1) < at("wait", "rs_fwd", i), ev
        # all_gather_matmul backward: partial i travels while partial i+1 is computed, and the weight
        # gradient runs while the last partial is still in flight
        assert at("gemm", "ag_bwd_dgrad", i) < at("exchange", "ag_bwd_dgrad", i) \
            < at("gemm", "ag_bwd_dgrad", i + 1) < at("wait", "ag_bwd_dgrad", i), ev
        # ... and the re-gather of x is all issued before the first input-gradient chunk, waited only
        # after the last one
        assert at("exchange", "ag_bwd_x", i) < at("gemm", "ag_bwd_dgrad", 0), ev
        assert at("gemm", "ag_bwd_dgrad", t - 1) < at("wait", "ag_bwd_x", i) < at("gemm", "wgrad", 0), ev
    assert at("gemm", "wgrad", 0) < at("wait", "ag_bwd_dgrad", t - 2), ev
    kinds = Counter(e[0] for e in ev)
    assert kinds["exchange"] == 5 * (t - 1) and kinds["collective"] == 0, kinds
    assert kinds["wait"] == kinds["exchange"], kinds
    # bulk_ag_backward (the GPU plan): async re-gather || input-gradient GEMM, async reduce-scatter ||
    # weight gradient
    with record_schedule() as ev:
        _run_ag(T, r, t, s_local, n, group, ChunkPlan(t, bulk_ag_backward=True))
    assert at("collective", "ag_bwd", 0) < at("gemm", "dgrad", 0) < at("wait", "ag_bwd", 0), ev
    assert at("gemm", "dgrad", 0) < at("collective", "rs_bwd", 0) < at("gemm", "wgrad", 0) < at("wait", "rs_bwd", 0), ev
    bulk = Counter(e[0] for e in ev)
    assert bulk["exchange"] == t - 1 and bulk["collective"] == 2 and bulk["wait"] == t + 1, bulk
    # prefetch t-1 (the GPU default): every transfer of a gather is issued before its first GEMM
    with record_schedule() as ev:
        _run_ag(T, r, t, s_local, n, group, ChunkPlan(t, prefetch=t - 1))
    for i in range(t - 1):
        assert at("exchange", "ag_fwd", i) < at("gemm", "ag_fwd", 0) and at("wait", "ag_fwd", i) < at("gemm", "ag_fwd", i + 1), ev
    # tiny GEMMs with overlap=True keep the plain path: nothing is chunked
    with record_schedule() as ev:
        _run_ag(T, r, t, s_local, n, group, True)
        _run_rs(T, r, t, s_local, k, group, True)
    assert not [e for e in ev if e[0] == "exchange"], ev
    return kinds["exchange"]


# (namespace, attribute, kind): the public torch.distributed names and the aliases seqpar.parallel.state
# binds at import (it prefers the torch 2.13 names); each wrapper calls the original, so nothing is
# counted twice.
def _collective_targets():
    import seqpar.parallel.state as state
    names = [(dist, "all_gather_into_tensor", "all_gather"), (dist, "all_gather_single", "all_gather"),
             (dist, "reduce_scatter_tensor", "reduce_scatter"), (dist, "reduce_scatter_single", "reduce_scatter"),
             (dist, "all_reduce", "all_reduce"), (dist, "all_gather", "all_gather_list"),
             (dist, "batch_isend_irecv", "send"),
             (state, "_all_gather_single", "all_gather"), (state, "_reduce_scatter_single", "reduce_scatter")]
    return [(ns, attr, kind) for ns, attr, kind in names if hasattr(ns, attr)]


def _nbytes(t):
    return t.numel() * t.element_size()


@contextlib.contextmanager
def _count_collectives():
    """Patch the collective entry points (this process only) to log (kind, bytes of the input)."""
    log = []
    patched = []

    def wrap(kind, fn):
        def recorder(*args, **kwargs):
            if kind == "send":
                log.extend(("send", _nbytes(op.tensor)) for op in args[0] if op.op is dist.isend)
            elif kind in ("all_gather", "reduce_scatter"):
                log.append((kind, _nbytes(args[1])))                    # (output, input)
            elif kind == "all_gather_list":
                log.append((kind, _nbytes(args[1])))                    # (tensor_list, tensor)
            else:
                log.append((kind, _nbytes(args[0])))
            return fn(*args, **kwargs)
        return recorder

    for ns, attr, kind in _collective_targets():
        fn = getattr(ns, attr)
        patched.append((ns, attr, fn))
        setattr(ns, attr, wrap(kind, fn))
    try:
        yield log
    finally:
        for ns, attr, fn in reversed(patched):
            setattr(ns, attr, fn)


def _counts(r, t):
    """Number and size of collectives per forward / backward, plain vs ring."""
    group = dist.group.WORLD
    s_local, b, k, n = SHAPES[0]
    T = _case_tensors(5, t, s_local, b, k, n, torch.float32)
    e = 4  # fp32 bytes
    ag_shard, rs_shard = s_local * b * k * e, s_local * b * n * e
    plans = [ChunkPlan(1)] + ([ChunkPlan(t), ChunkPlan(t, bulk_ag_backward=True)] if t > 1 else [])
    for plan in plans:
        x = T["ag_x"][r * s_local:(r + 1) * s_local].clone().requires_grad_()
        w = T["ag_w"][r * n:(r + 1) * n].clone().requires_grad_()
        with _count_collectives() as fwd:
            y = all_gather_matmul(x, w, group=group, overlap=plan)
        with _count_collectives() as bwd:
            y.backward(T["ag_gy"][..., r * n:(r + 1) * n])
        if t == 1:
            assert fwd == [] and bwd == [], (fwd, bwd)
        elif plan.chunks == 1:   # one bulk all-gather forward; re-gather + reduce-scatter backward
            assert fwd == [("all_gather", ag_shard)], fwd
            assert Counter(bwd) == Counter({("all_gather", ag_shard): 1, ("reduce_scatter", ag_shard * t): 1}), bwd
        elif plan.bulk_ag_backward:   # t-1 shard-sized sends: a ring all-gather's bytes; backward as plain
            assert fwd == [("send", ag_shard)] * (t - 1), fwd
            assert Counter(bwd) == Counter({("all_gather", ag_shard): 1, ("reduce_scatter", ag_shard * t): 1}), bwd
        else:                    # backward: t-1 sends re-gather x, t-1 send the grad_x partials
            assert fwd == [("send", ag_shard)] * (t - 1), fwd
            assert bwd == [("send", ag_shard)] * (2 * (t - 1)), bwd
        x = T["rs_x"][..., r * k:(r + 1) * k].clone().requires_grad_()
        w = T["rs_w"][:, r * k:(r + 1) * k].clone().requires_grad_()
        with _count_collectives() as fwd:
            y = matmul_reduce_scatter(x, w, group=group, overlap=plan)
        with _count_collectives() as bwd:
            y.backward(T["rs_gy"][r * s_local:(r + 1) * s_local])
        if t == 1:
            assert fwd == [] and bwd == [], (fwd, bwd)
        elif plan.chunks == 1:
            assert fwd == [("reduce_scatter", rs_shard * t)], fwd
            assert bwd == [("all_gather", rs_shard)], bwd
        else:
            assert fwd == [("send", rs_shard)] * (t - 1), fwd
            assert bwd == [("send", rs_shard)] * (t - 1), bwd
    return True


def _saved_tensors(r, t):
    """The ring path saves exactly what the plain path saves: (x_shard, weight) / (x, weight)."""
    group = dist.group.WORLD
    s_local, b, k, n = SHAPES[2]
    for plan in [ChunkPlan(1)] + ([ChunkPlan(t)] if t > 1 else []):
        for op, x_shape, w_shape in ((all_gather_matmul, (s_local, b, k), (n, k)),
                                     (matmul_reduce_scatter, (s_local * t, b, k), (n, k))):
            x = torch.randn(*x_shape, requires_grad=True)
            w = torch.randn(*w_shape, requires_grad=True)
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda p: saved.append(p) or p, lambda p: p):
                op(x, w, group=group, overlap=plan)
            got = sorted(tuple(p.shape) for p in saved)
            assert got == sorted([x_shape, w_shape]), (op.__name__, plan, got)
            assert all(p.data_ptr() in (x.data_ptr(), w.data_ptr()) for p in saved), (op.__name__, plan)
    return True


def _layer_counts(r, t):
    """One TransformerLayer (SP, t ranks) forward + backward: 4 all-gathers + 4 reduce-scatters of
    activations (the paper's Section 4.2.2) plus the backward re-gathers of the 2 column-parallel inputs; overlapped
    (the CPU plan), each of those 10 becomes t-1 point-to-point sends. Both give the same results."""
    import seqpar
    import seqpar.parallel.overlap as overlap_mod

    group = dist.group.WORLD
    s_local, b, h = 5, 3, 24
    results, logs = {}, {}
    for overlap in (False, True):
        seqpar.manual_seed(1234)
        cfg = seqpar.TransformerConfig(hidden_size=h, num_attention_heads=4, ffn_hidden_size=40,
                                       sequence_parallel=True, overlap_comm=overlap)
        saved = overlap_mod.MIN_CHUNK_FLOPS, overlap_mod.MIN_CHUNK_ROWS
        overlap_mod.MIN_CHUNK_FLOPS, overlap_mod.MIN_CHUNK_ROWS = {"cpu": 0.0, "cuda": 0.0}, 1  # tiny GEMMs chunk
        try:
            layer = seqpar.TransformerLayer(cfg, tp_group=group)
            g = torch.Generator().manual_seed(99)
            x_full, gy_full = torch.randn(s_local * t, b, h, generator=g), torch.randn(s_local * t, b, h, generator=g)
            x = x_full[r * s_local:(r + 1) * s_local].clone().requires_grad_()
            with _count_collectives() as log:
                y = layer(x)
                y.backward(gy_full[r * s_local:(r + 1) * s_local])
        finally:
            overlap_mod.MIN_CHUNK_FLOPS, overlap_mod.MIN_CHUNK_ROWS = saved
        results[overlap] = [y.detach(), x.grad] + [p.grad for p in layer.parameters()]
        logs[overlap] = log
    shard = s_local * b * h * 4
    plain = Counter(kind for kind, _ in logs[False])
    assert plain["all_gather"] == 4 + 2 and plain["reduce_scatter"] == 4 and plain["send"] == 0, logs[False]
    assert all(size == shard for kind, size in logs[False] if kind == "all_gather"), logs[False]
    assert all(size == shard * t for kind, size in logs[False] if kind == "reduce_scatter"), logs[False]
    assert all(size <= 4 * h * 4 for kind, size in logs[False] if kind == "all_reduce"), logs[False]   # params only
    ring = Counter(kind for kind, _ in logs[True])
    # chunked: every gather and reduce-scatter of activations or their gradients is t-1 shard sends
    assert ring["all_gather"] == ring["reduce_scatter"] == 0 and ring["send"] == 10 * (t - 1), logs[True]
    assert all(size == shard for kind, size in logs[True] if kind == "send"), logs[True]
    assert ring["all_reduce"] == plain["all_reduce"], (logs[False], logs[True])
    for a, c in zip(results[False], results[True]):
        assert_close(c, a, torch.float32, msg="layer overlap_comm=True vs False")
    return dict(plain)


def _subgroups(r, t):
    """Groups that are not the world (ranks {0, 2} and {1, 3}): peers are mapped to global ranks."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group, gr = groups[r % 2], r // 2
    s_local, b, k, n = SHAPES[1]
    T = _case_tensors(11 + r % 2, 2, s_local, b, k, n, torch.float32)   # each subgroup its own problem
    ag_ref, rs_ref = _reference(T, gr, 2, s_local, n, k)
    for plan in (ChunkPlan(1), ChunkPlan(2)):
        _compare(_run_ag(T, gr, 2, s_local, n, group, plan), None, ag_ref, torch.float32, f"subgroup ag {plan}")
        _compare(_run_rs(T, gr, 2, s_local, k, group, plan), None, rs_ref, torch.float32, f"subgroup rs {plan}")
    return True


def _in_place_outputs(r, t):
    """y.add_(1) on each op's output, plain and ring plans, with and without a bias, equals y + 1 (and
    backward runs through it)."""
    s_local, b, k, n = SHAPES[0]
    group = dist.group.WORLD if t > 1 else None
    g = torch.Generator().manual_seed(5)
    for plan in {ChunkPlan(1), ChunkPlan(t)}:
        for with_bias in (False, True):
            x = torch.randn(s_local, b, k, generator=g, requires_grad=True)
            w = torch.randn(n, k, generator=g, requires_grad=True)
            bias = torch.randn(n, generator=g) if with_bias else None
            x_full = torch.randn(s_local * t, b, k, generator=g, requires_grad=True)
            w_rs = torch.randn(n, k, generator=g, requires_grad=True)
            for op, args in ((all_gather_matmul, (x, w, bias)), (matmul_reduce_scatter, (x_full, w_rs, bias))):
                y = op(*args, group=group, overlap=plan)
                expected = y.detach() + 1
                y.add_(1.0)
                y.sum().backward()
                assert torch.equal(y.detach(), expected), (op.__name__, plan, with_bias)
    return True


def _raised(fn):
    """``fn()``'s ValueError text (None: no error)."""
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _agreement_message(r):
    return _raised(lambda: check_ranks_agree(dist.group.WORLD, {"heads": 4.0 if r == 0 else 4}, what="demo"))


def _on_both_sides_of_the_chunk_threshold(flops: float, fn):
    """``fn()``'s ValueError text with overlap=True chunking CPU GEMMs from ``flops`` FLOPs (any rows)."""
    import seqpar.parallel.overlap as overlap_mod

    saved = overlap_mod.MIN_CHUNK_FLOPS, overlap_mod.MIN_CHUNK_ROWS
    overlap_mod.MIN_CHUNK_FLOPS, overlap_mod.MIN_CHUNK_ROWS = {**saved[0], "cpu": flops}, 1
    try:
        return _raised(fn)
    finally:
        overlap_mod.MIN_CHUNK_FLOPS, overlap_mod.MIN_CHUNK_ROWS = saved


def _input_agreement(r, t):
    """Messages of the rejected calls and agreement counts (see the module doc), on every rank."""
    import seqpar
    import seqpar.parallel.state as state
    from seqpar.nn import ColumnParallelLinear, ParallelMLP, RowParallelLinear

    group = dist.group.WORLD
    g = torch.Generator().manual_seed(3)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    out = {
        "uneven_ag": _raised(lambda: all_gather_matmul(rnd(3 - r, 2, 8), rnd(5, 8), group=group, overlap=False)),
        "uneven_ag_ring": _raised(lambda: all_gather_matmul(rnd(3 - r, 2, 8), rnd(5, 8), group=group,
                                                            overlap=ChunkPlan(t))),
        "dtype_ag": _raised(lambda: all_gather_matmul(rnd(3, 2, 8).to(torch.bfloat16 if r else torch.float32),
                                                      rnd(5, 8).to(torch.bfloat16 if r else torch.float32),
                                                      group=group)),
        "n_rs": _raised(lambda: matmul_reduce_scatter(rnd(4, 2, 8), rnd(5 + r, 8), group=group)),
        "rejected_ag": _raised(lambda: all_gather_matmul(rnd(3, 2, 8), rnd(5, 8 + r), group=group)),
        "uneven_column": _raised(lambda: ColumnParallelLinear(8, 10, tp_group=group, sequence_parallel=True)(
            rnd(3 - r, 2, 8))),
        "batch_row": _raised(lambda: RowParallelLinear(8, 6, tp_group=group)(rnd(4, 2 + r, 4))),
        # the overlap plans: another overlap, or overlap=True sizing each rank's plan by its own GEMM
        "overlap_ag": _raised(lambda: all_gather_matmul(rnd(3, 2, 8), rnd(5, 8), group=group,
                                                        overlap=ChunkPlan(t) if r == 0 else False)),
        "n_local_plan": _on_both_sides_of_the_chunk_threshold(
            500.0, lambda: all_gather_matmul(rnd(3, 2, 8), rnd(5 + r, 8), group=group)),        # 480 / 576 FLOPs
        "k_local_plan": _on_both_sides_of_the_chunk_threshold(
            340.0, lambda: matmul_reduce_scatter(rnd(4, 2, 8 + r), rnd(5, 8 + r), group=group)),  # 320 / 360
        # x needing a gradient on one rank only: its backward would reduce-scatter grad_x there only (a hang)
        "grad_ag": _raised(lambda: all_gather_matmul(rnd(3, 2, 8).requires_grad_(r == 0), rnd(5, 8), group=group,
                                                     overlap=ChunkPlan(t))),
        "grad_row": _raised(lambda: RowParallelLinear(8, 6, tp_group=group, sequence_parallel=True)(
            rnd(4, 2, 4).requires_grad_(r == 1))),
        # a device one rank's linear rejects (the op rejected it after the agreement, on that rank only)
        "meta_x": _raised(lambda: ColumnParallelLinear(8, 10, tp_group=group, sequence_parallel=True)(
            rnd(3, 2, 8).to("meta" if r else "cpu"))),
    }
    # uneven weight shards are fine where the ranks' plans agree (overlap=True: both plain at these sizes)
    out["uneven_n_plain"] = tuple(all_gather_matmul(rnd(3, 2, 8), rnd(5 + r, 8), group=group).shape)
    # a TransformerLayer under autocast on one rank only: its check covers its linears' dtypes too
    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=8, num_attention_heads=2, ffn_hidden_size=16, sequence_parallel=True)
    layer = seqpar.TransformerLayer(cfg, tp_group=group)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=r == 1):
        out["layer_autocast_one_rank"] = _raised(lambda: layer(rnd(3, 2, 8)))
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False):   # a dispatch mode that runs real tensors: the agreement still runs
        out["uneven_under_flop_counter"] = _raised(
            lambda: ColumnParallelLinear(8, 10, tp_group=group, sequence_parallel=True)(rnd(3 - r, 2, 8)))
    # GPTModel's output GEMM: real vocabulary rows 3200 and 3000 (vocab 6200 padded to 6400); overlap=True
    # sized each rank's plan by its own rows, which fell on both sides of the CPU threshold: a hang
    seqpar.manual_seed(0)
    model_cfg = seqpar.TransformerConfig(hidden_size=256, num_attention_heads=2, ffn_hidden_size=256,
                                         sequence_parallel=True)
    model = seqpar.GPTModel(model_cfg, 1, 6200, 128, tp_group=group)
    with torch.no_grad():
        # the same tokens on both ranks (g has drawn rank-dependent amounts by now)
        tokens = torch.randint(0, 6200, (1, 128), generator=torch.Generator().manual_seed(4))
        out["vocab_logits"] = tuple(model(tokens).shape)
    calls = []
    real = state._all_gather_control
    state._all_gather_control = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        def agreements(fn):
            del calls[:]
            fn()
            return len(calls)

        x_shard, w = rnd(3, 2, 8), rnd(5, 8)
        column = ColumnParallelLinear(8, 10, tp_group=group, sequence_parallel=True)
        seqpar.manual_seed(0)
        cfg = seqpar.TransformerConfig(hidden_size=8, num_attention_heads=2, ffn_hidden_size=16,
                                       sequence_parallel=True)
        mlp = ParallelMLP(cfg, group)
        seqpar.manual_seed(0)
        layer = seqpar.TransformerLayer(cfg, tp_group=group)

        def unchecked_layer():
            layer.check_rank_inputs = False
            layer(x_shard)
            layer.check_rank_inputs = True

        def unchecked_column():
            column.check_rank_inputs = False
            column(x_shard)
            column.check_rank_inputs = True

        def op_in_checked_context():
            with state.agreement_checked():
                all_gather_matmul(x_shard, w, group=group)

        out["counts"] = {
            "op": agreements(lambda: all_gather_matmul(x_shard, w, group=group)),
            "op_rs": agreements(lambda: matmul_reduce_scatter(rnd(4, 2, 8), w, group=group)),
            "op_in_agreement_checked": agreements(op_in_checked_context),
            "column": agreements(lambda: column(x_shard)),
            "column_unchecked": agreements(unchecked_column),
            "mlp_block": agreements(lambda: mlp(x_shard)),
            "layer": agreements(lambda: layer(x_shard)),
            "layer_unchecked": agreements(unchecked_layer),
        }
    finally:
        state._all_gather_control = real
    return out


def _control_devices(r, t):
    """The device of every agreement's control tensor, and the current device at every object gather (torch
    stages those pickles on the current device), on a simulated NCCL-only group bound to cuda:r
    (``init_process_group(device_id=...)``) in a process that never called ``torch.cuda.set_device`` (the
    current device stays cuda:0); then without a bound device, for a layer built under a default device of
    cuda:r and a from_llama onto cuda:r. The choices are recorded, the exchanges themselves kept on gloo's
    CPU (``torch.cuda.device`` only records the device it makes current)."""
    import sys

    import seqpar
    import seqpar.nn.grad as grad
    import seqpar.parallel.state as state
    from seqpar.integrations import hf
    from seqpar.nn import ColumnParallelLinear

    group = dist.new_group(list(range(t)))
    group.bound_device_id = torch.device("cuda", r)
    real = (dist.get_backend, state._control_device, torch.cuda.current_device, torch.cuda.device,
            dist.all_gather_object, torch.get_default_device)
    chosen, current = [], ["cuda:0"]

    def spy(group, preferred=None):
        device = real[1](group, preferred)
        chosen.append(str(device))
        # an object gather enters it (torch.cuda.device, recorded below); the others' tensors stay on the CPU
        return device if sys._getframe(1).f_code.co_name == "all_gather_objects" else torch.device("cpu")

    class made_current:   # torch.cuda.device, without a GPU
        def __init__(self, device):
            self.device = str(device)

        def __enter__(self):
            current.append(self.device)

        def __exit__(self, *exc):
            current.pop()

    def gather_objects(*args, **kwargs):
        chosen.append(f"object gather on {current[-1]}")
        return real[4](*args, **kwargs)

    def devices(fn):
        chosen.clear()
        fn()
        return list(chosen)

    dist.get_backend, state._control_device, torch.cuda.current_device = (lambda group=None: "nccl"), spy, (lambda: 0)
    torch.cuda.device, dist.all_gather_object = made_current, gather_objects
    try:
        cfg = seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2, sequence_parallel=True)
        x_shard, w = torch.randn(4, 1, 16), torch.randn(8, 16)
        out = {"layer build": devices(lambda: seqpar.TransformerLayer(cfg, tp_group=group)),
               "all_gather_matmul": devices(lambda: all_gather_matmul(x_shard, w, group=group, overlap=False)),
               "linear": devices(lambda: ColumnParallelLinear(16, 16, tp_group=group, sequence_parallel=True)(x_shard)),
               "clip_grad_norm_": [str(_clip_reduction_device(grad, group))]}
        group.bound_device_id = None
        torch.get_default_device = lambda: torch.device("cuda", r)   # what `with torch.device(f"cuda:{r}")` sets
        out["layer build under a default device"] = devices(lambda: seqpar.TransformerLayer(cfg, tp_group=group))[:1]
        torch.get_default_device = real[5]
        out["from_llama onto a device"] = devices(lambda: hf._read_on_every_rank(
            lambda: None, group, "from_llama", torch.device("cuda", r)))
        return out
    finally:
        (dist.get_backend, state._control_device, torch.cuda.current_device, torch.cuda.device,
         dist.all_gather_object, torch.get_default_device) = real


def _clip_reduction_device(grad, group):
    """clip_grad_norm_'s reduction device for ``group`` (it asks whether CUDA exists first)."""
    real_available = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        return grad._group_device(group)
    finally:
        torch.cuda.is_available = real_available


def _all_checks(rank, world_size):
    torch.manual_seed(0)
    out = {"cases": _parity(rank, world_size), "counts": _counts(rank, world_size),
           "saved": _saved_tensors(rank, world_size), "in_place": _in_place_outputs(rank, world_size)}
    if world_size > 1:
        out["order"] = _order(rank, world_size)
        out["agreement"] = _agreement_message(rank)
    if world_size == 2:
        out["layer"] = _layer_counts(rank, world_size)
        out["input_agreement"] = _input_agreement(rank, world_size)
        out["control_devices"] = _control_devices(rank, world_size)
    if world_size == 4:
        out["subgroups"] = _subgroups(rank, world_size)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4], ids=lambda w: f"t{w}")
def test_comm_matmul_multirank(world_size):
    results = run_ranks(_all_checks, world_size, timeout_s=240)
    plans = 3 + 2 * (world_size > 1) + (world_size > 2)
    assert all(res["cases"] == len(SHAPES) * len(DTYPES) * plans for res in results), results
    assert all(res["counts"] and res["saved"] and res["in_place"] for res in results)
    for rank, res in enumerate(results[:2] if world_size > 1 else []):
        held = "rank 0 has 4.0" if rank == 0 else "rank 1 has 4"
        assert "heads differs (ranks [0] vs ranks [1" in res["agreement"] and held in res["agreement"], res
    if world_size == 2:
        assert all(res["layer"]["all_gather"] == 6 for res in results), results
        _check_input_agreement([res["input_agreement"] for res in results])
        for rank, res in enumerate(results):   # this rank's GPU, not cuda:0 on every rank (NCCL refused it)
            devices = res["control_devices"]
            assert f"object gather on cuda:{rank}" in devices["layer build"], (rank, devices)
            assert all(chosen and set(chosen) - {f"object gather on cuda:{rank}"} == {f"cuda:{rank}"}
                       for chosen in devices.values()), (rank, devices)
    if world_size == 4:
        assert all(res["subgroups"] for res in results)


@pytest.mark.parametrize("backend, bound, preferred, expected", [
    ("gloo", None, None, "cpu"),
    ("cpu:gloo,cuda:nccl", 1, 3, "cpu"),          # a CPU backend: no device work for the check
    ("cuda:nccl", None, None, "cuda:2"),          # NCCL only, spelled with its device (was the CPU)
    ("nccl", 1, None, "cuda:1"),                  # the group's bound device (was the current one)
    ("nccl", 1, 3, "cuda:3"),                     # the checked tensors' device first
    ("nccl", None, "cuda", "cuda:2"),             # a device without an index says nothing
    ("nccl", 1, "cpu", "cuda:1"),                 # nor does a CPU tensor's, on an NCCL-only group
], ids=lambda v: str(v))
def test_the_agreement_exchange_runs_where_the_group_takes_tensors(monkeypatch, backend, bound, preferred, expected):
    from types import SimpleNamespace

    import seqpar.parallel.state as state

    monkeypatch.setattr(state.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    group = SimpleNamespace(bound_device_id=None if bound is None else torch.device("cuda", bound))
    preferred = None if preferred is None else torch.device(preferred if isinstance(preferred, str) else
                                                            f"cuda:{preferred}")
    assert str(state._control_device(group, preferred)) == expected


def _check_input_agreement(per_rank):
    """Every rank raised for every bad call, naming what differed (or who rejected what)."""
    for rank, res in enumerate(per_rank):
        for key in ("uneven_ag", "uneven_ag_ring"):
            assert res[key] and "all_gather_matmul: the tensor-parallel ranks disagree: x_shard shape differs" \
                in res[key] and f"rank {rank} has ({3 - rank}, 2, 8)" in res[key], (rank, key, res[key])
        assert res["dtype_ag"] and "x_shard dtype differs" in res["dtype_ag"], (rank, res["dtype_ag"])
        assert res["n_rs"] and "matmul_reduce_scatter" in res["n_rs"] and \
            "weight.shape[0] (n) differs (rank 0: 5, rank 1: 6)" in res["n_rs"], (rank, res["n_rs"])
        rejected = res["rejected_ag"]
        assert rejected and (("weight must be a [n, 8] tensor" in rejected) if rank == 1 else
                             ("rank(s) [1] rejected their arguments" in rejected)), (rank, rejected)
        assert res["uneven_column"] and "ColumnParallelLinear input" in res["uneven_column"] and \
            "x.shape[:-1] differs" in res["uneven_column"], (rank, res["uneven_column"])
        assert res["batch_row"] and "RowParallelLinear input" in res["batch_row"], (rank, res["batch_row"])
        for key in ("overlap_ag", "n_local_plan", "k_local_plan"):
            assert res[key] and "overlap plan differs" in res[key] and "pass overlap=False or one ChunkPlan" \
                in res[key], (rank, key, res[key])
        assert "rank 0 has ChunkPlan(chunks=2" in res["overlap_ag"] if rank == 0 else \
            "rank 1 has ChunkPlan(chunks=1" in res["overlap_ag"], (rank, res["overlap_ag"])
        for key, name in (("grad_ag", "x_shard"), ("grad_row", "x")):
            assert res[key] and f"{name}.requires_grad (grad mode on) differs" in res[key], (rank, key, res[key])
        assert res["layer_autocast_one_rank"] and "x dtype (under autocast its dtype) differs" in \
            res["layer_autocast_one_rank"], (rank, res["layer_autocast_one_rank"])
        assert res["meta_x"] and (("x is on meta but the weight on cpu" in res["meta_x"]) if rank == 1 else
                                  ("rank(s) [1] rejected their arguments" in res["meta_x"])), (rank, res["meta_x"])
        assert res["uneven_n_plain"] == (6, 2, 5 + rank), (rank, res["uneven_n_plain"])
        assert res["uneven_under_flop_counter"] and "x.shape[:-1] differs" in res["uneven_under_flop_counter"], \
            (rank, res["uneven_under_flop_counter"])
        assert res["vocab_logits"] == (128, 1, 3200 if rank == 0 else 3000), (rank, res["vocab_logits"])
        assert res["counts"] == {"op": 1, "op_rs": 1, "op_in_agreement_checked": 0, "column": 1,
                                 "column_unchecked": 0, "mlp_block": 1, "layer": 1, "layer_unchecked": 0}, \
            (rank, res["counts"])


def _interrupted_chunk_loops(rank, world_size):
    """Raise inside each chunked loop after a transfer was issued and before it was waited (as an OOM in
    a GEMM or a KeyboardInterrupt would), on every rank; then the same call again, uninterrupted."""
    import seqpar.ops.comm_matmul as comm

    torch.manual_seed(0)
    x_shard, x_full = torch.randn(4, 2, 16), torch.randn(8, 2, 16)
    w_col, w_row = torch.randn(12, 16, requires_grad=True), torch.randn(12, 16)
    plan, real_note, caught = ChunkPlan(world_size, prefetch=1), comm.note, []
    calls = {"ag_fwd": lambda: all_gather_matmul(x_shard, w_col, group=dist.group.WORLD, overlap=plan),
             "rs_fwd": lambda: matmul_reduce_scatter(x_full, w_row, group=dist.group.WORLD, overlap=plan),
             "ag_bwd_dgrad": lambda: all_gather_matmul(x_shard.requires_grad_(), w_col, group=dist.group.WORLD,
                                                       overlap=plan).sum().backward()}
    for where, call in calls.items():
        def failing(*event, where=where):
            if event[:3] == ("gemm", where, 0):
                raise RuntimeError(f"interrupted at {where}")
            real_note(*event)

        comm.note = failing
        try:
            call()
        except RuntimeError as error:
            caught.append(str(error))
        finally:
            comm.note = real_note
        call()   # the next collectives on the group: they hung on every rank
    return caught, torch.equal(all_gather_matmul(x_shard, w_col, group=dist.group.WORLD, overlap=plan),
                               all_gather_matmul(x_shard, w_col, group=dist.group.WORLD, overlap=False))


@pytest.mark.timeout(120)
def test_an_exception_inside_a_chunk_loop_leaves_no_transfer_in_flight():
    """A transfer issued and never waited (the loop left by an exception) made gloo's next collective on
    the group hang on every rank; the chunked passes wait for theirs before the exception goes on."""
    for caught, equal in run_ranks(_interrupted_chunk_loops, 2, timeout_s=90):
        assert caught == ["interrupted at ag_fwd", "interrupted at rs_fwd", "interrupted at ag_bwd_dgrad"]
        assert equal


def _tensor_parallel_linears_ops(rank, world_size):
    """The aten / c10d ops of a ColumnParallelLinear -> RowParallelLinear pair at t = 2 without SP, forward
    and backward, and their outputs and gradients against the unsharded fp64 computation."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from seqpar.nn import ColumnParallelLinear, RowParallelLinear

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func.overloadpacket).split(".")[-1] if "c10d" not in str(func) else "allreduce")
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    col = ColumnParallelLinear(16, 32, tp_group=dist.group.WORLD)
    row = RowParallelLinear(32, 16, tp_group=dist.group.WORLD)
    w1, b1 = col.full()
    w2, b2 = row.full()
    x_leaf = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    # Not the leaf itself: its AccumulateGrad copies (copy_) a gradient it can't steal, and gloo's worker
    # thread may still hold the input gradient's all-reduce (its Work) when it runs, by timing (seen once,
    # in a loaded CI run). The layer's input is another layer's output in a model anyway.
    x = x_leaf * 1.0
    forward, backward = Ops(), Ops()
    with forward:
        y = row(col(x))
    with backward:
        y.square().sum().backward()
    full = [t.detach().double().requires_grad_() for t in (x, w1, b1, w2, b2)]
    expected = torch.nn.functional.linear(torch.nn.functional.linear(full[0], full[1], full[2]), full[3], full[4])
    expected.square().sum().backward()
    cols = slice(rank * 16, (rank + 1) * 16)
    got = [y, x_leaf.grad, col.weight.grad, col.bias.grad, row.weight.grad, row.bias.grad]
    want = [expected, full[0].grad, full[1].grad[cols], full[2].grad[cols], full[3].grad[:, cols], full[4].grad]
    errors = [float((g.double() - w).abs().max()) for g, w in zip(got, want)]
    return forward.names, backward.names, errors


@pytest.mark.timeout(120)
def test_tensor_parallel_linears_reduce_in_place_and_overlap_the_input_gradient_s_all_reduce():
    """Without SP, f-bar cloned the row-parallel GEMM's fresh output before its all-reduce, and f's
    backward copied (cat) the column-parallel input gradient and all-reduced it only after the weight
    gradient's GEMM: a read and write of [s, b, h] each, twice per layer. Now the GEMM's own output is
    reduced in place, and the input gradient's all-reduce is issued before the weight gradient's GEMM,
    which runs beside it (Megatron's asynchronous tensor-parallel all-reduce)."""
    for forward, backward, errors in run_ranks(_tensor_parallel_linears_ops, 2, timeout_s=90):
        assert max(errors) < 1e-5, errors
        for names in (forward, backward):
            assert not {"clone", "cat", "copy_"} & set(names), names
            assert names.count("allreduce") == 1, names
        # backward: the row linear's two GEMMs, then the column linear's input gradient, its all-reduce,
        # and its weight gradient after it
        mms = [i for i, name in enumerate(backward) if name in ("mm", "matmul", "bmm")]
        assert len(mms) == 4 and mms[2] < backward.index("allreduce") < mms[3], backward


def _output_layer_under_autocast(rank, world_size):
    """dtypes of a standalone VocabParallelOutputLayer's logits and weight gradient under bf16 autocast, fp32
    and bf16 hidden, with and without SP (t = world_size), and its logits against nn.Linear's under autocast."""
    from seqpar.nn.model import VocabParallelOutputLayer

    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        layer = VocabParallelOutputLayer(256, 16, tp_group=dist.group.WORLD, sequence_parallel=sp)
        torch.nn.init.normal_(layer.weight)
        full = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(1))
        hidden = full.chunk(world_size)[rank] if sp else full
        for dtype in (torch.float32, torch.bfloat16):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = layer(hidden.to(dtype))
            logits.float().sum().backward()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                want = torch.nn.functional.linear(full.to(dtype), layer.weight)
            out[sp, str(dtype)] = (logits.dtype, layer.weight.grad.dtype, torch.equal(logits, want))
            layer.weight.grad = None
    return out


@pytest.mark.timeout(120)
def test_a_standalone_output_layer_runs_in_the_autocast_dtype_under_tensor_parallelism():
    """VocabParallelOutputLayer called directly under autocast at t = 2 without SP returned fp32 logits of
    an fp32 hidden and raised on a bf16 one ("expected m1 and m2 to have the same dtype"): its GEMM is a
    Function computing in its operands' dtype, which autocast does not cast. Now it runs as if converted
    to the autocast dtype, like the parallel linears, with and without SP: bf16 logits, the nn.Linear
    values under autocast, fp32 weight gradients."""
    for result in run_ranks(_output_layer_under_autocast, 2, timeout_s=90):
        for key, got in result.items():
            assert got == (torch.bfloat16, torch.float32, True), (key, got)
