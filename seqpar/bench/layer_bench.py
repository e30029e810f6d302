"""The paper's layer experiments (its Table 4 and Figure 8, one layer of the 22B model): no recompute, sequence
parallel, full recompute, selective recompute, selective + sequence parallel.

Each experiment builds one TransformerLayer with tensor parallelism over the ranks, times forward and
backward (median of ``--iters`` after ``--warmup``; CUDA events on GPU, wall clock between barriers on
CPU), measures the activation bytes one rank keeps (:class:`seqpar.memory.ActivationMeter`) and
compares them with Table 2 (:func:`seqpar.memory.layer_activation_bytes`).

``--arch llama`` runs the same five experiments on a Llama block (RMSNorm, SwiGLU, grouped-query
attention with ``--kv-heads`` groups, RoPE, no biases, no dropout: selective recompute is the attention
core's recompute only; ``--kv-channels`` and ``--qk-norm`` make it Qwen3's: heads of that width and per-head
q / k norms) and compares with the generalised formula for that block (flash-style when the
attention backend is, e.g. triton on a GPU). Default sizes: a Llama 3 8B layer on cuda (h 4096, 32
heads, 8 k/v groups, ffn 14336, RoPE base 500000), a small one on cpu.

Without torchrun the command spawns ``--tp`` gloo ranks on CPU itself (default 2); under torchrun it
uses the launched ranks (NCCL with ``--device cuda``). ``--json`` is rewritten after every experiment
(``"complete": false`` until all five are in). Ctrl-C or SIGTERM stops a run (its spawned ranks too)
with exit status 130 / 143, the JSON keeping the experiments measured.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import functools
import os
import queue as queue_module
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional

from .options import PROBABILITY_RANGE, probability
from .results import git_commit

#: The runs of the paper's Table 4: (name, sequence_parallel, recompute).
EXPERIMENTS = [
    ("no recompute", False, "none"),
    ("sequence parallel", True, "none"),
    ("full recompute", False, "full"),
    ("selective recompute", False, "selective"),
    ("selective + sequence parallel", True, "selective"),
]


def program_name() -> str:
    """How the bench was started: ``seqpar-bench`` (the console script) or ``python -m seqpar bench``."""
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return "seqpar-bench" if os.path.splitext(script)[0] == "seqpar-bench" else "python -m seqpar bench"


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    """The bench's options; a usage error (bad value, unknown or unusable backend, no CUDA device for
    ``--device cuda``, no matplotlib for ``--plot``, a ``--json`` / ``--plot`` path that can't be
    written) is one line on stderr and exit status 2."""
    from ..cli import ArgumentParser, check_output_paths, check_rope_head_dim
    from ..ops.registry import BACKEND_CHOICES

    p = ArgumentParser(prog=program_name(), description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--arch", choices=tuple(ARCHS), default="gpt",
                   help="gpt: the paper's layer (default); llama: RMSNorm, SwiGLU, GQA, RoPE, no biases, no dropout")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 2 on cpu, 1 on cuda)")
    p.add_argument("--seq-len", type=int, default=None, help="default 256 (cpu) / 2048 (cuda)")
    p.add_argument("--hidden", type=int, default=None, help="default 128 (cpu) / 6144 (cuda: the 22B layer)")
    p.add_argument("--heads", type=int, default=None, help="default 4 (cpu) / 64 (cuda); llama: 8 / 32")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="llama: k/v groups (default 2 (cpu) / 8 (cuda)); gpt: one per head")
    p.add_argument("--kv-channels", type=int, default=None,
                   help="llama: the head dim (default hidden / heads; Qwen3's 128)")
    p.add_argument("--qk-norm", action="store_true", default=None, help="llama: per-head q / k norms (Qwen3's)")
    p.add_argument("--ffn", type=int, default=None,
                   help="ffn size (default 4h; llama: 352 (cpu) / 14336 (cuda))")
    p.add_argument("--batch", type=int, default=None, help="default 2 (cpu) / 4 (cuda)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--dropout", type=float, default=None, help="hidden and attention dropout (default 0.1; llama 0)")
    p.add_argument("--backend", choices=BACKEND_CHOICES, default="auto")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 3 cpu / 20 cuda)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default 1 cpu / 5 cuda)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--plot", metavar="PATH", help="draw the experiments like the paper's Figure 8 (PNG; needs "
                   "matplotlib: the 'plot' extra): time split forward / backward / recompute, bytes vs Table 2")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    defaults = dict(tp=1 if gpu else 2, seq_len=2048 if gpu else 256, hidden=6144 if gpu else 128,
                    heads=64 if gpu else 4, batch=4 if gpu else 2, iters=20 if gpu else 3, warmup=5 if gpu else 1,
                    dropout=0.1)
    if args.arch == "llama":
        defaults.update(hidden=4096 if gpu else 128, heads=32 if gpu else 8, kv_heads=8 if gpu else 2,
                        ffn=14336 if gpu else 352, dropout=0.0)
    else:
        for option, key in (("--kv-heads", "kv_heads"), ("--kv-channels", "kv_channels"), ("--qk-norm", "qk_norm")):
            if getattr(args, key) is not None:
                p.error(f"{option} is for --arch llama (the gpt layer is the paper's: one k/v head per head, "
                        "h / a wide, no q / k norms)")
    args.qk_norm = bool(args.qk_norm)
    if _under_torchrun():  # the launched ranks are the tensor-parallel group
        world_size = int(os.environ["WORLD_SIZE"])
        if args.tp is not None and args.tp != world_size:
            p.error(f"--tp {args.tp} under torchrun with {world_size} ranks: the launched ranks are the "
                    f"tensor-parallel group (drop --tp, or launch --nproc-per-node {args.tp})")
        args.tp = world_size
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("tp", "seq_len", "hidden", "heads", "batch", "iters", "kv_heads", "kv_channels", "ffn"):
        if getattr(args, key) is not None and getattr(args, key) <= 0:
            p.error(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    if args.warmup < 0:
        p.error(f"--warmup must be non-negative, got {args.warmup}")
    if not probability(args.dropout):
        p.error(f"--dropout must be in {PROBABILITY_RANGE}, got {args.dropout}")
    if (args.kv_channels is None and args.hidden % args.heads) or args.heads % args.tp or args.seq_len % args.tp:
        p.error(f"need hidden % heads == 0 (without --kv-channels), heads % tp == 0 and seq_len % tp == 0 "
                f"(hidden={args.hidden}, heads={args.heads}, seq_len={args.seq_len}, tp={args.tp})")
    if args.arch == "llama":
        check_rope_head_dim(p, args.hidden, args.heads, args.kv_channels)
    if args.kv_heads is not None and (args.heads % args.kv_heads or args.kv_heads % args.tp):
        p.error(f"need heads % kv_heads == 0 and kv_heads % tp == 0 "
                f"(heads={args.heads}, kv_heads={args.kv_heads}, tp={args.tp})")
    if args.ffn is not None and args.ffn % args.tp:
        p.error(f"need ffn % tp == 0 (ffn={args.ffn}, tp={args.tp})")
    check_output_paths(p, args, "json", "plot")
    import torch

    if gpu and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if gpu and args.tp > 1 and not _under_torchrun():
        p.error(f"--device cuda with --tp {args.tp}: launch with torchrun --nproc-per-node {args.tp} instead")
    reason = _backend_unusable(args.backend, _rank_device(args.device))
    if reason:
        p.error(reason)
    return args


def _rank_device(device: str):
    """This process's device for ``--device``: under torchrun the GPU of its LOCAL_RANK (what :func:`main`
    sets current), not the current one (cuda:0: probing the kernels there opened a context on GPU 0 from
    every rank)."""
    import torch

    if device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if _under_torchrun() else
                            torch.cuda.current_device())
    return torch.device(device)


#: --arch -> the TransformerConfig architecture fields (beyond sizes and dropout).
ARCHS = {
    "gpt": dict(),
    "llama": dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope", rope_theta=500000.0,
                  add_bias_linear=False),
}


def layer_config(args, sequence_parallel: bool, recompute: str, dtype):
    """The TransformerConfig of one experiment."""
    import seqpar

    return seqpar.TransformerConfig(hidden_size=args.hidden, num_attention_heads=args.heads,
                                    ffn_hidden_size=args.ffn, num_query_groups=args.kv_heads,
                                    kv_channels=args.kv_channels, qk_layernorm=args.qk_norm,
                                    hidden_dropout=args.dropout, attention_dropout=args.dropout,
                                    sequence_parallel=sequence_parallel, recompute=recompute, backend=args.backend,
                                    params_dtype=dtype, **ARCHS[args.arch])


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _backend_unusable(backend: str, device) -> Optional[str]:
    """Why ``backend`` (or ``SEQPAR_BACKEND`` under "auto") can't run the layer's ops on ``device``."""
    from ..ops import registry

    try:
        name = registry.requested_backend(backend)
    except ValueError as exc:
        return str(exc)
    if name == "auto":
        return None
    source = f"--backend {name}" if backend == name else f"SEQPAR_BACKEND={name}"
    reason = registry.environment_reason(name, device)   # the device or the install: whatever the op
    if reason:
        return f"{source} can't run on {device.type}: {reason}"
    for op in registry.registered_ops():
        reason = registry.unavailable_reason(op, name, device)
        if reason:
            return f"{source} can't run {op} on {device.type}: {reason}"
    return None


class _Timer:
    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def run(self, fn):
        """Run ``fn`` and return its result and its time in ms (all ranks in step)."""
        import torch.distributed as dist

        if self.cuda:
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return out, start.elapsed_time(end)
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        if dist.is_initialized():
            dist.barrier()
        return out, (time.perf_counter() - t0) * 1e3


def run_experiments(args, rank: int, world_size: int, group,
                    on_row: Optional[Callable[[List[Dict]], None]] = None) -> List[Dict]:
    """The five experiments' rows, in order; ``on_row(rows so far)`` after each (rank 0 writes them)."""
    import torch

    import seqpar
    from seqpar.memory import ActivationMeter, architecture_kwargs, layer_activation_bytes
    from seqpar.ops import registry, select_attention_backend
    from seqpar.parallel import sequence_shard

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    timer = _Timer(device)
    s, b, h, a, t = args.seq_len, args.batch, args.hidden, args.heads, world_size
    element = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for index, (name, sp, recompute) in enumerate(EXPERIMENTS, 1):
        started = time.perf_counter()
        seqpar.manual_seed(1)
        cfg = layer_config(args, sp, recompute, dtype)
        layer = seqpar.TransformerLayer(cfg, tp_group=group, device=device)
        gen = torch.Generator().manual_seed(2)
        x_full = torch.randn(s, b, h, generator=gen).to(device=device, dtype=dtype)
        x = (sequence_shard(x_full, group) if sp else x_full).clone().requires_grad_()
        grad_y = torch.randn_like(x)
        # The ranks' agreement on x (TransformerLayer.check_rank_inputs: a hash, an all-gather and a host
        # read per forward at t > 1) is checked once here, untimed: a model step does not pay it (GPTModel
        # turns it off for its layers), so the timed forwards run without it.
        with torch.no_grad():
            layer(x)
        layer.check_rank_inputs = False
        fwd, bwd = [], []
        with registry.record_selections() as ran:      # the backends that actually ran (auto fallbacks too)
            for it in range(args.warmup + args.iters):
                y, ms_f = timer.run(lambda: layer(x))
                _, ms_b = timer.run(functools.partial(y.backward, grad_y))
                if it >= args.warmup:
                    fwd.append(ms_f)
                    bwd.append(ms_b)
                x.grad = None
                layer.zero_grad(set_to_none=True)
        with ActivationMeter() as meter:
            y = layer(x)
        del y
        # gpt: the paper's Table 2; llama: the same formula for its block (flash-style when the core is).
        # Both with the layer's own block keywords: with --dropout 0 the layer keeps no dropout outputs.
        block = architecture_kwargs(cfg)
        if args.arch != "gpt":
            q = torch.empty(b, a // t, s, cfg.head_dim, device=device, dtype=dtype)
            block["flash_attention"] = select_attention_backend(q, q, q, causal=True,
                                                                backend=args.backend).recompute_free
        table2 = functools.partial(layer_activation_bytes, s, b, h, a, tp=t, sequence_parallel=sp,
                                   recompute=recompute, bytes_per_element=element, **block)
        row = dict(experiment=name, sequence_parallel=sp, recompute=recompute,
                   forward_ms=statistics.median(fwd), backward_ms=statistics.median(bwd),
                   activation_bytes=meter.bytes, table2_bytes=table2(), table2_bytes_no_masks=table2(bytes_per_mask=0),
                   backends={op: ",".join(sorted(names)) for op, names in sorted(ran.items())})
        row["combined_ms"] = row["forward_ms"] + row["backward_ms"]
        row["overhead"] = row["combined_ms"] / (rows[0] if rows else row)["combined_ms"] - 1.0  # vs no recompute
        rows.append(row)
        if rank == 0:
            print(f"[{index}/{len(EXPERIMENTS)}] {name}: fwd {row['forward_ms']:.1f} ms, bwd "
                  f"{row['backward_ms']:.1f} ms, {meter.bytes / 2**20:.2f} MiB saved "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
        if on_row is not None:
            on_row(rows)
    return rows


def bench_device_name(args) -> str:
    import torch

    gloo = ", gloo" if args.tp > 1 else ""   # one rank runs the layer alone, without a process group
    return torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores{gloo})"


def json_meta(args) -> Dict:
    """What ``--json`` records beside the rows: device, date, commit and the run's options."""
    return dict(device=bench_device_name(args), date=datetime.date.today().isoformat(), commit=git_commit(),
                config=dict(arch=args.arch, kv_heads=args.kv_heads, kv_channels=args.kv_channels, qk_norm=args.qk_norm,
                            ffn=args.ffn,
                            seq_len=args.seq_len, batch=args.batch, hidden=args.hidden, heads=args.heads,
                            tp=args.tp, dtype=args.dtype, dropout=args.dropout, backend=args.backend,
                            iters=args.iters, warmup=args.warmup))


def write_json(path: str, meta: Dict, rows: List[Dict]) -> None:
    """``meta`` and the rows measured so far to ``path``; ``"complete"`` says whether all five are in.
    A file is written beside it and renamed over it, so a run killed mid-write keeps the previous rows;
    a device or pipe (``/dev/stdout``) is written in place. ValueError naming the path when the write
    fails (a full disk, ``/dev/full``): the run reports it in one line, as a bad option, not a traceback."""
    regular = os.path.isfile(path) or not os.path.exists(path)
    target = f"{path}.partial" if regular else path
    try:
        with open(target, "w") as f:
            json.dump(dict(meta, complete=len(rows) == len(EXPERIMENTS), rows=rows), f, indent=2)
        if regular:
            os.replace(target, path)
    except OSError as exc:
        raise ValueError(f"--json {path}: could not write it ({exc.strerror or exc})") from exc


def format_table(rows: List[Dict], header: str, formula: str = "Table 2") -> str:
    """The rows as a table; ``formula`` names the figure the measured bytes are compared with."""
    lines = [header,
             f"{'experiment':<31}{'forward ms':>11}{'backward ms':>12}{'combined':>10}{'overhead':>10}"
             f"{'act MiB':>10}{formula + ' MiB':>12}{'ratio':>7}"]
    for r in rows:
        overhead = "-" if r["experiment"] == "no recompute" else f"{100 * r['overhead']:+.0f}%"
        lines.append(f"{r['experiment']:<31}{r['forward_ms']:>11.1f}{r['backward_ms']:>12.1f}"
                     f"{r['combined_ms']:>10.1f}{overhead:>10}{r['activation_bytes'] / 2**20:>10.2f}"
                     f"{r['table2_bytes'] / 2**20:>12.2f}{r['activation_bytes'] / r['table2_bytes']:>7.2f}")
    ran = {}  # the backends that actually ran, per op (rows that differ are named)
    for r in rows:
        for op, names in r.get("backends", {}).items():
            ran.setdefault(op, {}).setdefault(names, []).append(r["experiment"])
    for op, by_names in ran.items():
        cells = [names if len(by_names) == 1 else f"{names} ({', '.join(exps)})" for names, exps in by_names.items()]
        lines.append(f"  {op} ran on: {'; '.join(cells)}")
    return "\n".join(lines)


def _rank_main(rank: int, world_size: int, args, store_path: Optional[str],
               on_row: Optional[Callable[[List[Dict]], None]] = None) -> Optional[List[Dict]]:
    import torch
    import torch.distributed as dist

    if store_path is not None:  # spawned by us: CPU gloo ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        # A file store, not a TCP one on a port picked free in the parent: another process could take that
        # port before rank 0 listened (EADDRINUSE)
        timeout = datetime.timedelta(seconds=600)
        store = dist.FileStore(store_path, world_size)
        store.set_timeout(timeout)   # (init_process_group sets it only on a store it makes itself)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    group = dist.group.WORLD if dist.is_initialized() and world_size > 1 else None
    try:
        rows = run_experiments(args, rank, world_size, group, on_row)
    finally:
        if store_path is not None:
            dist.destroy_process_group()
    return rows if rank == 0 else None


def _json_writer(args) -> Optional[Callable[[List[Dict]], None]]:
    """What rewrites --json after every experiment (None without --json): a run stopped part way (a
    device call's time limit, Ctrl-C, SIGTERM) keeps the rows it measured, with "complete": false."""
    return functools.partial(write_json, args.json, json_meta(args)) if args.json else None


def _stop_if_orphaned() -> None:
    """End a spawned rank whose parent is gone (killed with SIGKILL, say): nobody reads its rows, and
    it would only keep the cores busy."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():
        os._exit(1)


def _spawned(rank, world_size, args, store_path, queue):
    """A spawned rank: rank 0's rows after each experiment (the parent writes --json: a rank outliving
    its parent can't rewrite it), then its rows or its error, go to the parent through ``queue`` (which
    reports an error once; re-raising here would print every rank's traceback as well)."""
    def on_row(rows):
        _stop_if_orphaned()
        if rank == 0:   # a copy: the queue pickles it later, in its own thread, while rows grows
            queue.put(("rows", list(rows)))

    try:
        queue.put(("ok", _rank_main(rank, world_size, args, store_path, on_row)))
    except BrokenPipeError:  # the reader of stdout went away (bench | head -1): the parent stops quietly
        from ..cli import stdout_to_devnull

        stdout_to_devnull()
        queue.put(("reader_gone", rank))
        raise SystemExit(1)
    except BaseException as exc:  # noqa: BLE001 - everything goes to the parent
        import traceback
        _stop_if_orphaned()   # (a peer of an orphaned rank fails in its next collective: nobody to tell)
        queue.put(("error", (rank, isinstance(exc, ValueError), f"{type(exc).__name__}: {exc}",
                             traceback.format_exc())))
        raise SystemExit(1)


def _unreported_deaths(procs) -> List[tuple]:
    """(rank, exit code) of the spawned ranks that ended without a report: :func:`_spawned` exits 1 after
    posting one, so another non-zero code (a signal, ``os._exit``) means the rank was killed."""
    return [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0, 1)]


def _deaths_behind_a_failure(procs, grace_s: float = 5.0) -> List[tuple]:
    """:func:`_unreported_deaths` once a rank reported a failure: a killed peer is what the others'
    errors are usually about ("Connection reset by peer"), and their reports can arrive before the dead
    process is reaped, so look again until one is seen, every rank has ended, or ``grace_s`` passed."""
    deadline = time.monotonic() + grace_s
    while True:
        dead = _unreported_deaths(procs)
        if dead or all(proc.exitcode is not None for proc in procs) or time.monotonic() > deadline:
            return dead
        time.sleep(0.05)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, as Ctrl-C raises KeyboardInterrupt: both stop it alike."""


@contextlib.contextmanager
def _stopped_by_signals():
    """Ctrl-C (SIGINT) and SIGTERM stop the run alike, whatever --tp is: the spawned ranks are killed
    (:func:`_run_spawned`), --json keeps the experiments measured ("complete": false), and the command
    exits 128 + the signal's number (130, 143) after one line, without a traceback."""
    def on_sigterm(signum, frame):
        raise _Terminated()

    # signal handlers can only be set from the main thread (a caller in another thread keeps its own)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    try:
        yield
    except KeyboardInterrupt as exc:
        signum = signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT
        print(f"{program_name()}: stopped by {signum.name}", file=sys.stderr)
        raise SystemExit(128 + signum) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _run_spawned(args) -> List[Dict]:
    """Rank 0's rows from ``args.tp`` gloo ranks spawned on CPU; this process writes --json from the rows
    rank 0 sends after each experiment. The ranks are killed when one fails or dies, the reader of
    stdout goes away, or this process is stopped (Ctrl-C, SIGTERM)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    cores = os.cpu_count() or 1
    shared = f" ({cores} cores: ranks share them, so the times are slower)" if args.tp > cores else ""
    print(f"seqpar bench: spawning {args.tp} gloo ranks on CPU{shared}", flush=True)
    write = _json_writer(args)
    rows, failures, dead, received, reader_gone, finished = None, [], [], 0, False, False
    # the ranks meet in a file store there (see _rank_main); made last before the try that removes it
    store_dir = tempfile.mkdtemp(prefix="seqpar-bench-")
    store_path = os.path.join(store_dir, "gloo-store")
    procs = [ctx.Process(target=_spawned, args=(r, args.tp, args, store_path, queue)) for r in range(args.tp)]
    try:
        for proc in procs:
            proc.start()
        while received < len(procs) and not failures and not dead and not reader_gone:
            try:
                status, payload = queue.get(timeout=1.0)
            except queue_module.Empty:   # a rank killed (out of memory, a signal) never reports: look
                dead = _unreported_deaths(procs)
                continue
            if status == "rows":     # rank 0 finished an experiment
                if write is not None:
                    write(payload)
                continue
            received += 1
            reader_gone = status == "reader_gone"
            if status == "error":
                failures.append(payload)
                dead = _deaths_behind_a_failure(procs)
            rows = payload if status == "ok" and payload is not None else rows
        finished = not (failures or dead or reader_gone)
    finally:   # anything else (a failure, Ctrl-C, SIGTERM, --json unwritable): no rank outlives this process
        for proc in procs:
            if proc.pid is not None:
                if not finished:
                    proc.kill()
                proc.join()
        shutil.rmtree(store_dir, ignore_errors=True)
    prog = program_name()
    if reader_gone:
        raise BrokenPipeError   # python -m seqpar's handler ends quietly
    if dead:
        rank, code = dead[0]
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        raise SystemExit(f"{prog}: rank {rank} died ({how}) without a report "
                         "(killed: out of memory?); the other ranks were stopped")
    if failures:
        rank, bad_input, message, trace = failures[0]
        if bad_input:  # seqpar rejected an input: the message names it
            raise ValueError(f"rank {rank}: {message}")
        raise SystemExit(f"{prog}: rank {rank} failed:\n{trace}")
    return rows


def main(argv: Optional[List[str]] = None) -> List[Dict]:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    with _stopped_by_signals():
        if _under_torchrun():  # use the launched ranks; rank 0 writes --json
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if args.device == "cuda":
                torch.cuda.set_device(_rank_device(args.device))
            dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
            rows = _rank_main(rank, world_size, args, None, _json_writer(args) if rank == 0 else None)
            dist.destroy_process_group()
        elif args.tp == 1:
            rank, rows = 0, _rank_main(0, 1, args, None, _json_writer(args))
        else:
            rank, rows = 0, _run_spawned(args)
    if rank != 0:
        return []
    device_name = bench_device_name(args)
    heads_of = "" if args.kv_channels is None else f" d={args.kv_channels}"
    arch = "" if args.arch == "gpt" else \
        f" llama (g={args.kv_heads}{heads_of} f={args.ffn}{' q/k norms' if args.qk_norm else ''})"
    header = (f"seqpar bench: one{arch} layer, s={args.seq_len} b={args.batch} h={args.hidden} a={args.heads} "
              f"t={args.tp} {args.dtype} dropout={args.dropout} backend={args.backend} on {device_name}")
    formula = "Table 2" if args.arch == "gpt" else "formula"   # llama: Table 2's terms for its block
    print(format_table(rows, header, formula))
    if args.json:   # written after each experiment
        print(f"wrote {args.json}")
    if args.plot:
        from .plots import plot_bench
        plot_bench(rows, header, args.plot, formula)
        print(f"wrote {args.plot}")
    return rows
