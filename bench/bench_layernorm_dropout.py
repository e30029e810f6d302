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
>= 0.85 of copy bandwidth for h >= 4096; fwd+bwd >= 2.5x torch-eager and >= 1.2x torch-compile. The
targets are about the kernels: they are read from the GPU time below, not the call time.

Timing: each direction is timed twice, the two answering different questions.
    call time  {d}_ms, {d}_gbps, {d}_frac_copy (the metric names of the first GPU run): ONE eager call,
               CUDA events around it, the L2 cache flushed (256 MiB written) before it and a synchronize
               after it; median of ``--reps`` runs after ``--warmup`` runs. The host's launch path
               (Python, dispatcher, autograd, the kernels' launchers) is inside it: at shard sizes
               (256 x 1024) it is most of it, with the GPU idle while the host launches.
    GPU time   {d}_gpu_ms, {d}_gpu_gbps, {d}_gpu_frac_copy: what the GPU spends on the call's kernels with
               the host running ahead (seqpar.bench.timing.device_time: batches of back-to-back calls
               queued behind a GPU-side sleep, each batch checking that the queue never drained; median
               of ``--gpu-reps`` batches). Beside it: {d}_host_ms (host time to issue one call: the
               launch path), {d}_gpu_calls (calls per batch), {d}_gpu_queue_full (fraction of batches
               whose queue stayed full; below 1 the GPU time includes launch gaps, an upper bound) and
               {d}_gpu_l2_reuse (data passing through L2 between two uses of the same input, in L2 sizes).
               L2 policy: no flush between back-to-back calls (it would be inside the timed batch);
               instead, when one call moves less than twice the L2 (50 MB on H100 / H200), the calls
               take turns over copies of the inputs (timing.input_sets) so each comes back only after
               >= 2 L2 sizes of other data, and is read from DRAM as in a step where other layers run in
               between. On CPU (--quick) the GPU time falls back to host wall time (there is no queue).
Backward is timed alone on retained graphs (torch.autograd.grad with retain_graph=True: no forward inside
it); inputs are random, never zeros. ResultRows (device, date, commit, config, provider, metric, value)
are appended to ``<out>/bench_layernorm_dropout.csv``: the metrics above for d in fwd, bwd, fwdbwd, and
one copy_gbps row (provider "device-copy") per run.

A copy of the same bytes (provider "device-copy", config without p: {d}_gpu_ms, {d}_gpu_gbps): per
(tokens, h), the GPU time of a device-to-device copy moving each direction's minimal bytes
(:func:`same_bytes_copy`). The 1 GiB copy's bandwidth is the issue's yardstick; this one is the best a
kernel of that size can do, which at shard sizes is far below it (gpu_summary reports both).

Usage:
    python bench/bench_layernorm_dropout.py                       # GPU: the full sweep, rows to bench/results/
    python bench/bench_layernorm_dropout.py --out DIR             # rows to DIR/bench_layernorm_dropout.csv
    python bench/bench_layernorm_dropout.py --hidden 4096 --tokens 16384 --providers seqpar-cuda,torch-eager
    python bench/bench_layernorm_dropout.py -p 0.1                # dropout on only
    python bench/bench_layernorm_dropout.py --quick               # CPU smoke test (tiny, Triton interpreter)
    python bench/bench_layernorm_dropout.py --compile-only --hidden 4096 -p 0.1 &   # warm the on-disk caches
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if __name__ == "__main__" and "--quick" in sys.argv[1:]:
    # The Triton interpreter must be chosen before anything imports triton (importing seqpar does): set in
    # main() it is too late for the @triton.jit helpers the kernels call.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from seqpar.bench.options import PROBABILITY_RANGE, comma_list, fill_defaults, probability  # noqa: E402
from seqpar.bench.results import ResultRows  # noqa: E402
from seqpar.bench.timing import DeviceTime, device_time, input_sets, l2_bytes, median_ms  # noqa: E402
from seqpar.bench.timing import reuse_distance_l2  # noqa: E402
import torch.nn.functional as F  # noqa: E402

PROVIDERS = ["seqpar-triton", "seqpar-cuda", "torch-eager", "torch-compile", "apex-ln", "te-ln", "liger-ln",
             "seqpar-torch"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EPS = 1e-5
SEED = 1234
DIRECTIONS = ("fwd", "bwd", "fwdbwd")
CLOCKS = ("call: one eager call, launch overhead included (L2 flushed before it); gpu: device time of back-to-back "
          "calls with the host ahead (seqpar.bench.timing.device_time; on CPU: wall time); % of copy bandwidth")


# ----------------------------------------------------------------------------- bookkeeping
def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


# ----------------------------------------------------------------------------- timing
class Timer:
    """The benchmarks' two clocks. ``timer(fn)``: the eager call time, median milliseconds of one
    ``fn()`` (CUDA events with an L2 flush before each run, or perf_counter). ``timer.gpu(fns)``: the
    GPU time per call of back-to-back calls taking ``fns`` in turn (seqpar.bench.timing.device_time).
    ``l2`` is the device's L2 size (None on CPU); ``input_sets(nbytes)`` how many copies of a call's
    inputs keep its data out of L2 between uses."""

    def __init__(self, device: torch.device, warmup: int, reps: int, gpu_reps: int = 8, gpu_min_calls: int = 4):
        self.device, self.warmup, self.reps = device, warmup, reps
        self.gpu_reps, self.gpu_min_calls = gpu_reps, gpu_min_calls
        self.flush = (torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda"
                      else None)
        self.l2 = l2_bytes(device)

    def __call__(self, fn: Callable[[], object]) -> float:
        flush = self.flush.zero_ if self.flush is not None else None
        return median_ms(fn, self.device, self.warmup, self.reps, before=flush)

    def gpu(self, fns) -> DeviceTime:
        return device_time(fns, self.device, reps=self.gpu_reps, min_calls=self.gpu_min_calls,
                           max_calls=max(16, self.gpu_min_calls))

    def input_sets(self, nbytes: int) -> int:
        return input_sets(nbytes, self.l2)


def record(rows: ResultRows, config: str, provider: str, direction: str, call_ms: float, gpu: DeviceTime,
           nbytes: int, copy_gbps: float, l2: Optional[int], sets: int) -> str:
    """Adds one direction's rows (call time, GPU time and its checks); returns its part of the printout."""
    gbps, gpu_gbps = nbytes / (call_ms * 1e-3) / 1e9, nbytes / (gpu.ms * 1e-3) / 1e9
    for metric, value in ((f"{direction}_ms", call_ms), (f"{direction}_gbps", gbps),
                          (f"{direction}_frac_copy", gbps / copy_gbps), (f"{direction}_gpu_ms", gpu.ms),
                          (f"{direction}_gpu_gbps", gpu_gbps), (f"{direction}_gpu_frac_copy", gpu_gbps / copy_gbps),
                          (f"{direction}_host_ms", gpu.host_ms), (f"{direction}_gpu_calls", float(gpu.calls))):
        rows.add(config, provider, metric, value)
    if gpu.method == "cuda-back-to-back":
        rows.add(config, provider, f"{direction}_gpu_queue_full", gpu.queue_full)
    if l2:
        rows.add(config, provider, f"{direction}_gpu_l2_reuse", reuse_distance_l2(nbytes, sets, l2))
    text = (f"{direction} call {call_ms:7.3f} ms ({gbps / copy_gbps:4.0%})  gpu {gpu.ms:7.3f} ms {gpu_gbps:7.1f} GB/s "
            f"({gpu_gbps / copy_gbps:4.0%})")
    return text + (f" [{gpu.note}]" if gpu.note and gpu.method != "wall-clock" else "")


def compiled_for_one_shape(fn: Callable, device: torch.device) -> Callable:
    """``torch.compile(fn, dynamic=False)`` after ``torch._dynamo.reset()``: kernels specialised to the
    configuration about to be timed, as a training run with fixed shapes gets them. Without the reset, a
    sweep recompiles one function at every new shape: Dynamo then turns to dynamic shapes (looped
    reductions in place of the persistent ones a known h allows), or, past its recompile limit (8),
    silently runs the function eagerly, and the "torch-compile" rows would time that instead.

    Donated buffers are turned off for the whole process: the backward is timed on retained graphs
    (``retain_graph=True``), which a backward compiled to reuse its saved tensors as scratch refuses (every
    torch-compile row of the LayerNorm, RMSNorm and dropout sweeps failed so on the H200 at 508368d, torch
    2.11). Turning it off costs the compiled backward an allocation of a buffer it could have reused."""
    if device.type != "cuda":
        raise RuntimeError("torch.compile is benchmarked on CUDA only (Inductor's CPU build takes minutes)")
    import torch._functorch.config as functorch_config

    # read both when the backward is compiled and when it runs, so set for the process, not around one call
    functorch_config.donated_buffer = False
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def measure_copy_gbps(device: torch.device, timer: Timer, nbytes: int) -> float:
    """Device-to-device copy bandwidth: bytes read + bytes written per second."""
    src = torch.randint(0, 100, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def same_bytes_copy(config: str, nbytes: Dict[str, int], device: torch.device, timer: Timer,
                    rows: ResultRows) -> str:
    """The bandwidth a kernel moving ``nbytes[d]`` can reach at best, measured: the GPU time
    (``timer.gpu``: back-to-back calls, as the providers' GPU time) of a device-to-device copy reading
    ``nbytes[d] / 2`` and writing as many, over as many buffer pairs as the providers' input sets (so each
    copy reads DRAM too). At 16384 rows it is the 1 GiB copy's bandwidth; at shard sizes (256 x 1024: 2 MB)
    a single copy kernel's ramp-up and tail are most of its time, and the 1 GiB copy's fraction is out of
    any kernel's reach there. fwdbwd is the fwd and bwd copies' sum (the op's fwd+bwd is two kernels at
    least). Adds rows of provider "device-copy" ({d}_gpu_ms, {d}_gpu_gbps) under ``config``; returns its
    printout."""
    ms = {}
    for direction in ("fwd", "bwd"):
        half = max(1, nbytes[direction] // 2)
        pairs = [(torch.randint(0, 100, (half,), dtype=torch.uint8, device=device),
                  torch.empty(half, dtype=torch.uint8, device=device))
                 for _ in range(timer.input_sets(nbytes[direction]))]
        ms[direction] = timer.gpu([lambda src=src, dst=dst: dst.copy_(src) for src, dst in pairs]).ms
        del pairs
    ms["fwdbwd"] = ms["fwd"] + ms["bwd"]
    for direction, t in ms.items():
        rows.add(config, "device-copy", f"{direction}_gpu_ms", t)
        rows.add(config, "device-copy", f"{direction}_gpu_gbps", nbytes[direction] / (t * 1e-3) / 1e9)
    return "  ".join(f"{d} {t:7.3f} ms {nbytes[d] / (t * 1e-3) / 1e9:7.1f} GB/s" for d, t in ms.items())


def cuda_forward_plan(query: str, h: int, dtype: torch.dtype, device: torch.device) -> Optional[str]:
    """The seqpar-cuda forward's launch plan for rows of h columns on ``device`` (``query``: the extension's
    ``*_fwd_plan``), as a line of the log beside the times it explains; None where the extension can't run."""
    from seqpar import _ext

    if _ext.cuda_unavailable_reason(device):
        return None
    vectorized = h % (16 // dtype.itemsize) == 0
    kind, vpt, threads, rows_per_block, chunks, blocks = getattr(_ext.cuda_extension(), query)(
        h, _ext.DTYPE_CODES[dtype], vectorized)
    vector = f"{16 // dtype.itemsize}-element vectors" if vectorized else "scalar runs"
    return (f"{kind} per row: {threads} threads x {vpt} {vector}, {rows_per_block} rows a block, {chunks} column "
            f"chunks, {blocks} blocks resident per SM")


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
def inductor_cache_counts() -> str:
    """This process's hits and misses so far in Inductor's on-disk caches (the compiled graphs, then
    AOTAutograd's fwd+bwd pairs), for the log: after a ``--compile-only`` run the timed run's compiles
    should be hits."""
    from torch._dynamo.utils import counters

    return ", ".join(f"{label} {counters[group][f'{key}_hit']} hits / {counters[group][f'{key}_miss']} misses"
                     for label, group, key in (("graphs", "inductor", "fxgraph_cache"),
                                               ("autograd", "aot_autograd", "autograd_cache")))


def bench_config(provider: str, tokens: int, h: int, p: float, dtype, device: torch.device, timer: Timer,
                 copy_gbps: float, rows: ResultRows, compile_only: bool = False) -> Optional[Dict[str, float]]:
    """Times one provider on one configuration, adds its rows and returns its times (None when it was
    skipped or failed). ``compile_only``: one untimed fwd+bwd instead (the provider's kernels compiled into
    Triton's and Inductor's on-disk caches), no rows."""
    config = f"tokens={tokens},h={h},p={p},dtype={str(dtype).replace('torch.', '')}"
    started = time.perf_counter()
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
    if compile_only:
        try:
            torch.autograd.grad(f(x, bias, residual), [x, bias, residual] + params, (grad_y, grad_ro))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as exc:  # a provider failing on one configuration must not stop the sweep
            print(f"  {provider:14s} {config}: failed ({type(exc).__name__}: {exc})")
            return None
        print(f"  {provider:14s} {config}: compiled ({time.perf_counter() - started:.1f} s)", flush=True)
        return None
    nbytes = minimal_bytes(tokens, h, torch.empty((), dtype=dtype).element_size())
    # The GPU time's calls take turns over copies of the [tokens, h] tensors when one call moves less than
    # twice the L2 (bias and the LayerNorm parameters are shared: h elements each).
    sets = [(x, residual, grad_y, grad_ro)] + [
        (x.detach().clone().requires_grad_(), residual.detach().clone().requires_grad_(), grad_y.clone(),
         grad_ro.clone()) for _ in range(timer.input_sets(nbytes["fwd"]) - 1)]

    def fwd_of(s):
        return lambda: f(s[0], bias, s[1])

    def fwdbwd_of(s):
        leaves = [s[0], bias, s[1]] + params
        return lambda: torch.autograd.grad(f(s[0], bias, s[1]), leaves, (s[2], s[3]))

    def bwd_of(s, outs):
        leaves = [s[0], bias, s[1]] + params
        return lambda: torch.autograd.grad(outs, leaves, (s[2], s[3]), retain_graph=True)

    try:
        fwds = [fwd_of(s) for s in sets]
        ms, gpu = {"fwd": timer(fwds[0])}, {"fwd": timer.gpu(fwds)}
        bwds = [bwd_of(s, fn()) for s, fn in zip(sets, fwds)]          # one retained graph per input set
        ms["bwd"], gpu["bwd"] = timer(bwds[0]), timer.gpu(bwds)
        del bwds
        fwdbwds = [fwdbwd_of(s) for s in sets]
        ms["fwdbwd"], gpu["fwdbwd"] = timer(fwdbwds[0]), timer.gpu(fwdbwds)
    except Exception as exc:  # a provider failing on one configuration must not stop the sweep
        print(f"  {provider:14s} {config}: failed ({type(exc).__name__}: {exc})")
        return None
    parts = [record(rows, config, provider, d, ms[d], gpu[d], nbytes[d], copy_gbps, timer.l2, len(sets))
             for d in DIRECTIONS]
    took = f"took {time.perf_counter() - started:.1f} s" + (
        f"; Inductor's caches: {inductor_cache_counts()}" if provider == "torch-compile" else "")
    print(f"  {provider:14s} {config}: " + "  ".join(parts) + f"  ({took})", flush=True)
    return {**ms, **{f"{d}_gpu": gpu[d].ms for d in DIRECTIONS}}


def _summary(results: Dict[Tuple[int, int, float], Dict[str, Dict[str, float]]]) -> None:
    print("\nfwd+bwd speed-up of the seqpar kernels, GPU time (eager call time) (issue targets: >= 2.5x "
          "torch-eager, >= 1.2x torch-compile)")
    for (tokens, h, p), by_provider in results.items():
        for ours in ("seqpar-cuda", "seqpar-triton"):
            if ours not in by_provider:
                continue
            mine = by_provider[ours]
            parts = [f"{base} {by_provider[base]['fwdbwd_gpu'] / mine['fwdbwd_gpu']:.2f}x "
                     f"({by_provider[base]['fwdbwd'] / mine['fwdbwd']:.2f}x)"
                     for base in ("torch-eager", "torch-compile", "apex-ln", "te-ln", "liger-ln")
                     if base in by_provider]
            print(f"  tokens={tokens:6d} h={h:6d} p={p:<4} {ours:14s} " + ", ".join(parts))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", help="comma-separated hidden sizes (default 1024,4096,12288,20480)")
    ap.add_argument("--tokens", help="comma-separated token counts (rows; default 256,1024,16384)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("-p", default="0,0.1", help="comma-separated dropout probabilities (0: dropout off)")
    ap.add_argument("--providers", help="comma-separated; default: every provider but seqpar-torch (--quick: "
                    "seqpar-triton,seqpar-torch,torch-eager,torch-compile)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50, help="eager call time: timed single calls")
    ap.add_argument("--gpu-reps", type=int, default=8, help="GPU time: timed batches of back-to-back calls")
    ap.add_argument("--out", default=None, help="directory (or .csv path) for rows; default bench/results "
                    "(--quick writes nothing unless --out is given)")
    ap.add_argument("--quick", action="store_true",
                    help="CPU smoke test: few runs, Triton in its interpreter, tiny shapes for the size options "
                    "not given (h = 64,200, 48 rows)")
    ap.add_argument("--compile-only", action="store_true",
                    help="one untimed fwd+bwd per provider and configuration, no rows: fills Triton's and "
                    "Inductor's on-disk caches (several such runs at once compile on several cores; "
                    "bench/gpu_suite.sh does so before the timed run)")
    args = ap.parse_args(argv)
    fill_defaults(args, dict(hidden="1024,4096,12288,20480", tokens="256,1024,16384",
                             providers=",".join(p for p in PROVIDERS if p != "seqpar-torch")),
                  dict(hidden="64,200", tokens="48", providers="seqpar-triton,seqpar-torch,torch-eager,torch-compile"))
    hidden, tokens = comma_list(ap, "--hidden", args.hidden), comma_list(ap, "--tokens", args.tokens)
    dropouts = comma_list(ap, "-p", args.p, float, probability, f"probabilities in {PROBABILITY_RANGE}")
    providers = [p for p in args.providers.split(",") if p]
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        ap.error(f"unknown providers {unknown}; choose from {PROVIDERS}")

    if args.quick:
        device = torch.device("cpu")
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--quick runs Triton in its interpreter: set TRITON_INTERPRET=1 before importing this module "
                     "(running it as a script with --quick does)")
        warmup, reps, copy_bytes = 1, 3, 2**24
        gpu_reps, gpu_min_calls = 2, 2
    else:
        if not torch.cuda.is_available():
            print("bench_layernorm_dropout: needs a CUDA device (none found); run with --quick for the CPU "
                  "smoke test", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        warmup, reps, copy_bytes = args.warmup, args.reps, 2**30
        gpu_reps, gpu_min_calls = args.gpu_reps, 4
    dtype = DTYPES[args.dtype]

    timer = Timer(device, warmup, reps, gpu_reps, gpu_min_calls)
    rows = ResultRows(_device_name(device), "bench_layernorm_dropout")
    if args.compile_only:
        for n in tokens:
            for h in hidden:
                for p in dropouts:
                    for provider in providers:
                        bench_config(provider, n, h, p, dtype, device, timer, 0.0, rows, compile_only=True)
        return 0
    copy_gbps = measure_copy_gbps(device, timer, copy_bytes)
    rows.add(f"bytes={copy_bytes}", "device-copy", "copy_gbps", copy_gbps)
    print(f"device: {rows.meta['device']}   commit: {rows.meta['commit']}   copy bandwidth: {copy_gbps:.1f} GB/s")
    print(CLOCKS)
    results: Dict[Tuple[int, int, float], Dict[str, Dict[str, float]]] = {}
    with rows.sweep():
        for n in tokens:
            for h in hidden:
                copy_config = f"tokens={n},h={h},dtype={str(dtype).replace('torch.', '')}"
                copy = same_bytes_copy(copy_config, minimal_bytes(n, h, torch.empty((), dtype=dtype).element_size()),
                                       device, timer, rows)
                print(f"  {'device-copy':14s} {copy_config} (the same bytes; GPU time): {copy}", flush=True)
                plan = cuda_forward_plan("bias_dropout_add_layer_norm_fwd_plan", h, dtype, device)
                if plan and "seqpar-cuda" in providers:
                    print(f"  {'seqpar-cuda':14s} h={h} forward launch: {plan}", flush=True)
                for p in dropouts:
                    for provider in providers:
                        r = bench_config(provider, n, h, p, dtype, device, timer, copy_gbps, rows)
                        if r is not None:
                            results.setdefault((n, h, p), {})[provider] = r
    _summary(results)
    return rows.finish(args.out, args.quick)


if __name__ == "__main__":
    sys.exit(main())
