#!/usr/bin/env python3
"""Benchmark: fused bias + dropout + residual add + LayerNorm (issue 3), fwd / bwd / fwd+bwd.

    residual_out = residual + dropout_p(x + bias);  y = LayerNorm(residual_out) * w + b

Sweep: h in {1024, 4096, 12288, 20480} x tokens in {256, 1024, 16384} x p in {0, 0.1} (dropout off and
on), bf16 (``--hidden``, ``--tokens``, ``-p``, ``--dtype`` change it). h = 20480 (the paper's 530B model)
takes the kernels' column-chunked rows.

Providers (a provider that can't run is reported and skipped):
    seqpar-triton     bias_dropout_add_layer_norm(backend="triton")
    seqpar-cuda       bias_dropout_add_layer_norm(backend="cuda")
    torch-eager       residual + F.dropout(x + bias), then F.layer_norm
    torch-compile     torch.compile of the torch-eager function (Inductor, default mode), compiled
                      afresh for each configuration with static shapes (:func:`compiled_for_one_shape`)
    apex-ln           torch bias-dropout-add + apex.normalization.FusedLayerNorm      (if importable)
    te-ln             torch bias-dropout-add + transformer_engine.pytorch.LayerNorm   (if importable)
    liger-ln          torch bias-dropout-add + liger_kernel LigerLayerNorm             (if importable)
    seqpar-torch      the op's torch reference backend (only with --quick: it is an oracle, not a contender)

Bandwidth counts the minimal bytes, each input read once and each output written once (E = bytes per
element, N = tokens; the per-row fp32 mean/rstd are ignored):
    fwd      reads x, residual (+ bias, w, b: 3h)     writes y, residual_out       (4 N h + 3 h) E
    bwd      reads grad_y, grad_residual_out, residual_out (+ w)
             writes grad_x, grad_residual (+ 3 parameter gradients)               (5 N h + 4 h) E
    fwd+bwd  the sum                                                               (9 N h + 7 h) E
and is reported as GB/s and as a fraction of the device's copy bandwidth, which the script measures
itself (a device-to-device copy of a 1 GiB buffer: 2 GiB moved). Issue targets (GPU): fwd and bwd each
>= 0.85 of copy bandwidth for h >= 4096; fwd+bwd >= 2.5x torch-eager and >= 1.2x torch-compile.

Timing: CUDA events around each run, median of ``--reps`` runs after ``--warmup`` runs; the L2 cache is
flushed (256 MiB written) before every run so small configurations are not served from L2. Backward is
timed on a retained graph (torch.autograd.grad with retain_graph=True); inputs are random, never zeros.
ResultRows (device, date, commit, config, provider, metric, value) are appended to
``<out>/bench_layernorm_dropout.csv``; metrics: {fwd,bwd,fwdbwd}_ms, {fwd,bwd,fwdbwd}_gbps,
{fwd,bwd,fwdbwd}_frac_copy, and one copy_gbps row (provider "device-copy") per run.

Usage:
    python bench/bench_layernorm_dropout.py                       # GPU: the full sweep, rows to bench/results/
    python bench/bench_layernorm_dropout.py --out DIR             # rows to DIR/bench_layernorm_dropout.csv
    python bench/bench_layernorm_dropout.py --hidden 4096 --tokens 16384 --providers seqpar-cuda,torch-eager
    python bench/bench_layernorm_dropout.py -p 0.1                # dropout on only
    python bench/bench_layernorm_dropout.py --quick               # CPU smoke test (tiny, Triton interpreter)
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if __name__ == "__main__" and "--quick" in sys.argv[1:]:
    # The Triton interpreter must be chosen before anything imports triton (importing seqpar does): set in
    # main() it is too late for the @triton.jit helpers the kernels call.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from seqpar.bench.results import ResultRows  # noqa: E402
from seqpar.bench.timing import median_ms  # noqa: E402
import torch.nn.functional as F  # noqa: E402

PROVIDERS = ["seqpar-triton", "seqpar-cuda", "torch-eager", "torch-compile", "apex-ln", "te-ln", "liger-ln",
             "seqpar-torch"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-5
SEED = 1234
DIRECTIONS = ("fwd", "bwd", "fwdbwd")


# ----------------------------------------------------------------------------- bookkeeping
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


# ----------------------------------------------------------------------------- timing
class Timer:
    """Median milliseconds of ``fn()``: CUDA events with an L2 flush before each run, or perf_counter."""

    def __init__(self, device: torch.device, warmup: int, reps: int):
        self.device, self.warmup, self.reps = device, warmup, reps
        self.flush = (torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda"
                      else None)

    def __call__(self, fn: Callable[[], object]) -> float:
        flush = self.flush.zero_ if self.flush is not None else None
        return median_ms(fn, self.device, self.warmup, self.reps, before=flush)


def compiled_for_one_shape(fn: Callable, device: torch.device) -> Callable:
    """``torch.compile(fn, dynamic=False)`` after ``torch._dynamo.reset()``: kernels specialised to the
    configuration about to be timed, as a training run with fixed shapes gets them. Without the reset, a
    sweep recompiles one function at every new shape: Dynamo then turns to dynamic shapes (looped
    reductions in place of the persistent ones a known h allows), or, past its recompile limit (8),
    silently runs the function eagerly, and the "torch-compile" rows would time that instead."""
    if device.type != "cuda":
        raise RuntimeError("torch.compile is benchmarked on CUDA only (Inductor's CPU build takes minutes)")
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def measure_copy_gbps(device: torch.device, timer: Timer, nbytes: int) -> float:
    """Device-to-device copy bandwidth: bytes read + bytes written per second."""
    src = torch.randint(0, 100, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def minimal_bytes(tokens: int, h: int, elem: int) -> Dict[str, int]:
    fwd = (4 * tokens * h + 3 * h) * elem
    bwd = (5 * tokens * h + 4 * h) * elem
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}


# ----------------------------------------------------------------------------- providers
def _torch_bda_ln(x, bias, residual, w, b, p: float):
    residual_out = residual + F.dropout(x + bias, p=p, training=True)
    return F.layer_norm(residual_out, (x.shape[-1],), w, b, EPS), residual_out


def _peer_ln(name: str, h: int, dtype, device) -> torch.nn.Module:
    if name == "apex-ln":
        from apex.normalization import FusedLayerNorm

        return FusedLayerNorm(h, eps=EPS).to(device=device, dtype=dtype)
    if name == "te-ln":
        import transformer_engine.pytorch as te

        return te.LayerNorm(h, eps=EPS, params_dtype=dtype, device=device)
    if name == "liger-ln":
        from liger_kernel.transformers import LigerLayerNorm

        return LigerLayerNorm(h, eps=EPS).to(device=device, dtype=dtype)
    raise ValueError(name)


def make_provider(name: str, h: int, p: float, dtype, device: torch.device
                  ) -> Tuple[Callable, List[torch.Tensor]]:
    """(f(x, bias, residual) -> (y, residual_out), LayerNorm parameters needing gradients)."""
    from seqpar.ops import registry
    from seqpar.ops.bias_dropout_add_layer_norm import OP, bias_dropout_add_layer_norm

    g = torch.Generator(device="cpu").manual_seed(7)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(device=device, dtype=dtype).requires_grad_()
    b = (0.1 * torch.randn(h, generator=g)).to(device=device, dtype=dtype).requires_grad_()
    if name.startswith("seqpar-"):
        backend = name.split("-", 1)[1]
        reason = registry.unavailable_reason(OP, backend, device, h=h)
        if reason:
            raise RuntimeError(reason)
        return (lambda x, bias, res: bias_dropout_add_layer_norm(x, bias, res, w, b, p=p, eps=EPS, seed=SEED,
                                                                 backend=backend)), [w, b]
    if name == "torch-eager":
        return (lambda x, bias, res: _torch_bda_ln(x, bias, res, w, b, p)), [w, b]
    if name == "torch-compile":
        compiled = compiled_for_one_shape(_torch_bda_ln, device)
        return (lambda x, bias, res: compiled(x, bias, res, w, b, p)), [w, b]
    if name in ("apex-ln", "te-ln", "liger-ln"):
        if device.type != "cuda":
            raise RuntimeError(f"{name} needs CUDA")
        try:
            ln = _peer_ln(name, h, dtype, device)
        except ImportError as exc:
            raise RuntimeError(f"not importable ({exc})") from None
        return (lambda x, bias, res: _peer_forward(ln, x, bias, res, p)), list(ln.parameters())
    raise ValueError(f"unknown provider {name!r}; expected one of {PROVIDERS}")


def _peer_forward(ln, x, bias, residual, p: float):
    residual_out = residual + F.dropout(x + bias, p=p, training=True)
    return ln(residual_out), residual_out


# ----------------------------------------------------------------------------- one configuration
def bench_config(provider: str, tokens: int, h: int, p: float, dtype, device: torch.device, timer: Timer,
                 copy_gbps: float, rows: ResultRows) -> Optional[Dict[str, float]]:
    config = f"tokens={tokens},h={h},p={p},dtype={str(dtype).replace('torch.', '')}"
    try:
        f, params = make_provider(provider, h, p, dtype, device)
    except RuntimeError as exc:
        print(f"  {provider:14s} {config}: skipped ({exc})")
        return None
    g = torch.Generator(device="cpu").manual_seed(tokens * 7 + h)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)

    x, residual = rnd(tokens, h).requires_grad_(), rnd(tokens, h, scale=2.0).requires_grad_()
    bias = rnd(h, scale=0.5).requires_grad_()
    grad_y, grad_ro = rnd(tokens, h), rnd(tokens, h)
    leaves = [x, bias, residual] + params

    def fwd():
        return f(x, bias, residual)

    def fwdbwd():
        y, ro = f(x, bias, residual)
        return torch.autograd.grad((y, ro), leaves, (grad_y, grad_ro))

    try:
        ms = {"fwd": timer(fwd)}
        y, ro = fwd()
        ms["bwd"] = timer(lambda: torch.autograd.grad((y, ro), leaves, (grad_y, grad_ro), retain_graph=True))
        del y, ro
        ms["fwdbwd"] = timer(fwdbwd)
    except Exception as exc:  # a provider failing on one configuration must not stop the sweep
        print(f"  {provider:14s} {config}: failed ({type(exc).__name__}: {exc})")
        return None
    nbytes = minimal_bytes(tokens, h, torch.empty((), dtype=dtype).element_size())
    gbps = {d: nbytes[d] / (ms[d] * 1e-3) / 1e9 for d in DIRECTIONS}
    for d in DIRECTIONS:
        rows.add(config, provider, f"{d}_ms", ms[d])
        rows.add(config, provider, f"{d}_gbps", gbps[d])
        rows.add(config, provider, f"{d}_frac_copy", gbps[d] / copy_gbps)
    print(f"  {provider:14s} {config}: " + "  ".join(
        f"{d} {ms[d]:8.3f} ms {gbps[d]:7.1f} GB/s ({gbps[d] / copy_gbps:4.0%})" for d in DIRECTIONS), flush=True)
    return ms


def _summary(results: Dict[Tuple[int, int, float], Dict[str, Dict[str, float]]]) -> None:
    print("\nfwd+bwd speed-up of the seqpar kernels (issue targets: >= 2.5x torch-eager, >= 1.2x torch-compile)")
    for (tokens, h, p), by_provider in results.items():
        for ours in ("seqpar-cuda", "seqpar-triton"):
            if ours not in by_provider:
                continue
            parts = [f"{base} {by_provider[base]['fwdbwd'] / by_provider[ours]['fwdbwd']:.2f}x"
                     for base in ("torch-eager", "torch-compile") if base in by_provider]
            print(f"  tokens={tokens:6d} h={h:6d} p={p:<4} {ours:14s} " + ", ".join(parts))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", default="1024,4096,12288,20480", help="comma-separated hidden sizes")
    ap.add_argument("--tokens", default="256,1024,16384", help="comma-separated token counts (rows)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("-p", default="0,0.1", help="comma-separated dropout probabilities (0: dropout off)")
    ap.add_argument("--providers", default=",".join(p for p in PROVIDERS if p != "seqpar-torch"))
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None, help="directory (or .csv path) for rows; default bench/results "
                    "(--quick writes nothing unless --out is given)")
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke test: tiny shapes, few runs, Triton in its interpreter")
    args = ap.parse_args(argv)

    if args.quick:
        device = torch.device("cpu")
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--quick runs Triton in its interpreter: set TRITON_INTERPRET=1 before importing this module "
                     "(running it as a script with --quick does)")
        hidden, tokens = [64, 200], [48]
        providers = ["seqpar-triton", "seqpar-torch", "torch-eager", "torch-compile"]
        warmup, reps, copy_bytes = 1, 3, 2**24
    else:
        if not torch.cuda.is_available():
            print("bench_layernorm_dropout: needs a CUDA device (none found); run with --quick for the CPU "
                  "smoke test", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        hidden = [int(v) for v in args.hidden.split(",")]
        tokens = [int(v) for v in args.tokens.split(",")]
        providers = args.providers.split(",")
        warmup, reps, copy_bytes = args.warmup, args.reps, 2**30
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        ap.error(f"unknown providers {unknown}; choose from {PROVIDERS}")
    dtype = DTYPES[args.dtype]
    try:
        dropouts = [float(v) for v in args.p.split(",")]
    except ValueError:
        ap.error(f"-p must be comma-separated probabilities, got {args.p!r}")
    for p in dropouts:
        if not 0.0 <= p < 1.0:
            ap.error(f"-p must be in [0, 1), got {p}")

    timer = Timer(device, warmup, reps)
    rows = ResultRows(_device_name(device), "bench_layernorm_dropout")
    copy_gbps = measure_copy_gbps(device, timer, copy_bytes)
    rows.add(f"bytes={copy_bytes}", "device-copy", "copy_gbps", copy_gbps)
    print(f"device: {rows.meta['device']}   commit: {rows.meta['commit']}   copy bandwidth: {copy_gbps:.1f} GB/s")
    results: Dict[Tuple[int, int, float], Dict[str, Dict[str, float]]] = {}
    with rows.sweep():
        for n in tokens:
            for h in hidden:
                for p in dropouts:
                    for provider in providers:
                        r = bench_config(provider, n, h, p, dtype, device, timer, copy_gbps, rows)
                        if r is not None:
                            results.setdefault((n, h, p), {})[provider] = r
    _summary(results)
    return rows.finish(args.out, args.quick)


if __name__ == "__main__":
    sys.exit(main())
