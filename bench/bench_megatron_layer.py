#!/usr/bin/env python3
"""The paper's five one-layer experiments on Megatron-Core's own layer, beside seqpar's, on one GPU.

Megatron-Core (`pip install megatron-core`; carried to the GPU machine as a wheel) builds a one-layer
``TransformerBlock`` from its local (torch-only, no TransformerEngine / Apex) GPT layer spec, with tensor
parallelism 1 and world size 1, at the shape of ``python -m seqpar bench --device cuda`` (the 22B layer:
s = 2048, b = 4, h = 6144, a = 64, bf16, dropout 0.1). A block rather than a bare ``TransformerLayer``
because Megatron applies full recompute at the block level (``recompute_granularity="full"``,
``recompute_method="uniform"``, ``recompute_num_layers=1``); selective recompute is
``recompute_granularity="selective"`` (its default module list: the core attention). Megatron-Core
rejects sequence parallelism without tensor parallelism ("Cannot use sequence parallelism without tensor
parallelism"), so at t = 1 its two SP experiments are recorded as not applicable, with that reason.

Precision as Megatron's own training loop sets it: ``params_dtype`` makes its linear layers bf16, but the
local spec's LayerNorm (``WrappedTorchNorm``: a plain ``torch.nn.LayerNorm``) ignores it and stays fp32,
which CUDA's layer_norm refuses beside a bf16 input; Megatron-LM wraps every bf16 / fp16 model in
``Float16Module``, which casts the whole module. So does this script (with ``fp32_output=False``: the
fp32 copy of the output is for the loss, which a one-layer benchmark has not).

Per experiment: forward and backward ms (CUDA events, median of ``--iters`` after ``--warmup``), the
activation bytes the layer keeps (:class:`seqpar.memory.ActivationMeter`: saved-tensor hooks see what
Megatron's autograd functions and checkpoints save, parameters excluded) and the peak memory of one
forward + backward above the parameters. Rows go to ``<out>/bench_megatron_layer.csv`` (device, date,
commit, config, provider, metric, value), provider ``megatron-core-<version>``, next to the rows of
``python -m seqpar bench --json`` for the same shape.

    python bench/bench_megatron_layer.py --out DIR          # on the GPU machine
    python bench/bench_megatron_layer.py --dry-run          # CPU: build the five configurations only
                                                            # (and check their parameters' dtypes)
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from seqpar.bench.layer_bench import EXPERIMENTS  # noqa: E402
from seqpar.bench.results import ResultRows  # noqa: E402
from seqpar.bench.timing import median_ms  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def megatron_config(args, sequence_parallel: bool, recompute: str):
    """Megatron-Core's TransformerConfig for one experiment (raises ValueError where it refuses one)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    granularity = {"none": {}, "selective": dict(recompute_granularity="selective"),
                   "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)}
    return TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=args.heads, ffn_hidden_size=4 * args.hidden,
        hidden_dropout=args.dropout, attention_dropout=args.dropout, layernorm_epsilon=1e-5,
        tensor_model_parallel_size=1, sequence_parallel=sequence_parallel, params_dtype=DTYPES[args.dtype],
        bf16=args.dtype == "bf16", fp16=args.dtype == "fp16", use_cpu_initialization=args.dry_run,
        # The paper's layer: GeLU MLP with biases, pre-LayerNorm, causal self-attention.
        add_bias_linear=True, gated_linear_unit=False, normalization="LayerNorm",
        **granularity[recompute])


def build_block(config):
    """The one-layer block, in Megatron's ``Float16Module`` for bf16 / fp16 (see the module docstring)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_block import TransformerBlock

    block = TransformerBlock(config, get_gpt_layer_local_spec(), post_layer_norm=False)
    return Float16Module(config, block) if config.bf16 or config.fp16 else block


def block_forward(block, x: torch.Tensor) -> torch.Tensor:
    """One forward of :func:`build_block`'s module: [s, b, h] -> [s, b, h], in ``x``'s dtype."""
    from megatron.core.transformer.module import Float16Module

    kwargs = dict(fp32_output=False) if isinstance(block, Float16Module) else {}
    return block(x, attention_mask=None, **kwargs)


def parameter_dtypes(block) -> set:
    """The dtypes of the block's parameters and floating-point buffers: one, the run's, or the layer
    mixes precisions (the first GPU run's "expected scalar type BFloat16 but found Float")."""
    tensors = list(block.parameters()) + [b for b in block.buffers() if b.is_floating_point()]
    return {t.dtype for t in tensors}


def init_megatron(device_type: str) -> str:
    """World size 1, TP = PP = 1; returns Megatron-Core's version."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=0, world_size=1)
    import megatron.core
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():  # a second call (tests) keeps the first groups
        parallel_state.initialize_model_parallel(1, 1)
    if device_type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    return getattr(megatron.core, "__version__", "unknown")


def measure(block, x: torch.Tensor, grad_y: torch.Tensor, args) -> dict:
    """One experiment's metrics: forward / backward ms, the activation bytes the layer keeps and, on a GPU,
    the peak memory of one forward + backward above what is allocated before it (the CUDA caching
    allocator's counters; tests run the rest on CPU)."""
    from seqpar.memory import ActivationMeter

    def forward():
        return block_forward(block, x)

    def forward_backward():
        forward().backward(grad_y)

    fwd_ms = median_ms(forward, x.device, args.warmup, args.iters)
    fwdbwd_ms = median_ms(forward_backward, x.device, args.warmup, args.iters)
    with ActivationMeter() as meter:
        y = forward()
    del y
    metrics = {"forward_ms": fwd_ms, "backward_ms": fwdbwd_ms - fwd_ms, "combined_ms": fwdbwd_ms,
               "activation_bytes": float(meter.bytes)}
    if x.is_cuda:
        torch.cuda.synchronize()
        params = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        forward_backward()
        torch.cuda.synchronize()
        metrics["peak_bytes_above_params"] = float(torch.cuda.max_memory_allocated() - params)
    return metrics


def run(args) -> ResultRows:
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    version = init_megatron(device.type)
    provider = f"megatron-core-{version}"
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (dry run)"
    rows = ResultRows(name, "bench_megatron_layer")
    s, b, h = args.seq_len, args.batch, args.hidden
    dtype = DTYPES[args.dtype]
    shape = f"s{s} b{b} h{h} a{args.heads} t1 {args.dtype} p{args.dropout}"
    with rows.sweep():
        for experiment, sp, recompute in EXPERIMENTS:
            config_name = f"{shape} {experiment}"
            try:
                config = megatron_config(args, sp, recompute)
            except ValueError as exc:  # e.g. SP without TP
                print(f"{experiment}: not applicable on Megatron-Core: {exc}", flush=True)
                rows.add(config_name, provider, "not_applicable", str(exc))
                continue
            block = build_block(config).to(device)
            dtypes = parameter_dtypes(block)
            if dtypes != {dtype}:
                raise RuntimeError(f"{experiment}: Megatron's layer has parameters in {sorted(map(str, dtypes))}, "
                                   f"its input is {dtype}")
            if args.dry_run:
                print(f"{experiment}: built ({sum(p.numel() for p in block.parameters()):,} parameters, "
                      f"{dtype})", flush=True)
                continue
            block.train()
            x = torch.randn(s, b, h, device=device, dtype=dtype, requires_grad=True)
            metrics = measure(block, x, torch.randn_like(x), args)
            del block, x  # before the next experiment's block is built
            for metric, value in metrics.items():
                rows.add(config_name, provider, metric, value)
            print(f"{experiment}: fwd {metrics['forward_ms']:.2f} ms, bwd {metrics['backward_ms']:.2f} ms, "
                  f"{metrics['activation_bytes'] / 2**20:.1f} MiB saved, "
                  f"peak {metrics['peak_bytes_above_params'] / 2**20:.1f} MiB", flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--dry-run", action="store_true", help="CPU: build the five configurations, run nothing")
    args = p.parse_args(argv)
    try:
        importlib.import_module("megatron.core")
    except ImportError as exc:
        p.exit(2, f"bench_megatron_layer: megatron-core is not importable ({exc}); pip install megatron-core "
                  "(on the GPU machine: carry its wheel, see bench/gpu_suite.sh)\n")
    if not args.dry_run and not torch.cuda.is_available():
        p.exit(2, "bench_megatron_layer: needs a CUDA device (or --dry-run)\n")
    warnings.filterwarnings("ignore", message="Apex is not installed")
    rows = run(args)
    if not args.dry_run:
        print(f"wrote {rows.write(args.out)}")
    if rows.exit_status():
        sys.exit(rows.exit_status())


if __name__ == "__main__":
    main()
