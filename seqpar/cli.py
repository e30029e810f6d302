"""Command line: ``python -m seqpar info | bench | plan`` (``bench`` is also the ``seqpar-bench`` script).

A usage error prints one line on stderr and exits with status 2 (argparse's convention); a run stopped
by bad input (a ValueError) prints one line and exits with status 1. A reader that closes stdout
(``python -m seqpar plan ... | head -1``) ends the command quietly with status 1.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import re
import sys
from typing import Callable, List, Optional, Sequence, Tuple

#: Bytes per GiB (the memory options and reports).
GIB = 2 ** 30
#: The paper's runs (Table 3): ``plan``'s default sequence length and vocabulary (a preset may set its own).
SEQ_LEN, VOCAB = 2048, 51200
#: The paper's Table 3 (t = 8 throughout): heads, hidden, layers, pipeline-parallel size, micro-batch.
PAPER_MODELS = {"22B": dict(heads=64, hidden=6144, layers=48, pp=1, micro_batch=4),
                "175B": dict(heads=96, hidden=12288, layers=96, pp=8, micro_batch=1),
                "530B": dict(heads=128, hidden=20480, layers=105, pp=35, micro_batch=1),
                "1T": dict(heads=160, hidden=25600, layers=128, pp=64, micro_batch=1)}
#: The Llama family (t = 8 by default): Llama 3's and Qwen3-32B's published sizes (Qwen3's heads 128 wide,
#: a d = 8192 with h = 5120, and its q / k norms), s = 8192, and a pipeline split that fits 80 GB.
LLAMA_MODELS = {"llama3-8B": dict(heads=32, kv_heads=8, hidden=4096, ffn_hidden=14336, layers=32, vocab=128256,
                                  seq_len=8192, pp=1, micro_batch=1),
                "llama3-70B": dict(heads=64, kv_heads=8, hidden=8192, ffn_hidden=28672, layers=80, vocab=128256,
                                   seq_len=8192, pp=4, micro_batch=1),
                "qwen3-32B": dict(heads=64, kv_heads=8, kv_channels=128, qk_norm=True, hidden=5120, ffn_hidden=25600,
                                  layers=64, vocab=151936, seq_len=8192, pp=2, micro_batch=1)}
#: The block of each --arch: TransformerConfig's knobs (as the memory functions name them). llama: no
#: dropout, no biases, RoPE (no position table), an untied output layer.
ARCH_BLOCKS = {"gpt": dict(),
               "llama": dict(normalization="rmsnorm", activation="swiglu", hidden_dropout=False,
                             attention_dropout=False)}
#: The parameter-count knobs of each --arch (:func:`seqpar.memory.first_stage_parameters`'s keywords).
ARCH_PARAMETERS = {"gpt": dict(),
                   "llama": dict(normalization="rmsnorm", activation="swiglu", add_bias_linear=False,
                                 position_embedding="rope", share_embeddings_and_output_weights=False)}


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, ``prog: error: message``, with exit status 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        """Exit with status 2 after one line on stderr: ``prog: error: message (see prog --help)``."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def run_reporting_errors(prog: str, fn: Callable[[], object]) -> None:
    """Run ``fn``; a ValueError (bad input found while running) becomes one line on stderr, status 1."""
    try:
        fn()
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


def _plot_problem(path: str) -> Optional[str]:
    """Why ``--plot path`` can't be drawn (None when it can): no matplotlib, or a file type it does not
    write (without an extension it would write ``path.png`` while the command said ``path``)."""
    try:
        import matplotlib.backend_bases   # (imports matplotlib itself first, even once the submodule is loaded)
    except ImportError:
        return "--plot needs matplotlib: pip install 'seqpar[plot]' (or pip install matplotlib)"
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    formats = matplotlib.backend_bases.FigureCanvasBase.get_supported_filetypes()
    if extension not in formats:
        got = f"extension .{extension}" if extension else "no extension"
        return f"--plot {path}: {got}; give a file name ending in one of .{', .'.join(sorted(formats))} (.png)"
    return None


def _unwritable(path: str) -> Optional[str]:
    """Why ``path`` can't be written (None when it can), found by opening it for appending (a new file is
    removed again): permission bits alone pass root, read-only file systems and /proc."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a directory"
    if not os.path.isdir(folder):
        return f"its folder {folder} does not exist"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        return f"can't be written ({exc.strerror or exc})"
    if not existed:
        os.remove(path)
    return None


def check_rope_head_dim(parser: argparse.ArgumentParser, hidden: int, heads: int, kv_channels: Optional[int]) -> None:
    """``parser.error`` (one line, status 2) for the Llama block's RoPE with an odd head dim (``--kv-channels``,
    or ``--hidden / --heads``), which TransformerConfig refuses: checked at parsing, not after the run
    started (plan printed a plan for such a layer)."""
    head_dim = kv_channels if kv_channels is not None else hidden // heads if hidden % heads == 0 else None
    if head_dim is not None and head_dim % 2:
        given = f"--kv-channels {head_dim}" if kv_channels is not None else f"--hidden / --heads = {head_dim}"
        parser.error(f"{given}: the Llama block's RoPE needs an even head dim")


def check_output_paths(parser: argparse.ArgumentParser, args: argparse.Namespace, *options: str) -> None:
    """``parser.error`` (one line, status 2) for an ``--option PATH`` the command could not write, or for
    ``--plot`` one it could not draw, checked at parsing: otherwise it would fail only when writing, after
    the whole run."""
    for option in options:
        path = getattr(args, option)
        if path is None:
            continue
        if not path:
            parser.error(f"--{option}: an empty path")
        problem = _plot_problem(path) if option == "plot" else None
        if problem:
            parser.error(problem)
        problem = _unwritable(path)
        if problem:
            parser.error(f"--{option} {path}: {problem}")


# ---------------------------------------------------------------------------------------------- info
def info() -> None:
    """Print versions, whether the CUDA extension is built (and why not), and the usable backends per op."""
    import torch

    import seqpar
    from seqpar import _ext
    from seqpar.ops import registry

    print(f"seqpar {seqpar.__version__}  python {platform.python_version()}  torch {torch.__version__}")
    try:
        import triton
        print(f"triton {triton.__version__}  (TRITON_INTERPRET={'1' if _ext.triton_interpreter_enabled() else '0'})")
    except Exception as exc:  # noqa: BLE001 - report, don't fail
        print(f"triton: not importable ({exc})")
    cuda = torch.cuda.is_available()
    print(f"CUDA device: {torch.cuda.get_device_name(0) if cuda else 'none'}")
    reason = _ext.cuda_extension_error()
    print("CUDA extension seqpar._C: " + ("built" if reason is None else f"not available: {reason}"))
    try:
        forced = registry.requested_backend(None)
    except ValueError as exc:
        forced = "auto"
        print(f"{exc}: every op called with backend=\"auto\" (the default) raises this")
    if forced != "auto":
        print(f"SEQPAR_BACKEND={forced}: every op called with backend=\"auto\" (the default) runs {forced}, "
              "or raises where it can't; the auto choices below are what runs without it")
    for device in ["cpu"] + (["cuda"] if cuda else []):
        print(f'backends on {device}: what backend="auto" picks, why it skips the ones before it, what an '
              'explicit backend= can run, and the inputs a backend turns away (auto then falls back):')
        explicit = registry.backend_report(torch.device(device))
        for op, choice in registry.auto_report(torch.device(device)).items():
            order = ", ".join(registry.auto_order(op))
            print(f"  {op:<30} auto -> {choice.picked}   (tries {order})")
            for name, why in choice.skipped.items():
                usable = "; explicit backend= runs it" if explicit[op][name] is None else ""
                print(f"  {'':<30}   {name:<6} skipped by auto: {why}{usable}")
            for name in registry.BACKENDS:
                if name not in choice.skipped and name != choice.picked and explicit[op][name] is not None:
                    print(f"  {'':<30}   {name:<6} not usable: {explicit[op][name]}")
            for name, limits in choice.limits.items():
                print(f"  {'':<30}   {name:<6} limits: {limits}")


# ---------------------------------------------------------------------------------------------- plan
#: The description ``python -m seqpar plan --help`` prints.
PLAN_DESCRIPTION = """\
Activation memory of the most loaded pipeline stage per GPU for every uniform recompute policy (the paper's
Figure 7 comparison, as % of tensor parallelism alone), and the per-layer mix of none / selective /
full recompute with the least extra forward FLOPs that fits the GPU (seqpar.memory.plan_recompute).

Activation budget = GPU memory - 18 bytes per parameter of the stage - --other-gib, where 18 bytes is
mixed-precision Adam: bf16 weight 2 + fp32 gradient 4 + fp32 master weight 4 + Adam moments 4 + 4, and
the stage's parameters per GPU are its L/p layers' (12h^2 + 13h each for GPT at f = 4h, the matrices
split t ways) plus the word (v/t x h, v padded to a multiple of 128 t) and position (s x h) embeddings
(seqpar.memory.first_stage_parameters). The last stage holds about as many: its output layer (or the
tied embedding's copy) is the word embedding's size.

--arch llama (or a llama3-* / qwen3-* --model) plans the Llama block: RMSNorm, SwiGLU, grouped-query
attention with --kv-heads groups of --kv-channels wide heads (and with --qk-norm Qwen3's per-head q / k
norms), RoPE, no biases, no dropout, untied output layer. --flash-attention counts a
flash-style attention core (seqpar's triton backend: o and the fp32 log-sum-exp, nothing s^2-sized),
under which selective recompute saves nothing.
"""


def _plan_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m seqpar plan", description=PLAN_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=tuple(PAPER_MODELS) + tuple(LLAMA_MODELS),
                   help="a model of the paper's Table 3 (s=2048, v=51200, t=8) or a Llama 3 / Qwen3 (s=8192, t=8); "
                        "other options override it")
    p.add_argument("--arch", choices=tuple(ARCH_BLOCKS),
                   help="the block: gpt (the paper's, default) or llama (default with a llama3-* / qwen3-* --model)")
    p.add_argument("--kv-heads", type=int, help="llama: k/v groups g (default: one per head, or the model's)")
    p.add_argument("--kv-channels", type=int,
                   help="llama: the head dim d (default: hidden / heads, or the model's; Qwen3's 128)")
    p.add_argument("--qk-norm", action="store_true", default=None,
                   help="llama: per-head q / k norms (Qwen3's; default with qwen3-32B)")
    p.add_argument("--flash-attention", action="store_true",
                   help="a flash-style attention core (seqpar's triton backend): no s^2 activations")
    p.add_argument("--hidden", type=int, help="hidden size h")
    p.add_argument("--heads", type=int, help="attention heads a")
    p.add_argument("--layers", type=int, help="layers L")
    p.add_argument("--ffn-hidden", type=int, help="ffn size (default 4h, or the model's)")
    p.add_argument("--seq-len", type=int, help=f"sequence length s (default {SEQ_LEN}, or the model's)")
    p.add_argument("--vocab", type=int, help=f"vocabulary v (default {VOCAB}, or the model's)")
    p.add_argument("--micro-batch", type=int, help="micro-batch b (default 1, or the model's)")
    p.add_argument("--tp", type=int, help="tensor-parallel size t (default 1, 8 with --model)")
    p.add_argument("--pp", type=int, help="pipeline-parallel size p (default 1, or the model's)")
    p.add_argument("--sp", action="store_true", help="plan with sequence parallelism")
    p.add_argument("--gpu-memory", type=float, default=80.0, metavar="GIB",
                   help="GPU memory in GiB (default 80, the paper's A100 80GB)")
    p.add_argument("--other-gib", type=float, default=0.0, metavar="GIB",
                   help="headroom for everything else (workspace, fragmentation, communication buffers)")
    p.add_argument("--bytes-per-element", type=float, default=2.0, help="activation bytes (default 2: bf16)")
    p.add_argument("--bytes-per-mask", type=float, default=1.0,
                   help="dropout-mask bytes (default 1 as in the paper; 0 where masks are regenerated, as in seqpar)")
    p.add_argument("--plot", metavar="PATH", help="draw both as a PNG (needs matplotlib: the 'plot' extra)")
    return p


def _plan_args(argv: Sequence[str]) -> argparse.Namespace:
    p = _plan_parser()
    args = p.parse_args(argv)
    preset = PAPER_MODELS.get(args.model) or LLAMA_MODELS.get(args.model) or {}
    preset_arch = None if args.model is None else "llama" if args.model in LLAMA_MODELS else "gpt"
    if args.arch is not None and preset_arch is not None and args.arch != preset_arch:
        p.error(f"--model {args.model} is a {preset_arch} model, not --arch {args.arch}")
    args.arch = args.arch or preset_arch or "gpt"
    for option, key in (("--kv-heads", "kv_heads"), ("--kv-channels", "kv_channels"), ("--qk-norm", "qk_norm")):
        if args.arch != "llama" and getattr(args, key) is not None:
            p.error(f"{option} is for --arch llama (the gpt layer is the paper's: heads h / a wide, no q / k norms)")
    for key, default in (("hidden", None), ("heads", None), ("layers", None), ("seq_len", SEQ_LEN),
                         ("vocab", VOCAB), ("micro_batch", 1), ("tp", 8 if preset else 1), ("pp", 1),
                         ("kv_heads", None), ("ffn_hidden", None), ("kv_channels", None), ("qk_norm", False)):
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, default))
    missing = [f"--{k}" for k in ("hidden", "heads", "layers") if getattr(args, k) is None]
    if missing:
        p.error(f"give --model or {', '.join(missing)}")
    for key in ("hidden", "heads", "layers", "ffn_hidden", "seq_len", "vocab", "micro_batch", "tp", "pp", "kv_heads",
                "kv_channels"):
        value = getattr(args, key)
        if value is not None and value <= 0:
            p.error(f"--{key.replace('_', '-')} must be positive, got {value}")
    for key, scale in (("gpu_memory", GIB), ("bytes_per_element", 1)):   # float options: inf and nan parse too
        if not (math.isfinite(getattr(args, key) * scale) and getattr(args, key) > 0):   # GiB: finite in bytes
            p.error(f"--{key.replace('_', '-')} must be finite and positive, got {getattr(args, key)}")
    for key, scale in (("other_gib", GIB), ("bytes_per_mask", 1)):
        if not (math.isfinite(getattr(args, key) * scale) and getattr(args, key) >= 0):
            p.error(f"--{key.replace('_', '-')} must be finite and non-negative, got {getattr(args, key)}")
    if args.arch == "llama":
        check_rope_head_dim(p, args.hidden, args.heads, args.kv_channels)
    check_output_paths(p, args, "plot")
    try:  # the sizes themselves (tp dividing heads, pp dividing layers, ...): usage errors too
        _sizes(args)
    except ValueError as exc:
        p.error(_as_options(str(exc)))
    return args


#: seqpar.memory's argument names -> the plan options that set them (its messages name the arguments).
_PLAN_OPTIONS = {"num_layers": "--layers", "num_query_groups": "--kv-heads", "ffn_hidden": "--ffn-hidden",
                 "kv_channels": "--kv-channels",
                 "seq_len": "--seq-len", "micro_batch": "--micro-batch", "hidden": "--hidden", "heads": "--heads",
                 "vocab": "--vocab", "tp": "--tp", "pp": "--pp"}


def _as_options(message: str) -> str:
    """``message`` with each argument name followed by its value ("num_layers 3") named as its option
    ("--layers 3")."""
    pattern = r"\b(" + "|".join(_PLAN_OPTIONS) + r") (?=-?\d)"
    return re.sub(pattern, lambda m: _PLAN_OPTIONS[m.group(1)] + " ", message)


def _sizes(args: argparse.Namespace) -> Tuple[dict, dict]:
    """(positional sizes, keyword options) of the seqpar.memory activation functions; validates them and
    the parameter count (:func:`_stage_parameters`)."""
    from seqpar.memory import model_activation_bytes

    sizes = dict(seq_len=args.seq_len, micro_batch=args.micro_batch, hidden=args.hidden, heads=args.heads,
                 num_layers=args.layers, vocab=args.vocab)
    options = dict(tp=args.tp, pp=args.pp, ffn_hidden=args.ffn_hidden, bytes_per_element=args.bytes_per_element,
                   bytes_per_mask=args.bytes_per_mask, num_query_groups=args.kv_heads,
                   kv_channels=args.kv_channels, qk_layernorm=args.qk_norm,
                   flash_attention=args.flash_attention, **ARCH_BLOCKS[args.arch])
    model_activation_bytes(**sizes, sequence_parallel=args.sp, **options)
    _stage_parameters(args)
    return sizes, options


def _stage_parameters(args: argparse.Namespace) -> int:
    """Parameters per GPU of the first stage (seqpar.memory.first_stage_parameters) for this --arch."""
    from seqpar.memory import first_stage_parameters

    return first_stage_parameters(args.hidden, args.layers, args.vocab, args.seq_len, tp=args.tp, pp=args.pp,
                                  ffn_hidden=args.ffn_hidden, heads=args.heads, num_query_groups=args.kv_heads,
                                  kv_channels=args.kv_channels, qk_layernorm=args.qk_norm,
                                  **ARCH_PARAMETERS[args.arch])


def _size(n: float) -> str:
    """Bytes in GiB, MiB or KiB."""
    for unit, scale in (("GiB", GIB), ("MiB", 2 ** 20)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2 ** 10:.1f} KiB"


def _layer_runs(policies: Sequence[str]) -> str:
    """("full", "full", "none") -> "layers 0-1 full, 2 none"."""
    runs, start = [], 0
    for i in range(1, len(policies) + 1):
        if i == len(policies) or policies[i] != policies[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            runs.append(f"{span} {policies[start]}")
            start = i
    return "layers " + ", ".join(runs)


#: The uniform configurations of the paper's Figure 7 (and full recompute): (name, SP, policy).
UNIFORM = [("tensor parallel (baseline)", False, "none"), ("tensor + sequence parallel", True, "none"),
           ("tensor parallel + selective", False, "selective"),
           ("tensor + sequence parallel + selective", True, "selective"),
           ("full recompute", False, "full"), ("full recompute + sequence parallel", True, "full")]


def plan(argv: Sequence[str]) -> dict:
    """``python -m seqpar plan``: print (and with --plot draw) the uniform policies and the planned mix."""
    from seqpar.memory import MODEL_STATE_BYTES_PER_PARAMETER, evaluate_recompute, plan_recompute

    args = _plan_args(argv)
    sizes, options = _sizes(args)
    n_stage = args.layers // args.pp
    params = _stage_parameters(args)
    state_bytes = MODEL_STATE_BYTES_PER_PARAMETER * params
    gpu_bytes, other_bytes = args.gpu_memory * GIB, args.other_gib * GIB
    budget = gpu_bytes - state_bytes - other_bytes
    name = args.model or "custom"
    heads_of = "" if args.kv_channels is None else f", d={args.kv_channels}"
    block = (f"llama block (g={args.kv_heads or args.heads}{heads_of}, f={args.ffn_hidden or 4 * args.hidden}"
             f"{', q/k norms' if args.qk_norm else ''}, no dropout)"
             if args.arch == "llama" else f"gpt block, {args.bytes_per_mask:g}-byte masks")
    print(f"seqpar plan: {name} model, s={args.seq_len} b={args.micro_batch} h={args.hidden} a={args.heads} "
          f"L={args.layers} v={args.vocab}, t={args.tp} p={args.pp} ({n_stage} layers per stage), "
          f"{args.bytes_per_element:g}-byte activations, {block}"
          + (", flash-style attention core" if args.flash_attention else ""))
    print(f"first stage per GPU: {params:,} parameters x {MODEL_STATE_BYTES_PER_PARAMETER} bytes "
          f"(bf16 weight 2 + fp32 grad 4 + fp32 master 4 + Adam 4 + 4) = {_size(state_bytes)}")
    print(f"activation budget: {args.gpu_memory:g} GiB GPU - {_size(state_bytes)} model state - "
          f"{args.other_gib:g} GiB other = {_size(budget)}")
    # sequence parallelism needs t to divide s: without --sp, an s it doesn't divide leaves out SP's rows
    sp_possible = args.seq_len % args.tp == 0
    uniform = [(label, sp, policy, evaluate_recompute(policy, **sizes, sequence_parallel=sp, **options))
               for label, sp, policy in UNIFORM if sp_possible or not sp]
    baseline = uniform[0][3].activation_bytes
    loss_working = uniform[0][3].loss_working_bytes
    print("\nuniform policies, most loaded stage per GPU (the paper's Figure 7: % of tensor parallelism alone;"
          "\n'fits': with what one recomputed layer rebuilds in its backward, or what the loss's backward builds"
          f"\non the last stage beside its saved softmax, {_size(loss_working)}, whichever is larger):")
    if not sp_possible:
        print(f"  (no sequence-parallel rows: t={args.tp} does not divide s={args.seq_len})")
    print(f"  {'configuration':<40}{'activations':>13}{'% of TP':>9}{'extra FLOPs':>13}{'rebuilt':>11}{'fits':>6}")
    for label, _, _, cost in uniform:
        rebuilt = _size(cost.recompute_working_bytes) if cost.recompute_working_bytes else "-"
        print(f"  {label:<40}{_size(cost.activation_bytes):>13}{100 * cost.activation_bytes / baseline:>8.0f}%"
              f"{100 * cost.extra_fraction:>12.2f}%{rebuilt:>11}{'yes' if cost.peak_bytes <= budget else 'no':>6}")
    result = dict(args=args, sizes=sizes, options=options, budget=budget, state_bytes=state_bytes, uniform=uniform,
                  plan=None, error=None)
    sp_name = "with" if args.sp else "without"
    if budget <= 0:
        result["error"] = (f"the model state alone ({_size(state_bytes)}) leaves no room for activations "
                           f"in {args.gpu_memory:g} GiB" if state_bytes >= gpu_bytes else
                           f"--other-gib {args.other_gib:g} GiB leaves no room for activations in {args.gpu_memory:g} "
                           f"GiB beside the model state ({_size(state_bytes)})")
    else:
        floor = evaluate_recompute("full", **sizes, sequence_parallel=args.sp, **options).peak_bytes
        if floor > budget:
            hint = ""
            if not args.sp and sp_possible:
                sp_floor = evaluate_recompute("full", **sizes, sequence_parallel=True, **options).peak_bytes
                hint = f"; with --sp it needs {_size(sp_floor)}" + (", which fits" if sp_floor <= budget else "")
            result["error"] = (f"even full recompute of every layer needs {_size(floor)} of activations at its peak, "
                               f"over the {_size(budget)} budget{hint}")
        else:
            result["plan"] = plan_recompute(**sizes, budget_bytes=budget, sequence_parallel=args.sp,
                                            include_working_set=True, **options)
    best = result["plan"]
    if best is None:
        print(f"\nno plan {sp_name} sequence parallelism: {result['error']}")
    else:
        counts = best.counts
        print(f"\nplanned mix {sp_name} sequence parallelism (least extra forward FLOPs that fits):")
        # What sets the peak: the most loaded stage with a recomputed layer's rebuild, or the last stage
        # with the loss backward's working set (named only where it reaches the peak)
        last = best.activation_bytes if best.last_stage_activation_bytes is None else best.last_stage_activation_bytes
        on_top = ([f"+ {_size(best.recompute_working_bytes)} rebuilt in a recomputed backward"]
                  if best.recompute_working_bytes else [])
        if last + best.loss_working_bytes >= best.peak_bytes:
            on_top.append(f"+ {_size(best.loss_working_bytes)} in the loss's backward" +
                          ("" if last == best.activation_bytes else f" on the last stage's {_size(last)}"))
        rebuilt = f" ({_size(best.peak_bytes)} at the peak: {', or '.join(on_top)})" if on_top else ""
        print(f"  per stage: {counts['none']} x none, {counts['selective']} x selective, {counts['full']} x full "
              f"-> {_size(best.activation_bytes)}{rebuilt} of {_size(budget)}")
        print(f"  extra compute: {best.extra_flops:.4g} forward FLOPs per micro-batch per GPU, "
              f"{100 * best.extra_fraction:.2f}% of the stage's model FLOPs")
        print(f"  policies of {'each' if args.pp > 1 else 'the'} stage: {_layer_runs(best.policies)}")
    if args.plot:
        from .bench.plots import plot_plan
        plot_plan(result, args.plot)
        print(f"wrote {args.plot}")
    if best is None:
        raise SystemExit(1)
    return result


# ---------------------------------------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> None:
    """``python -m seqpar``: run the ``info``, ``bench`` or ``plan`` command of ``argv`` (default
    ``sys.argv[1:]``; a command is required); see the module docstring for exit statuses."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(prog="python -m seqpar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, CUDA extension status, usable backends per op")
    sub.add_parser("bench", help="the paper's five layer experiments (python -m seqpar bench --help)", add_help=False)
    sub.add_parser("plan", help="whole-model activation memory and the cheapest recompute that fits "
                                "(python -m seqpar plan --help)", add_help=False)
    if argv and argv[0] == "bench":
        bench(argv[1:])
    elif argv and argv[0] == "plan":
        quiet_on_broken_pipe(lambda: run_reporting_errors("python -m seqpar plan", lambda: plan(argv[1:])))
    else:
        parser.parse_args(argv)
        quiet_on_broken_pipe(info)


def quiet_on_broken_pipe(fn: Callable[[], object]) -> None:
    """Run ``fn``; when the reader of stdout goes away (``python -m seqpar info | head -3``) stop quietly
    with status 1, as coreutils do. stdout goes to devnull, so the interpreter's flush at exit (or a
    spawned rank's) does not raise again."""
    try:
        fn()
    except BrokenPipeError:
        stdout_to_devnull()
        raise SystemExit(1) from None


def stdout_to_devnull() -> None:
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def bench(argv: Sequence[str]) -> None:
    """``python -m seqpar bench`` / ``seqpar-bench``."""
    from .bench.layer_bench import main as bench_main

    quiet_on_broken_pipe(lambda: run_reporting_errors("python -m seqpar bench", lambda: bench_main(list(argv))))


def bench_main() -> None:
    """Entry point of the ``seqpar-bench`` console script."""
    bench(sys.argv[1:])
