#!/usr/bin/env python3
"""Benchmark: the Llama-block ops (issue 14), fwd / bwd / fwd+bwd: residual add + RMSNorm, SwiGLU, RoPE;
and the standalone dropout (GPT's embeddings, outside the fused LayerNorm) and bias-dropout-add (GPT's MLP
output, the RMSNorm path's hidden dropout).

    rmsnorm  y, residual_out = add_rms_norm(x, residual, w)            x, residual [tokens, h]
    swiglu   y = silu(gate) * up                                        gate_up [tokens, 2n]
    rope     q_rot, k_rot = rotary_embedding(q, k)                      q [s, b, Hq, d], k [s, b, Hk, d]
    dropout  y = dropout(x, p = 0.1), the mask regenerated in backward  x [tokens, h]
    bda      y = residual + dropout(x + bias, p = 0.1)                  x, residual [tokens, h], bias [h]

Default sweep (bf16): rmsnorm tokens 16384 x h {4096, 8192}; swiglu tokens 16384 x n {11008, 14336};
rope s 4096 x b 4, Hq 32, Hk 8, d 128; dropout and bda tokens 16384 x h {4096, 8192} (``--ops``, ``--tokens``,
``--hidden``, ``--ffn``, ``--seq``, ``--batch``, ``--heads``, ``--kv-heads``, ``--head-dim``, ``--dtype``
change it).

Providers (a provider that can't run is reported and skipped):
    seqpar-cuda       the op with backend="cuda" (dropout, bda: its kernel, seqpar::dropout_cuda)
    seqpar-triton     the op with backend="triton" (dropout, bda: seqpar::dropout_triton)
    torch-eager       HF Llama's formulas: residual + hidden then LlamaRMSNorm; F.silu(gate) * up;
                      apply_rotary_pos_emb on HF's [b, H, s, d] layout; F.dropout (a stored bool mask);
                      residual + F.dropout(x + bias) (Megatron's unfused bias-dropout-add)
    torch-compile     torch.compile of the torch-eager functions (Inductor, default mode), compiled
                      afresh for each configuration with static shapes
    liger             Liger-Kernel, if importable: torch add + LigerRMSNorm; LigerSiLUMulFunction;
                      liger_rotary_pos_emb on HF's layout
    seqpar-torch      the ops' torch reference backend (only with --quick: an oracle, not a contender)
    variant-*         design experiments, not contenders (seqpar.bench.variants; gpu_summary's targets
                      read only seqpar-* rows): none at present. The RMSNorm backward's two (8 elements
                      per thread, 16 warps; the row loop pipelined over 2 stages) were decided by the H200's
                      times at 508368d: the first is shipped for one-row tiles, the second removed
HF and Liger take cos / sin tables, built once outside the timed region (as a model builds them once per
forward for all its layers); seqpar's kernels compute cos / sin themselves, inside the timed region.

Bandwidth counts the minimal bytes, each input read once and each output written once (E bytes per
element, N tokens; weights and per-row statistics ignored):
    rmsnorm  fwd  reads x, residual, writes y, residual_out                      4 N h E
             bwd  reads grad_y, grad_residual_out, residual_out, writes the x and residual gradients
                  (two tensors: both inputs need one)                            5 N h E
    swiglu   fwd  reads gate_up, writes y                                        3 N n E
             bwd  reads grad_y, gate_up, writes grad_gate_up                     5 N n E
    rope     fwd  reads and writes q and k                                       2 s b (Hq + Hk) d E
             bwd  the same on the gradients                                      2 s b (Hq + Hk) d E
    dropout  fwd  reads x, writes y; bwd reads grad_y, writes grad_x             2 N h E each
    bda      fwd  reads x, residual, writes y                                    3 N h E
             bwd  reads grad_y, writes grad_x (grad_residual is grad_y)          2 N h E
and is reported as GB/s and as a fraction of the device's copy bandwidth, measured by the script (a
device-to-device copy of a 1 GiB buffer). Issue target (GPU): rmsnorm and swiglu >= 0.85 of copy bandwidth,
read from the GPU time.

Timing (bench_layernorm_dropout.Timer, the same two clocks as bench_layernorm_dropout.py):
    call time  {d}_{ms,gbps,frac_copy}: one eager call, CUDA events, the L2 cache flushed before it, median
               of ``--reps`` runs after ``--warmup``; the host's launch path is inside it.
    GPU time   {d}_gpu_{ms,gbps,frac_copy}: back-to-back calls with the host ahead of the GPU
               (seqpar.bench.timing.device_time, median of ``--gpu-reps`` batches), with {d}_host_ms,
               {d}_gpu_calls, {d}_gpu_queue_full and {d}_gpu_l2_reuse beside it. No L2 flush between the
               calls and no rotation over input copies here: at the default shapes one call moves
               >= 6x the 50 MB L2, so its data comes back from DRAM; {d}_gpu_l2_reuse (bytes of one
               call / L2) says so per row, and below 2 (small custom shapes) the GPU time may be served
               from L2.
Backward is timed alone on a retained graph; random inputs. ResultRows (device, date, commit, config,
provider, metric, value) are appended to ``<out>/bench_llama_ops.csv``: the metrics above for d in fwd,
bwd, fwdbwd, and one copy_gbps row.

Usage:
    python bench/bench_llama_ops.py                          # GPU: the default sweep, rows to bench/results/
    python bench/bench_llama_ops.py --ops rmsnorm --hidden 4096 --providers seqpar-cuda,liger
    python bench/bench_llama_ops.py --quick                  # CPU smoke test (tiny, Triton interpreter)
    python bench/bench_llama_ops.py --compile-only --ops rope &   # warm Triton's and Inductor's caches
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if __name__ == "__main__" and "--quick" in sys.argv[1:]:
    # The Triton interpreter must be chosen before anything imports triton (importing seqpar does): set in
    # main() it is too late for the @triton.jit helpers the kernels call.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bench_layernorm_dropout import (  # noqa: E402
    CLOCKS, Timer, _device_name, compiled_for_one_shape, cuda_forward_plan, inductor_cache_counts, measure_copy_gbps,
    record)
from seqpar.bench.options import comma_list, fill_defaults  # noqa: E402
from seqpar.bench.results import ResultRows  # noqa: E402
from seqpar.bench.variants import applied, print_bwd_ratios  # noqa: E402

OPS = ("rmsnorm", "swiglu", "rope", "dropout", "bda")
DROPOUT_P = 0.1
PROVIDERS = ["seqpar-cuda", "seqpar-triton", "torch-eager", "torch-compile", "liger", "seqpar-torch"]


VARIANTS: dict = {}   # name -> seqpar.bench.variants.DesignVariant (see the providers above)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DIRECTIONS = ("fwd", "bwd", "fwdbwd")
EPS = 1e-6
THETA = 10000.0


# ----------------------------------------------------------------------------- problems
class Problem:
    """One configuration of one op: its inputs (leaves needing gradients first), incoming gradients,
    minimal bytes per direction, and the functions each provider times."""

    def __init__(self, op: str, config: str, leaves: List[torch.Tensor], grads: List[torch.Tensor],
                 nbytes: Dict[str, int], fns: Dict[str, Callable[[], Sequence[torch.Tensor]]]):
        self.op, self.config, self.leaves, self.grads, self.nbytes, self.fns = op, config, leaves, grads, nbytes, fns


def _hf_rms_norm(hidden, weight):
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * hidden.to(dtype)


def _eager_add_rms_norm(x, residual, weight):
    residual_out = residual + x
    return _hf_rms_norm(residual_out, weight), residual_out


def _eager_bias_dropout_add(x, bias, residual):
    return residual + F.dropout(x + bias, DROPOUT_P)


def _eager_swiglu(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _eager_rope(q, k, cos, sin):  # HF apply_rotary_pos_emb, q / k [b, H, s, d], cos / sin [b, s, d]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def _hf_cos_sin(b: int, s: int, d: int, dtype, device):
    """HF LlamaRotaryEmbedding's cos / sin [b, s, d] for positions 0 .. s-1."""
    from seqpar.ops.rotary import rope_inv_freq

    inv_freq = rope_inv_freq(d, THETA).to(device)
    freqs = torch.arange(s, device=device)[None, :, None].float().expand(b, -1, -1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _liger(name: str):
    if name == "rmsnorm":
        from liger_kernel.transformers.rms_norm import LigerRMSNorm

        return LigerRMSNorm
    if name == "swiglu":
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return LigerSiLUMulFunction
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    return liger_rotary_pos_emb


def _rnd(g: torch.Generator, *shape, dtype, device, scale=1.0, grad=False):
    return (scale * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype).requires_grad_(grad)


def make_problem(op: str, provider: str, size: Dict[str, int], dtype, device: torch.device) -> Problem:
    """Inputs and the timed function of ``provider`` on ``op``; RuntimeError when it can't run here."""
    from seqpar import ops
    from seqpar.ops import registry

    def check(op_name: str, **inputs) -> None:
        reason = registry.unavailable_reason(op_name, backend, device, dtype=dtype, **inputs) if backend else None
        if reason:
            raise RuntimeError(reason)

    g = torch.Generator().manual_seed(sum(size.values()))
    elem = torch.empty((), dtype=dtype).element_size()
    backend = provider.split("-", 1)[1] if provider.startswith("seqpar-") else None
    if provider in VARIANTS:
        VARIANTS[provider].check(op=op, **size)
        backend = "triton"
    if provider == "liger":
        if device.type != "cuda":
            raise RuntimeError("Liger-Kernel needs CUDA")
        try:
            peer = _liger(op)
        except ImportError as exc:
            raise RuntimeError(f"not importable ({exc})") from None
    if op == "rmsnorm":
        n, h = size["tokens"], size["hidden"]
        check("add_rms_norm")
        x = _rnd(g, n, h, dtype=dtype, device=device, grad=True)
        res = _rnd(g, n, h, dtype=dtype, device=device, scale=2.0, grad=True)
        w = (1 + 0.1 * torch.randn(h, generator=g)).to(device=device, dtype=dtype).requires_grad_()
        if backend:
            fn = lambda: ops.add_rms_norm(x, res, w, eps=EPS, backend=backend)  # noqa: E731
        elif provider == "torch-eager":
            fn = lambda: _eager_add_rms_norm(x, res, w)  # noqa: E731
        elif provider == "torch-compile":
            compiled = compiled_for_one_shape(_eager_add_rms_norm, device)
            fn = lambda: compiled(x, res, w)  # noqa: E731
        else:
            norm = peer(h, eps=EPS).to(device=device, dtype=dtype)
            norm.weight = torch.nn.Parameter(w.detach().clone())
            w = norm.weight

            def fn():
                residual_out = res + x
                return norm(residual_out), residual_out
        grads = [_rnd(g, n, h, dtype=dtype, device=device), _rnd(g, n, h, dtype=dtype, device=device)]
        nbytes = {"fwd": 4 * n * h * elem, "bwd": 5 * n * h * elem}
        return Problem(op, f"tokens={n},h={h}", [x, res, w], grads, nbytes | {"fwdbwd": 9 * n * h * elem},
                       {provider: fn})
    if op == "dropout":
        n, h = size["tokens"], size["hidden"]
        check("dropout", rows=n)
        x = _rnd(g, n, h, dtype=dtype, device=device, grad=True)
        if backend:
            spec = ops.DropoutSpec(DROPOUT_P, 1234)
            fn = lambda: (ops.dropout(x, spec, backend=backend),)  # noqa: E731
        elif provider == "torch-eager":
            fn = lambda: (F.dropout(x, DROPOUT_P),)  # noqa: E731
        elif provider == "torch-compile":
            compiled = compiled_for_one_shape(lambda t: F.dropout(t, DROPOUT_P), device)
            fn = lambda: (compiled(x),)  # noqa: E731
        else:
            raise RuntimeError("Liger-Kernel has no dropout")
        moved = 2 * n * h * elem
        return Problem(op, f"tokens={n},h={h}", [x], [_rnd(g, n, h, dtype=dtype, device=device)],
                       {"fwd": moved, "bwd": moved, "fwdbwd": 2 * moved}, {provider: fn})
    if op == "bda":
        n, h = size["tokens"], size["hidden"]
        check("dropout", rows=n)
        x = _rnd(g, n, h, dtype=dtype, device=device, grad=True)
        res = _rnd(g, n, h, dtype=dtype, device=device, grad=True)
        bias = _rnd(g, h, dtype=dtype, device=device, grad=True)
        if backend:
            spec = ops.DropoutSpec(DROPOUT_P, 1234)
            fn = lambda: (ops.bias_dropout_add(x, bias, res, spec, backend=backend),)  # noqa: E731
        elif provider == "torch-eager":
            fn = lambda: (_eager_bias_dropout_add(x, bias, res),)  # noqa: E731
        elif provider == "torch-compile":
            compiled = compiled_for_one_shape(_eager_bias_dropout_add, device)
            fn = lambda: (compiled(x, bias, res),)  # noqa: E731
        else:
            raise RuntimeError("Liger-Kernel has no bias-dropout-add")
        nbytes = {"fwd": 3 * n * h * elem, "bwd": 2 * n * h * elem}
        return Problem(op, f"tokens={n},h={h}", [x, bias, res], [_rnd(g, n, h, dtype=dtype, device=device)],
                       nbytes | {"fwdbwd": 5 * n * h * elem}, {provider: fn})
    if op == "swiglu":
        n, f = size["tokens"], size["ffn"]
        check("swiglu")
        gate_up = _rnd(g, n, 2 * f, dtype=dtype, device=device, scale=2.0, grad=True)
        if backend:
            fn = lambda: (ops.swiglu(gate_up, backend=backend),)  # noqa: E731
        elif provider == "torch-eager":
            fn = lambda: (_eager_swiglu(gate_up),)  # noqa: E731
        elif provider == "torch-compile":
            compiled = compiled_for_one_shape(_eager_swiglu, device)
            fn = lambda: (compiled(gate_up),)  # noqa: E731
        else:
            fn = lambda: (peer.apply(*gate_up.chunk(2, dim=-1)),)  # noqa: E731
        nbytes = {"fwd": 3 * n * f * elem, "bwd": 5 * n * f * elem, "fwdbwd": 8 * n * f * elem}
        return Problem(op, f"tokens={n},n={f}", [gate_up], [_rnd(g, n, f, dtype=dtype, device=device)], nbytes,
                       {provider: fn})
    s, b, hq, hk, d = size["seq"], size["batch"], size["heads"], size["kv_heads"], size["head_dim"]
    check("rotary_embedding", d=d)
    if backend:  # the layer's layout: q, k [s, b, H, d]
        q = _rnd(g, s, b, hq, d, dtype=dtype, device=device, grad=True)
        k = _rnd(g, s, b, hk, d, dtype=dtype, device=device, grad=True)
        fn = lambda: ops.rotary_embedding(q, k, theta=THETA, backend=backend)  # noqa: E731
    else:  # HF's layout: [b, H, s, d] with cos / sin tables built once
        q = _rnd(g, b, hq, s, d, dtype=dtype, device=device, grad=True)
        k = _rnd(g, b, hk, s, d, dtype=dtype, device=device, grad=True)
        cos, sin = _hf_cos_sin(b, s, d, dtype, device)
        if provider == "torch-eager":
            fn = lambda: _eager_rope(q, k, cos, sin)  # noqa: E731
        elif provider == "torch-compile":
            compiled = compiled_for_one_shape(_eager_rope, device)
            fn = lambda: compiled(q, k, cos, sin)  # noqa: E731
        else:
            fn = lambda: peer(q, k, cos, sin)  # noqa: E731
    grads = [torch.randn_like(q.detach()), torch.randn_like(k.detach())]
    moved = 2 * s * b * (hq + hk) * d * elem
    return Problem(op, f"s={s},b={b},hq={hq},hk={hk},d={d}", [q, k], grads,
                   {"fwd": moved, "bwd": moved, "fwdbwd": 2 * moved}, {provider: fn})


# ----------------------------------------------------------------------------- one configuration
def bench_config(op: str, provider: str, size: Dict[str, int], dtype, device: torch.device, timer: Timer,
                 copy_gbps: float, rows: ResultRows, compile_only: bool = False) -> Optional[Dict[str, float]]:
    """Times one provider on one configuration of ``op``, adds its rows and returns its times (None when
    it was skipped or failed). ``compile_only``: one untimed fwd+bwd instead (the provider's kernels
    compiled into Triton's and Inductor's on-disk caches), no rows."""
    label = ",".join(f"{k}={v}" for k, v in size.items())
    started = time.perf_counter()
    try:
        problem = make_problem(op, provider, size, dtype, device)
    except RuntimeError as exc:
        print(f"  {op:8s} {provider:14s} {label}: skipped ({exc})")
        return None
    fn = problem.fns[provider]
    config = f"op={op},{problem.config},dtype={str(dtype).replace('torch.', '')}"

    def fwdbwd():
        return torch.autograd.grad(fn(), problem.leaves, problem.grads)

    def bwd_of(outs):
        return lambda: torch.autograd.grad(outs, problem.leaves, problem.grads, retain_graph=True)

    try:
        with applied(VARIANTS, provider):
            if compile_only:
                fwdbwd()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                print(f"  {op:8s} {provider:14s} {problem.config}: compiled ({time.perf_counter() - started:.1f} s)",
                      flush=True)
                return None
            ms, gpu = {"fwd": timer(fn)}, {"fwd": timer.gpu(fn)}
            bwd = bwd_of(fn())
            ms["bwd"], gpu["bwd"] = timer(bwd), timer.gpu(bwd)
            del bwd
            ms["fwdbwd"], gpu["fwdbwd"] = timer(fwdbwd), timer.gpu(fwdbwd)
    except Exception as exc:  # a provider failing on one configuration must not stop the sweep
        print(f"  {op:8s} {provider:14s} {label}: failed ({type(exc).__name__}: {exc})")
        return None
    parts = [record(rows, config, provider, dr, ms[dr], gpu[dr], problem.nbytes[dr], copy_gbps, timer.l2, 1)
             for dr in DIRECTIONS]
    took = f"took {time.perf_counter() - started:.1f} s" + (
        f"; Inductor's caches: {inductor_cache_counts()}" if provider == "torch-compile" else "")
    print(f"  {op:8s} {provider:14s} {problem.config}: " + "  ".join(parts) + f"  ({took})", flush=True)
    return {**ms, **{f"{dr}_gpu": gpu[dr].ms for dr in DIRECTIONS}}


def _sizes(op: str, args) -> List[Dict[str, int]]:
    if op == "rmsnorm":
        return [dict(tokens=n, hidden=h) for n in args.tokens for h in args.hidden]
    if op in ("dropout", "bda"):
        return [dict(tokens=n, hidden=h) for n in args.tokens for h in args.hidden]
    if op == "swiglu":
        return [dict(tokens=n, ffn=f) for n in args.tokens for f in args.ffn]
    return [dict(seq=s, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
            for s in args.seq]


def _summary(results: Dict[Tuple[str, str], Dict[str, Dict[str, float]]]) -> None:
    print("\nfwd+bwd speed-up of the seqpar kernels over the other providers, GPU time (eager call time)")
    for (op, label), by_provider in results.items():
        for ours in ("seqpar-cuda", "seqpar-triton"):
            if ours in by_provider:
                mine = by_provider[ours]
                parts = [f"{other} {by_provider[other]['fwdbwd_gpu'] / mine['fwdbwd_gpu']:.2f}x "
                         f"({by_provider[other]['fwdbwd'] / mine['fwdbwd']:.2f}x)"
                         for other in ("torch-eager", "torch-compile", "liger") if other in by_provider]
                print(f"  {op:8s} {label:40s} {ours:14s} " + ", ".join(parts))
    print_bwd_ratios(VARIANTS, results, lambda key: f"{key[0]:8s} {key[1]:40s}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[1:]))
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {OPS}")
    ap.add_argument("--tokens", help="rmsnorm / swiglu / dropout rows (comma-separated; default 16384)")
    ap.add_argument("--hidden", help="rmsnorm / dropout hidden sizes h (comma-separated; default 4096,8192)")
    ap.add_argument("--ffn", help="swiglu widths n (gate_up has 2n; comma-separated; default 11008,14336)")
    ap.add_argument("--seq", help="rope sequence lengths s (comma-separated; default 4096)")
    ap.add_argument("--batch", type=int, help="rope batch b (default 4)")
    ap.add_argument("--heads", type=int, help="rope query heads Hq (default 32)")
    ap.add_argument("--kv-heads", type=int, help="rope key/value heads Hk (default 8)")
    ap.add_argument("--head-dim", type=int, help="rope head dim d (default 128)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--providers", help="comma-separated (default: every provider but seqpar-torch; --quick: "
                    "seqpar-triton,seqpar-torch,torch-eager)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50, help="eager call time: timed single calls")
    ap.add_argument("--gpu-reps", type=int, default=8, help="GPU time: timed batches of back-to-back calls")
    ap.add_argument("--out", default=None, help="directory (or .csv path) for rows; default bench/results "
                    "(--quick writes nothing unless --out is given)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: few runs, Triton in its interpreter, "
                    "tiny shapes for the size options not given")
    ap.add_argument("--compile-only", action="store_true",
                    help="one untimed fwd+bwd per provider and configuration, no rows: fills Triton's and "
                    "Inductor's on-disk caches (several such runs at once compile on several cores; "
                    "bench/gpu_suite.sh does so before the timed run)")
    args = ap.parse_args(argv)
    ops_list = args.ops.split(",")
    bad = [o for o in ops_list if o not in OPS]
    if bad:
        ap.error(f"unknown ops {bad}; choose from {OPS}")
    fill_defaults(args, dict(tokens="16384", hidden="4096,8192", ffn="11008,14336", seq="4096", batch=4, heads=32,
                             kv_heads=8, head_dim=128, providers=",".join(p for p in PROVIDERS if p != "seqpar-torch")),
                  dict(tokens="24", hidden="40", ffn="24", seq="6", batch=2, heads=4, kv_heads=2, head_dim=16,
                       providers="seqpar-triton,seqpar-torch,torch-eager"))
    for key in ("tokens", "hidden", "ffn", "seq"):
        setattr(args, key, comma_list(ap, f"--{key}", getattr(args, key)))
    for key in ("batch", "heads", "kv_heads", "head_dim"):
        if getattr(args, key) <= 0:
            ap.error(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    providers = [p for p in args.providers.split(",") if p]
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        ap.error(f"unknown providers {unknown}; choose from {PROVIDERS}")

    if args.quick:
        device = torch.device("cpu")
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--quick runs Triton in its interpreter: set TRITON_INTERPRET=1 before importing this module "
                     "(running it as a script with --quick does)")
        warmup, reps, copy_bytes = 1, 3, 2**22
        gpu_reps, gpu_min_calls = 2, 2
    else:
        if not torch.cuda.is_available():
            print("bench_llama_ops: needs a CUDA device (none found); run with --quick for the CPU smoke test",
                  file=sys.stderr)
            return 2
        device = torch.device("cuda")
        warmup, reps, copy_bytes = args.warmup, args.reps, 2**30
        gpu_reps, gpu_min_calls = args.gpu_reps, 4
    dtype = DTYPES[args.dtype]

    timer = Timer(device, warmup, reps, gpu_reps, gpu_min_calls)
    rows = ResultRows(_device_name(device), "bench_llama_ops")
    if args.compile_only:
        for op in ops_list:
            for size in _sizes(op, args):
                for provider in providers:
                    bench_config(op, provider, size, dtype, device, timer, 0.0, rows, compile_only=True)
        return 0
    copy_gbps = measure_copy_gbps(device, timer, copy_bytes)
    rows.add(f"bytes={copy_bytes}", "device-copy", "copy_gbps", copy_gbps)
    print(f"device: {rows.meta['device']}   commit: {rows.meta['commit']}   copy bandwidth: {copy_gbps:.1f} GB/s")
    print(CLOCKS)
    results: Dict[Tuple[str, str], Dict[str, Dict[str, float]]] = {}
    with rows.sweep():
        for op in ops_list:
            for size in _sizes(op, args):
                label = ",".join(f"{k}={v}" for k, v in size.items())
                plan = cuda_forward_plan("add_rms_norm_fwd_plan", size["hidden"], dtype, device) \
                    if op == "rmsnorm" and "seqpar-cuda" in providers else None
                if plan:
                    print(f"  {op:8s} {'seqpar-cuda':14s} {label}: forward launch: {plan}", flush=True)
                for provider in providers:
                    ms = bench_config(op, provider, size, dtype, device, timer, copy_gbps, rows)
                    if ms is not None:
                        results.setdefault((op, label), {})[provider] = ms
    _summary(results)
    return rows.finish(args.out, args.quick)


if __name__ == "__main__":
    sys.exit(main())
