#!/usr/bin/env python3
"""Benchmark: the attention core (issue 4), fwd / bwd / fwd+bwd TFLOP/s.

FLOPs: forward 4 * b * H * s^2 * d (q k^T and P v), backward 2.5x forward (five GEMM-sized products:
dV, dP, dQ, dK and the flash-style recompute of q k^T, FlashAttention's benchmark convention; a backward
without the recompute does 2.0x, as FlopCounterMode counts it), fwd+bwd 3.5x; causal counts half. Shapes fill the GPU as the usual flash
benchmarks do: b * s = ``--tokens`` (16384) and H * d = ``--hidden`` (2048). bf16 by default.
``--gqa-group G`` gives k and v H / G heads (grouped-query attention, SDPA's ``enable_gqa``); FLOPs are
counted per q head as above.

Providers:
    seqpar-triton         attention_core(backend="triton")  (flash-style, recompute-free)
    seqpar-cuda           attention_core(backend="cuda")    (torch GEMMs + fused softmax-dropout kernels)
    torch-eager           plain torch ops in the input dtype: matmul, masked_fill, softmax, dropout, matmul
    torch-sdpa-flash      F.scaled_dot_product_attention restricted to SDPBackend.FLASH_ATTENTION
    torch-sdpa-efficient  ... restricted to SDPBackend.EFFICIENT_ATTENTION
    flash-attn            flash_attn_func, when the flash_attn package is importable
A provider that can't run a configuration is reported and skipped.

Timing: triton.testing.do_bench medians (after its warm-up) on random inputs; backward is timed on a
retained graph with grads reset between runs. Rows (device, date, commit, config, provider, metric,
value) are appended to ``<out>/bench_attention.csv`` (metric: fwd_ms, bwd_ms, fwdbwd_ms, fwd_tflops,
bwd_tflops, fwdbwd_tflops, and on a GPU fwdbwd_peak_bytes: the peak one fwd+bwd allocates beyond its
inputs and gradients; issue target: no s^2 term). The summary compares seqpar-triton's fwd+bwd with the
best SDPA backend; bench/gpu_summary.py turns the rows into the issue's targets (>= 0.9x SDPA's flash
backend at the same dropout, causal, bf16; peak memory flat in s at a fixed b * s).

Usage:
    python bench/bench_attention.py                         # GPU: the full sweep (causal), rows to bench/results/
    python bench/bench_attention.py --causal both --seqlens 2048,4096 --head-dims 128
    python bench/bench_attention.py --providers seqpar-triton,torch-sdpa-flash
    python bench/bench_attention.py --out DIR               # rows to DIR/bench_attention.csv (gpu_suite.sh)
    python bench/bench_attention.py --gqa-group 4           # Llama-style GQA: 4 q heads per kv head
    python bench/bench_attention.py --quick                 # CPU smoke test (Triton interpreter, tiny shapes)
    python bench/bench_attention.py --compile-only --head-dims 64 --dropouts 0.1 &   # warm Triton's cache
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

if __name__ == "__main__" and "--quick" in sys.argv[1:] and not torch.cuda.is_available():
    # The Triton interpreter must be chosen before anything imports triton (importing seqpar does): set in
    # main() it is too late for the @triton.jit helpers the kernels call.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from seqpar.bench.options import PROBABILITY_RANGE, comma_list, fill_defaults, probability  # noqa: E402
from seqpar.bench.results import ResultRows  # noqa: E402

PROVIDERS = ["seqpar-triton", "seqpar-cuda", "torch-eager", "torch-sdpa-flash", "torch-sdpa-efficient",
             "flash-attn"]
SDPA = ("torch-sdpa-flash", "torch-sdpa-efficient")
SEED = 1


# ----------------------------------------------------------------------------- providers
def _eager(q, k, v, causal: bool, p: float):
    group = q.shape[1] // k.shape[1]
    if group > 1:      # plain torch has no GQA: repeat k, v to q's heads (as HF's repeat_kv)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        s_q, s_k = q.shape[2], k.shape[2]
        scores = scores.masked_fill(torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
    probs = torch.nn.functional.dropout(torch.softmax(scores, dim=-1), p=p, training=p > 0)
    return torch.matmul(probs, v)


def make_provider(name: str, causal: bool, p: float, device: torch.device) -> Callable:
    """fn(q, k, v) -> o for [b, H, s, d] inputs; raises RuntimeError when unavailable."""
    import seqpar
    from seqpar.ops import registry

    if name.startswith("seqpar-"):
        backend = name.split("-", 1)[1]
        reason = registry.unavailable_reason("attention_core", backend, device)
        if reason:
            raise RuntimeError(reason)
        return lambda q, k, v: seqpar.ops.attention_core(q, k, v, is_causal=causal, dropout_p=p, seed=SEED,
                                                         enable_gqa=True, backend=backend)
    if name == "torch-eager":
        return lambda q, k, v: _eager(q, k, v, causal, p)
    if name in SDPA:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if device.type != "cuda":
            raise RuntimeError("SDPA flash/efficient kernels need CUDA")
        which = SDPBackend.FLASH_ATTENTION if name == "torch-sdpa-flash" else SDPBackend.EFFICIENT_ATTENTION

        def sdpa(q, k, v):
            with sdpa_kernel(which):   # the backward uses the kernel chosen in forward
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal,
                                                                        enable_gqa=q.shape[1] != k.shape[1])

        return sdpa
    if name == "flash-attn":
        try:
            from flash_attn import flash_attn_func
        except Exception as exc:  # noqa: BLE001
            raise RuntimeError(f"flash_attn is not importable ({type(exc).__name__})") from None
        # flash_attn wants [b, s, H, d]: a transposed view of the [b, H, s, d] tensor, so the benchmark
        # hands it tensors created in that layout (see _inputs) and this view is free.
        return lambda q, k, v: flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               dropout_p=p, causal=causal).transpose(1, 2)
    raise ValueError(f"unknown provider {name!r}; expected one of {PROVIDERS}")


def _inputs(provider: str, b: int, heads: int, kv_heads: int, s: int, d: int, dtype, device):
    def one(h):
        if provider == "flash-attn":     # contiguous [b, s, H, d], viewed as [b, H, s, d]
            t = torch.randn(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)
        else:
            t = torch.randn(b, h, s, d, dtype=dtype, device=device)
        return t.requires_grad_()

    q, k, v = one(heads), one(kv_heads), one(kv_heads)
    return q, k, v, torch.randn(b, heads, s, d, dtype=dtype, device=device)


# ----------------------------------------------------------------------------- timing
def _bench_ms(fn: Callable, device: torch.device, quick: bool, grad_to_none=None) -> float:
    if device.type == "cuda" and not quick:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none,
                                       return_mode="median")
    times = []
    for i in range(3 if quick else 10):
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:       # first run is the warm-up
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def tuned_configs() -> str:
    """The tiles the Triton autotuner picked in the latest forward, dq and dk/dv launches (the log says
    which configuration a slow row ran: the second GPU run's d = 128, s = 1024, p = 0.1 forward took
    1.35x the first run's with an unchanged kernel)."""
    from seqpar.triton_kernels import attention as A

    def one(kernel) -> str:
        c = getattr(kernel, "best_config", None)
        if c is None:
            return "-"
        return f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}"
    return ", ".join(f"{which} {one(k)}" for which, k in (("fwd", A._fwd_tuned), ("dq", A._dq_tuned),
                                                           ("dkdv", A._dkdv_tuned)))


def bench_config(provider: str, b: int, heads: int, s: int, d: int, causal: bool, p: float, dtype,
                 device, quick: bool, group: int = 1, compile_only: bool = False) -> Dict[str, float]:
    """fwd / bwd / fwd+bwd times and TFLOP/s (and on a GPU the fwd+bwd peak); ``compile_only``: one
    untimed fwd+bwd (Triton compiles and autotunes) and nothing measured."""
    fn = make_provider(provider, causal, p, device)
    q, k, v, grad_o = _inputs(provider, b, heads, heads // group, s, d, dtype, device)
    if compile_only:
        fn(q, k, v).backward(grad_o)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return {}
    out = {}
    out["fwd_ms"] = _bench_ms(lambda: fn(q, k, v), device, quick)
    o = fn(q, k, v)
    out["bwd_ms"] = _bench_ms(lambda: o.backward(grad_o, retain_graph=True), device, quick, [q, k, v])
    del o
    out["fwdbwd_ms"] = _bench_ms(lambda: fn(q, k, v).backward(grad_o), device, quick, [q, k, v])
    if device.type == "cuda":
        # Peak bytes one fwd+bwd allocates beyond the inputs, grad_o and the input gradients (those are
        # allocated first): what the core itself needs. A core that stores or materialises the [s, s]
        # probabilities grows with b * H * s^2, a flash-style one only with b * H * s.
        for t in (q, k, v):
            t.grad = torch.zeros_like(t)
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn(q, k, v).backward(grad_o)
        torch.cuda.synchronize(device)
        out["fwdbwd_peak_bytes"] = float(torch.cuda.max_memory_allocated(device) - base)
    flops_fwd = 4.0 * b * heads * s * s * d * (0.5 if causal else 1.0)
    for metric, mult in (("fwd", 1.0), ("bwd", 2.5), ("fwdbwd", 3.5)):
        out[f"{metric}_tflops"] = flops_fwd * mult / (out[f"{metric}_ms"] * 1e-3) / 1e12
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: Triton interpreter, tiny shapes for "
                    "the size options not given (s = 32, d = 16, 32 tokens, H * d = 32 per q head of a group)")
    ap.add_argument("--out", default=None, help="directory (or .csv path) for rows; default bench/results "
                    "(--quick writes nothing unless --out is given)")
    ap.add_argument("--seqlens", help="comma-separated s (default 1024,2048,4096,8192)")
    ap.add_argument("--head-dims", help="comma-separated d (default 64,128)")
    ap.add_argument("--dropouts", default="0,0.1", help="comma-separated p in [0, 1) (default 0,0.1)")
    ap.add_argument("--causal", choices=["1", "0", "both"], default="1")
    ap.add_argument("--providers", default=",".join(PROVIDERS))
    ap.add_argument("--tokens", type=int, help="b * s (default 16384)")
    ap.add_argument("--hidden", type=int, help="H * d (default 2048)")
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--gqa-group", type=int, default=1,
                    help="q heads per k/v head (grouped-query attention; must divide the head count)")
    ap.add_argument("--compile-only", action="store_true",
                    help="one untimed fwd+bwd per configuration, no rows: fills Triton's cache (several such "
                    "runs at once compile on several cores; bench/gpu_suite.sh does so before the timed run)")
    args = ap.parse_args(argv)
    if args.gqa_group < 1:
        ap.error(f"--gqa-group must be >= 1, got {args.gqa_group}")
    fill_defaults(args, dict(seqlens="1024,2048,4096,8192", head_dims="64,128", tokens=16384, hidden=2048),
                  dict(seqlens="32", head_dims="16", tokens=32, hidden=32 * args.gqa_group))
    seqlens, head_dims = (comma_list(ap, f"--{key.replace('_', '-')}", getattr(args, key))
                          for key in ("seqlens", "head_dims"))
    dropouts = comma_list(ap, "--dropouts", args.dropouts, float, probability, f"probabilities in {PROBABILITY_RANGE}")
    for key in ("tokens", "hidden"):
        if getattr(args, key) <= 0:
            ap.error(f"--{key} must be positive, got {getattr(args, key)}")
    tokens, hidden = args.tokens, args.hidden
    providers = [x for x in args.providers.split(",") if x]
    for name in providers:
        if name not in PROVIDERS:
            ap.error(f"unknown provider {name!r}; expected one of {PROVIDERS}")

    has_cuda = torch.cuda.is_available()
    if args.quick:
        if not has_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--quick on CPU runs Triton in its interpreter: set TRITON_INTERPRET=1 before importing this "
                     "module (running it as a script with --quick does)")
    elif not has_cuda:
        print("bench_attention: needs a CUDA device (none found); use --quick for a CPU smoke test")
        return 2
    device = torch.device("cuda" if has_cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    if args.quick and not has_cuda:
        dtype = torch.float32          # the interpreter's bf16 path is a testing fallback
    dtype_name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    causals = {"1": [True], "0": [False], "both": [True, False]}[args.causal]
    device_name = torch.cuda.get_device_name(device) if has_cuda else "cpu"
    rows = ResultRows(device_name, "bench_attention")
    results: Dict[tuple, Dict[str, float]] = {}
    skipped: Dict[str, str] = {}
    print(f"# {device_name}  dtype={dtype}  tokens={tokens} hidden={hidden}")
    print(f"{'provider':22s} {'config':44s} {'fwd':>8s} {'bwd':>8s} {'fwd+bwd':>8s}  TFLOP/s (ms fwd+bwd)")
    with rows.sweep():
        for causal in causals:
            for d in head_dims:
                for s in seqlens:
                    for p in dropouts:
                        b, heads = max(1, tokens // s), max(1, hidden // d)
                        if heads % args.gqa_group:
                            ap.error(f"--gqa-group {args.gqa_group} does not divide H={heads} (d={d})")
                        gqa = f" Hkv={heads // args.gqa_group}" if args.gqa_group > 1 else ""
                        config = f"b={b} H={heads}{gqa} s={s} d={d} causal={int(causal)} p={p} {dtype_name}"
                        for name in providers:
                            try:
                                r = bench_config(name, b, heads, s, d, causal, p, dtype, device, args.quick,
                                                 args.gqa_group, args.compile_only)
                            except Exception as exc:  # noqa: BLE001 - a provider that can't run is skipped
                                msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
                                if skipped.get(name) != msg:
                                    print(f"{name:22s} {config:44s} skipped ({msg})")
                                skipped[name] = msg
                                if device.type == "cuda":
                                    torch.cuda.empty_cache()
                                continue
                            if args.compile_only:
                                print(f"{name:22s} {config:44s} compiled", flush=True)
                                continue
                            results[(name, causal, d, s, p)] = r
                            for metric, value in r.items():
                                rows.add(config, name, metric, value)
                            print(f"{name:22s} {config:44s} {r['fwd_tflops']:8.1f} {r['bwd_tflops']:8.1f} "
                                  f"{r['fwdbwd_tflops']:8.1f}  ({r['fwdbwd_ms']:.3f} ms)")
                            if name == "seqpar-triton" and device.type == "cuda":
                                print(f"{'':22s} {'tuned: ' + tuned_configs():44s}")
                            if device.type == "cuda":
                                torch.cuda.empty_cache()

    if not args.compile_only:
        print("\n# seqpar-triton fwd+bwd / best SDPA backend (target >= 0.9 at s >= 2048, d = 128, p = 0.1)")
        for (name, causal, d, s, p), r in sorted(results.items()):
            if name != "seqpar-triton":
                continue
            best = [results[(o, causal, d, s, p)]["fwdbwd_tflops"] for o in SDPA if (o, causal, d, s, p) in results]
            if best:
                ratio = r["fwdbwd_tflops"] / max(best)
                rows.add(f"causal={int(causal)} s={s} d={d} p={p} {dtype_name}", name, "fwdbwd_vs_best_sdpa", ratio)
                print(f"causal={int(causal)} d={d:3d} s={s:5d} p={p}: {ratio:.2f}x")

    return 0 if args.compile_only else rows.finish(args.out, args.quick)


if __name__ == "__main__":
    sys.exit(main())
