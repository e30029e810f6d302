#!/usr/bin/env python3
"""Profile one forward + backward step of the kernels behind the GPU targets (issue 10), per case.

A target that a benchmark shows missed needs the reason: which kernel takes the time, and whether it
runs at the memory or the compute roof. Each case builds one provider's fwd+bwd step at one shape,
exactly as the benchmarks build it (bench_layernorm_dropout.make_provider, bench_attention.make_provider),
warms it up (compiles, autotuning), then profiles one step:

``--tool torch`` (default; runs anywhere)
    torch.profiler over the step: per kernel (on CPU, per op), the launches and the device time
    (metrics ``calls``, ``device_us``; on CPU ``cpu_us``).
``--tool ncu`` (a GPU with Nsight Compute)
    one ``ncu --profile-from-start off`` process per case (the step runs between
    cudaProfilerStart/Stop, so warm-up stays out), sections SpeedOfLight, Occupancy, LaunchStats and
    MemoryWorkloadAnalysis for every kernel of the step; every metric becomes a row
    (``Section: Metric [unit]``). The printed table gives duration, DRAM and SM throughput (% of peak),
    achieved occupancy and registers per thread, per launch (kernel names shortened; the CSV keeps them
    whole).

Rows (device, date, commit, case, tool, kernel, metric, value) are appended to
``<out>/profile_kernels.csv``.

Cases (bf16), p = 0.1 attention first, then LayerNorm, RMSNorm and SwiGLU, then p = 0 attention::

    attn-<provider>-s4096-p<p>    attention core, causal, b = 2, H = 16, s = 4096, d = 128, p = 0.1 and 0:
                                  seqpar-triton, torch-sdpa-flash
    ln-<provider>-<rows>x<h>      bias-dropout-add + LayerNorm, p = 0.1: seqpar-triton, seqpar-cuda,
                                  liger-ln at 1024 x 4096 and 1024 x 12288 (sequence-parallel shards),
                                  16384 x 12288 and 16384 x 4096
    rmsnorm-<provider>-16384x4096 residual add + RMSNorm; swiglu-<provider>-16384x14336: seqpar-triton,
    swiglu-<provider>-...         seqpar-cuda, torch-compile

Usage::

    python bench/profile_kernels.py --list
    python bench/profile_kernels.py --tool ncu --out DIR              # every case (bench/gpu_suite.sh)
    python bench/profile_kernels.py --case attn-seqpar-triton-s4096-p0.1
    python bench/profile_kernels.py --quick                           # CPU smoke test: tiny shapes
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import re
import shutil
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if __name__ == "__main__" and "--quick" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (see bench_attention)

import torch  # noqa: E402

from seqpar.bench.results import ResultRows  # noqa: E402

NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "MemoryWorkloadAnalysis")
# (column title, section, metric display name) of the printed ncu table
NCU_TABLE = (("us", "GPU Speed Of Light Throughput", "Duration"),
             ("DRAM%", "GPU Speed Of Light Throughput", "DRAM Throughput"),
             ("SM%", "GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
             ("occ%", "Occupancy", "Achieved Occupancy"),
             ("regs", "Launch Statistics", "Registers Per Thread"))
# Duration units, both spellings: ncu 2025.x (CUDA 13) wrote "ns" on the H200 run, older releases write
# "nsecond" / "usecond" / "msecond" (scaled to the value).
TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6,
         "second": 1e6}


def cases(quick: bool) -> Dict[str, Tuple[str, str, dict]]:
    """name -> (family, provider, shape), the targets still missed first: a run cut off at its time limit
    keeps those. The LayerNorm at 16384 x 12288 (its forward's plan changed since the first GPU run),
    the Llama ops' backward (42% / 77% of the copy bandwidth there), the LayerNorm at other shapes (a
    shard's few rows, where the backward's fp32 partial column sums rival the data), then attention
    (its targets were met)."""
    attn = ("seqpar-triton", "torch-eager") if quick else ("seqpar-triton", "torch-sdpa-flash")
    ln = ("seqpar-triton", "torch-eager") if quick else ("seqpar-triton", "seqpar-cuda", "liger-ln")
    llama = ("seqpar-triton", "torch-eager") if quick else ("seqpar-triton", "seqpar-cuda", "torch-compile")
    b, heads, s, d = (1, 2, 32, 16) if quick else (2, 16, 4096, 128)
    rms, swiglu = (dict(tokens=48, hidden=64), dict(tokens=48, ffn=64)) if quick else \
        (dict(tokens=16384, hidden=4096), dict(tokens=16384, ffn=14336))
    ln_shapes = [(48, 64)] if quick else [(16384, 12288), (16384, 4096), (1024, 4096), (1024, 12288)]
    out = {}

    def add_ln(tokens, h):
        for provider in ln:
            out[f"ln-{provider}-{tokens}x{h}"] = ("ln", provider, dict(tokens=tokens, h=h, p=0.1))

    add_ln(*ln_shapes[0])
    for provider in llama:
        out[f"rmsnorm-{provider}-{rms['tokens']}x{rms['hidden']}"] = ("rmsnorm", provider, rms)
        out[f"swiglu-{provider}-{swiglu['tokens']}x{swiglu['ffn']}"] = ("swiglu", provider, swiglu)
    for tokens, h in ln_shapes[1:]:
        add_ln(tokens, h)
    for p in (0.1, 0.0):
        for provider in attn:
            out[f"attn-{provider}-s{s}-p{p:g}"] = ("attn", provider, dict(b=b, heads=heads, s=s, d=d, p=p))
    return out


def build_step(family: str, provider: str, shape: dict, device: torch.device) -> Callable[[], object]:
    """One forward + backward of ``provider`` at ``shape`` (bf16 on a GPU, fp32 on CPU)."""
    from bench import bench_attention, bench_layernorm_dropout

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(3)

    def rnd(*size, scale=1.0, grad=False):
        return (scale * torch.randn(*size, generator=g)).to(device=device, dtype=dtype).requires_grad_(grad)

    if family == "ln":
        tokens, h, p = shape["tokens"], shape["h"], shape["p"]
        fn, params = bench_layernorm_dropout.make_provider(provider, h, p, dtype, device)
        x, residual, bias = rnd(tokens, h, grad=True), rnd(tokens, h, scale=2.0, grad=True), rnd(h, grad=True)
        grads = (rnd(tokens, h), rnd(tokens, h))
        return lambda: torch.autograd.grad(fn(x, bias, residual), [x, bias, residual, *params], grads)
    if family in ("rmsnorm", "swiglu"):
        from bench import bench_llama_ops

        problem = bench_llama_ops.make_problem(family, provider, shape, dtype, device)
        fn = problem.fns[provider]
        return lambda: torch.autograd.grad(fn(), problem.leaves, problem.grads)
    fn = bench_attention.make_provider(provider, True, shape["p"], device)
    q, k, v, grad_o = bench_attention._inputs(provider, shape["b"], shape["heads"], shape["heads"], shape["s"],
                                              shape["d"], dtype, device)
    return lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), grad_o)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(step: Callable[[], object], device: torch.device, runs: int = 3) -> None:
    for _ in range(runs):
        step()
    _sync(device)


def torch_profile(step: Callable[[], object], device: torch.device) -> List[Tuple[str, str, float]]:
    """(kernel or op, metric, value) of one step: ``calls`` and ``device_us`` per kernel on a GPU,
    ``calls`` and ``cpu_us`` (self time) per op on CPU; slowest first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    out = []
    for evt in prof.key_averages():
        if cuda and evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        out.append((evt.key, float(evt.count), float(us)))
    out.sort(key=lambda r: -r[2])
    metric = "device_us" if cuda else "cpu_us"
    return [row for key, calls, us in out for row in ((key, "calls", calls), (key, metric, us))]


def parse_ncu_csv(text: str) -> List[dict]:
    """The rows of ``ncu --csv --page details`` output (one row per kernel launch and metric: ID,
    Kernel Name, Section Name, Metric Name, Metric Unit, Metric Value); lines before the header
    (the program's own output, ``==PROF==`` notes) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID",')), None)
    if start is None:
        return []
    body = "\n".join(line for line in lines[start:] if line.startswith('"'))
    # Rows without a metric name are ncu's rule results (advice text in columns not kept here): no value.
    return [dict(id=int(r["ID"]), kernel=r["Kernel Name"], section=r["Section Name"], metric=r["Metric Name"],
                 unit=r["Metric Unit"], value=r["Metric Value"])
            for r in csv.DictReader(io.StringIO(body)) if r["Metric Name"]]


def _number(value: str) -> Optional[float]:
    try:
        return float(value.replace(",", ""))
    except ValueError:
        return None


def launch_table(parsed: List[dict]) -> List[dict]:
    """Per kernel launch, in launch order: {"kernel" (the full name), and each NCU_TABLE title: its value,
    or None where ncu gave none or a duration unit not in TO_US} (duration in us)."""
    by_launch: Dict[int, dict] = {}
    for r in parsed:
        launch = by_launch.setdefault(r["id"], {"kernel": r["kernel"], **{t: None for t, _, _ in NCU_TABLE}})
        for title, section, metric in NCU_TABLE:
            if (r["section"], r["metric"]) == (section, metric):
                value = _number(r["value"])
                if value is not None and title == "us":
                    value = value * TO_US[r["unit"]] if r["unit"] in TO_US else None
                launch[title] = value
    return [by_launch[i] for i in sorted(by_launch)]


def _template_args(text: str) -> str:
    """The leading ``<...>`` of ``text`` up to its matching ``>``."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if depth == 0:
            return text[:i + 1]
    return text


def short_kernel_name(name: str, width: int = 56) -> str:
    """A readable stand-in for a kernel's (C++ template) name in the printed table; the CSV keeps the full
    name. ``void ns::kernel<args>(params)`` becomes ``ns::kernel<args>`` where the template arguments are
    short, else ``ns::kernel<...>``. PyTorch's TensorIterator launchers (``at::elementwise_kernel<...>``)
    all look alike, so the op they run takes the arguments' place (``direct_copy_kernel_cuda`` ->
    ``at::elementwise_kernel (direct_copy)``): a copy or a cast is what one looks for in a profile."""
    name = name.removeprefix("void ")
    cut = min((i for i in (name.find("<"), name.find("(")) if i >= 0), default=len(name))
    short, rest = name[:cut], name[cut:]
    op = re.search(r"(\w+)_kernel_cuda\b", rest)
    if op:
        short += f" ({op.group(1)})"
    elif rest.startswith("<"):
        args = _template_args(rest)
        short += args if len(args) <= 32 else "<...>"
    return short if len(short) <= width else short[:width - 3] + "..."


def ncu_table(case: str, parsed: List[dict]) -> List[str]:
    """One printed line per kernel launch: its short name and the NCU_TABLE columns."""
    lines = []
    for launch in launch_table(parsed):
        cells = " ".join(f"{title} {launch[title]:8.1f}" if launch[title] is not None else f"{title}      n/a"
                         for title, _, _ in NCU_TABLE)
        lines.append(f"{case:34s} {short_kernel_name(launch['kernel']):56s} {cells}")
    return lines


def ncu_row(r: dict) -> Tuple[str, str, str]:
    """(kernel, metric, value) cells of one parsed ncu metric: "<launch id> <kernel>",
    "<section>: <metric> [<unit>]" (:func:`ncu_parsed` reads them back)."""
    metric = f"{r['section']}: {r['metric']}" + (f" [{r['unit']}]" if r["unit"] else "")
    return f"{r['id']} {r['kernel']}", metric, r["value"]


def ncu_parsed(kernel: str, metric: str, value: str) -> dict:
    """The parsed ncu metric of a row's cells (the inverse of :func:`ncu_row`)."""
    launch, name = kernel.split(" ", 1)
    found = re.fullmatch(r"(.*?): (.*?)(?: \[(.*)\])?", metric)
    section, metric_name, unit = found.groups() if found else ("", metric, None)
    return dict(id=int(launch), kernel=name, section=section, metric=metric_name, unit=unit or "", value=value)


# ncu errors no case recovers from: the profiler can't start here (a sandboxed GPU, missing counter
# permissions) or there is no ncu. Each further case would spend another ncu start-up on it.
NCU_UNUSABLE = re.compile(r"Failed to initialize the profiler|LibraryNotLoaded|ERR_NVGPUCTRPERM|not on the PATH")


def run_ncu(case: str, quick: bool, timeout_s: float) -> List[dict]:
    ncu = shutil.which("ncu")
    if ncu is None:
        raise RuntimeError("ncu (Nsight Compute) is not on the PATH")
    cmd = [ncu, "--profile-from-start", "off", "--csv", "--page", "details"]
    for section in NCU_SECTIONS:
        cmd += ["--section", section]
    cmd += [sys.executable, os.path.abspath(__file__), "--profiled-step", "--case", case]
    cmd += ["--quick"] if quick else []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    parsed = parse_ncu_csv(done.stdout)
    if done.returncode != 0 or not parsed:
        # the last line of the child's output says why (its exception), not the middle of a traceback
        lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        raise RuntimeError(f"ncu exit status {done.returncode}, {len(parsed)} rows: "
                           f"{lines[-1].strip() if lines else 'no output'}")
    return parsed


def profiled_step(case: str, quick: bool) -> int:
    """The child ncu runs: warm up, then one step between cudaProfilerStart and cudaProfilerStop."""
    family, provider, shape = cases(quick)[case]
    device = torch.device("cuda")
    step = build_step(family, provider, shape, device)
    warm_up(step, device)
    torch.cuda.profiler.start()
    step()
    _sync(device)
    torch.cuda.profiler.stop()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool", choices=("torch", "ncu"), default="torch")
    ap.add_argument("--case", action="append", help="a case (repeatable; default: all, see --list)")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--out", default=None, help="directory (or .csv path) for rows; default bench/results "
                    "(--quick writes nothing unless --out is given)")
    ap.add_argument("--ncu-timeout", type=float, default=120.0, help="seconds per case under ncu")
    ap.add_argument("--quick", action="store_true", help="CPU smoke test: tiny shapes, Triton interpreter")
    ap.add_argument("--profiled-step", action="store_true", help=argparse.SUPPRESS)  # the child under ncu
    args = ap.parse_args(argv)

    all_cases = cases(args.quick)
    if args.list:
        print("\n".join(all_cases))
        return 0
    names = args.case or list(all_cases)
    unknown = [n for n in names if n not in all_cases]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; --list shows them")
    if args.profiled_step:
        return profiled_step(names[0], args.quick)
    cuda = torch.cuda.is_available() and not args.quick
    if not cuda and not args.quick:
        print("profile_kernels: needs a CUDA device (none found); --quick profiles tiny shapes on CPU",
              file=sys.stderr)
        return 2
    if args.tool == "ncu" and not cuda:
        ap.error("--tool ncu needs a CUDA device")
    device = torch.device("cuda" if cuda else "cpu")
    rows = ResultRows(torch.cuda.get_device_name(device) if cuda else "cpu", "profile_kernels",
                      ("case", "tool", "kernel", "metric", "value"))
    with rows.sweep():
        for name in names:
            family, provider, shape = all_cases[name]
            try:
                if args.tool == "ncu":
                    # A provider that can't run (not importable) fails here in milliseconds, not in an ncu
                    # child after ~12 s of start-up; what it allocated goes back before the child runs.
                    build_step(family, provider, shape, device)
                    torch.cuda.empty_cache()
                    parsed = run_ncu(name, args.quick, args.ncu_timeout)
                    for r in parsed:
                        rows.add(name, "ncu", *ncu_row(r))
                    print("\n".join(ncu_table(name, parsed)), flush=True)
                else:
                    step = build_step(family, provider, shape, device)
                    warm_up(step, device)
                    profiled = torch_profile(step, device)
                    for kernel, metric, value in profiled:
                        rows.add(name, "torch", kernel, metric, value)
                    top = [(k, v) for k, m, v in profiled if m != "calls"][:4]
                    print(f"{name:34s} " + "; ".join(f"{k[:40]} {v:.0f} us" for k, v in top), flush=True)
            except Exception as exc:  # noqa: BLE001 - a case that can't run is reported, the others go on
                first_line = str(exc).splitlines()[0][:160] if str(exc) else ""
                print(f"{name:34s} skipped ({type(exc).__name__}: {first_line})", flush=True)
                if args.tool == "ncu" and NCU_UNUSABLE.search(str(exc)):   # no later case can do better
                    print("profile_kernels: ncu can't profile on this machine; the remaining cases are skipped",
                          flush=True)
                    break
    return rows.finish(args.out, args.quick)


if __name__ == "__main__":
    sys.exit(main())
