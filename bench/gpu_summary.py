#!/usr/bin/env python3
"""The GPU summary of issue 10: ``gpu_summary.json`` and one PNG per benchmark, from measured rows.

Reads the rows that ``bash bench/gpu_suite.sh PART`` wrote on the GPU machine, copied into one folder
(default bench/results/):

    bench_layernorm_dropout.csv   bias-dropout-add + LayerNorm (seqpar backends, torch.compile, peers)
    bench_attention.csv           the attention core vs SDPA (time, and the peak memory of one fwd+bwd)
    layer_bench_gpu.json          python -m seqpar bench --device cuda --json (the paper's five experiments;
                                  gpu_suite.sh writes this name; an older layer_bench.json is read too)
    bench_megatron_layer.csv      Megatron-Core's layer, the same five experiments and shape
    bench_overlap.csv             the "gemm" part: chunked vs unchunked GEMMs of the comm-overlapped linears
    bench_llama_ops.csv           residual add + RMSNorm, SwiGLU, RoPE, dropout (seqpar backends, torch.compile, Liger)
    profile_kernels.csv           bench/profile_kernels.py: one fwd+bwd step per kernel case under Nsight
                                  Compute and torch.profiler; not a target: ``profiles`` in the summary
                                  (and its printout) puts the kernels' times and roofline shares beside
                                  the targets they explain

Only rows measured on a GPU count (a device name that isn't "cpu..."), and of those the latest run of
each file, or of each part of a file: bench_overlap.csv's ``part`` column (a later ``--part project`` run
keeps the earlier gemm rows) and bench_llama_ops.csv's op (a run cut after rmsnorm keeps an earlier run's
swiglu rows; the op's targets then say, in ``detail``, which older run they read); one run = one device,
date and commit. A NaN among a sweep's values makes its target unknown (``met`` null), ``detail`` naming
the configuration. A file that is missing gives its targets ``value: null, met: null`` with the reason in
``detail``: every target is listed, measured or not.

Each target is {"name", "value", "goal", "unit", "met", "compare", "detail"}: ``met`` is
``value >= goal`` or ``value <= goal`` as ``compare`` says; ``detail`` names the worst configuration
(a target over a sweep is its worst case) and the provider. Ratios against another provider are
``other time / seqpar time`` (above 1: seqpar is faster), taken per configuration, so a sweep's worst
case is its minimum. "seqpar" is, per configuration, the fastest seqpar backend that ran (both are
shipped; ``detail`` names the one that gave the worst case).

The LayerNorm, RMSNorm and SwiGLU targets are about the kernels: they read the GPU time of back-to-back
calls ({d}_gpu_ms, {d}_gpu_frac_copy; seqpar.bench.timing.device_time) when the rows have it, and say in
``detail`` when its checks flag a measurement (a launch queue that drained: an upper bound; data reused
within 2 L2 sizes: maybe served from L2). Rows without it (the first GPU run's) give the eager call time
instead, and ``detail`` says so. The same targets from the eager call time, launch overhead included,
follow as separate entries ("..., eager call time (launch overhead included): ..."). The LayerNorm's
bandwidth is also held against a copy moving the same bytes ("... vs a copy of the same bytes"): the
sweep's shard sizes (256 rows) move a few MB, where a copy kernel too stays far below the 1 GiB copy's
bandwidth, so that entry tells a kernel's own shortfall from its size's. The printout
shortens C++ template kernel names of ``profiles``; the JSON keeps them whole.

Usage:
    python bench/gpu_summary.py                           # bench/results/* -> bench/results/gpu_summary.json
    python bench/gpu_summary.py --rows DIR --out DIR      # rows from DIR, summary and PNGs to DIR
    python bench/gpu_summary.py --no-plots
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
from collections import defaultdict
from typing import Dict, Iterable, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The sweeps (a target is the worst case over these; other measured configurations are plotted).
LN_TOKENS, LN_HIDDEN = (256, 1024, 16384), (1024, 4096, 12288)
ATTN_SEQLENS, ATTN_HEAD_DIMS = (1024, 2048, 4096), (64, 128)
DROPOUTS = (0.0, 0.1)                     # the LayerNorm and attention sweeps' p (their scripts' defaults)
LLAMA_SWEEP = {"rmsnorm": 2, "swiglu": 2}  # bench_llama_ops' default sizes: h 4096, 8192; n 11008, 14336
LN_PEERS = ("torch-compile", "liger-ln", "apex-ln", "te-ln")
LLAMA_PEERS = ("torch-compile", "liger")
SDPA_FLASH = "torch-sdpa-flash"
GEMM_MODELS = ("22B", "175B")
GEMM_CHUNKING = "chunked x8"   # what the overlapped path runs (bench_overlap also times other chunkings)


# ----------------------------------------------------------------------------- rows
def is_gpu(device: str) -> bool:
    return not device.lower().startswith("cpu") and device != "unknown"


# What a benchmark writes before its sweep: a run with nothing else (cut off before its first
# configuration) measured nothing, and must not hide an older complete run.
CEILING_METRICS = ("copy_gbps",)


def latest_run(rows: List[Dict]) -> List[Dict]:
    """The GPU rows of the file's latest run that measured something beyond the copy ceiling (rows of
    one run share device, date and commit)."""
    runs: Dict[Tuple[str, str, str], List[Dict]] = {}
    for r in rows:
        if is_gpu(r["device"]):
            runs.setdefault(run_key(r), []).append(r)
    measured = [key for key, run in runs.items() if any(r.get("metric") not in CEILING_METRICS for r in run)]
    return runs[max(measured)] if measured else []


def read_rows(path: str) -> List[Dict]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        # Not a header appended again (cat a.csv >> b.csv: its "device" would read as the latest GPU run)
        # nor a row cut short (a benchmark killed mid-write: cells of None).
        return [r for r in csv.DictReader(f) if r.get("device") != "device" and None not in r.values()]


def part_of(row: Dict) -> Optional[str]:
    """The part of its file a row belongs to, whose latest run counts on its own: bench_overlap's ``part``
    column, bench_llama_ops' op (``op=`` in the config); None for the rest (e.g. the copy ceiling)."""
    return row.get("part") or config_fields(row.get("config") or "").get("op")


def run_key(row: Dict) -> Tuple[str, str, str]:
    """The run a row comes from, ordered by date."""
    return row["date"], row["device"], row["commit"]


def read_csv(path: str) -> List[Dict]:
    """The rows of :func:`latest_run`, taken per part of the file (:func:`part_of`: a later run of one part,
    e.g. bench_overlap's ``--part project`` or a bench_llama_ops run cut after rmsnorm, does not hide an
    earlier run's other parts)."""
    parts = defaultdict(list)
    for r in read_rows(path):
        parts[part_of(r)].append(r)
    return [r for rows in parts.values() for r in latest_run(rows)]


def read_layer_json(folder: str) -> Optional[Dict]:
    """The latest GPU run (by its date) of layer_bench_gpu.json (gpu_suite.sh's name) and
    layer_bench.json (an older name)."""
    runs = []
    for name in ("layer_bench_gpu.json", "layer_bench.json"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            try:
                with open(path) as f:
                    data = json.load(f)
            except ValueError:     # cut short while written: as if missing
                continue
            if isinstance(data, dict) and is_gpu(data.get("device", "cpu")):
                runs.append(data)
    return max(runs, key=lambda data: str(data.get("date", ""))) if runs else None


def config_fields(config: str) -> Dict[str, str]:
    """``"tokens=256,h=1024,p=0.1"`` or ``"b=4 H=16 s=4096 d=128 causal=1 p=0.1 bf16"`` -> {key: value}."""
    return dict(re.findall(r"(\w+)=([^,\s]+)", config))


def metric_table(rows: Iterable[Dict]) -> Dict[Tuple[str, str, str], float]:
    """{(config, provider, metric): value} of the numeric rows."""
    table = {}
    for r in rows:
        try:
            table[(r["config"], r["provider"], r["metric"])] = float(r["value"])
        except (TypeError, ValueError):
            continue        # a text row, e.g. Megatron's "not_applicable" reason (or a missing value)
    return table


def experiment_of(config: str, experiments: Iterable[str]) -> Optional[str]:
    """The experiment a Megatron row's config ends with (the longest name: "selective + sequence parallel"
    also ends with "sequence parallel")."""
    return max((e for e in experiments if config.endswith(" " + e)), key=len, default=None)


def run_meta(rows: List[Dict]) -> Optional[Dict]:
    """Device, date and commit of the latest run among ``rows``; where a file's parts (:func:`part_of`)
    come from different runs, ``"parts"`` gives each part's too."""
    keys = ("device", "date", "commit")
    latest = max(rows, key=lambda r: r["date"], default=None)
    if latest is None:
        return None
    by_part: Dict[str, Dict] = {}
    for r in rows:
        part = part_of(r)
        if part and (part not in by_part or r["date"] > by_part[part]["date"]):
            by_part[part] = r
    meta = {k: latest[k] for k in keys}
    if len({tuple(r[k] for k in keys) for r in by_part.values()}) > 1:
        meta["parts"] = {part: {k: r[k] for k in keys} for part, r in sorted(by_part.items())}
    return meta


# ----------------------------------------------------------------------------- targets
def require_sweep(targets: List[Dict], measured: int, expected: int, what: str) -> List[Dict]:
    """A target met on part of its sweep is not known to be met: ``met`` None (a miss stays a miss), and
    ``detail`` says how much was measured. gpu_suite.sh's steps run their largest sizes first and stop at
    their time limit, so a cut sweep drops the small shard sizes where targets miss."""
    if 0 < measured < expected:
        for t in targets:
            if t["met"]:
                t["met"] = None
            t["detail"] += f"; incomplete sweep: {measured} of {expected} {what} measured"
    return targets


def target(name: str, value: Optional[float], goal: float, unit: str, compare: str, detail: str) -> Dict:
    if value is not None and not math.isfinite(value):
        value = None
    met = None if value is None else (value >= goal if compare == ">=" else value <= goal)
    return dict(name=name, value=None if value is None else round(value, 4), goal=goal, unit=unit, met=met,
                compare=compare, detail=detail)


def worst(cases: List[Tuple[float, str]], lowest: bool = True) -> Tuple[Optional[float], str]:
    """The worst (value, label) of a sweep: the lowest, or with ``lowest=False`` the highest. A value that
    is not a number (NaN, inf) makes it unknown (None), the detail naming it: min() / max() would drop a
    NaN or return it depending on where it stands."""
    if not cases:
        return None, "not measured"
    broken = [label for value, label in cases if not math.isfinite(value)]
    if broken:
        return None, (f"not a number in {len(broken)} of {len(cases)} configurations (a broken measurement?), "
                      f"e.g. {broken[0]}")
    value, label = (min if lowest else max)(cases, key=lambda c: c[0])
    return value, f"worst: {label} (over {len(cases)} configurations)"


def best_seqpar(table, config: str, metric: str) -> Optional[Tuple[float, str]]:
    """(ms, provider) of the fastest seqpar backend of ``config`` for a *_ms ``metric``."""
    found = [(v, p) for (c, p, m), v in table.items() if c == config and m == metric and p.startswith("seqpar-")
             and p != "seqpar-torch"]
    # a NaN is "the fastest": it reaches the target as unknown (worst()), not hidden by another backend
    return min(found, key=lambda vp: (not math.isnan(vp[0]), vp)) if found else None


# The two clocks of bench_layernorm_dropout.py and bench_llama_ops.py (seqpar.bench.timing): metric infix,
# and what a target's name or detail says about it.
GPU_CLOCK, CALL_CLOCK = "_gpu", ""
CALL_NAME = "eager call time (launch overhead included)"
GPU_DETAIL = ("GPU time (back-to-back calls with the host ahead, no launch gaps; seqpar.bench.timing.device_time)")
CALL_FALLBACK = ("eager call time, launch overhead included (these rows predate the GPU-time metric {d}_gpu_ms; "
                 "rerun the benchmark for the kernels' time)")


def _clock_notes(table, cases: List[Tuple[float, str, List[Tuple[str, str]]]], direction: str) -> str:
    """What the GPU-time checks say about the (config, provider) pairs behind ``cases``: batches whose launch
    queue drained (an upper bound) and data that may have been served from L2."""
    pairs = {pair for _, _, used in cases for pair in used}
    drained = sorted(f"{c} {p}" for c, p in pairs if table.get((c, p, f"{direction}_gpu_queue_full"), 1.0) < 1.0)
    in_l2 = sorted(f"{c} {p}" for c, p in pairs if table.get((c, p, f"{direction}_gpu_l2_reuse"), 2.0) < 2.0)
    notes = []
    if drained:
        notes.append(f"the launch queue drained in some batches of {len(drained)} of {len(pairs)} measurements "
                     f"(their GPU time is an upper bound), e.g. {drained[0]}")
    if in_l2:
        notes.append(f"{len(in_l2)} of {len(pairs)} measurements reuse their data after less than 2 L2 sizes (may "
                     f"be served from L2), e.g. {in_l2[0]}")
    return "".join(f"; {n}" for n in notes)


def _fused_row_clock(table, op: str, configs: List[str], peers: Tuple[str, ...], frac_goal: float,
                     compile_goal: float, bandwidth_directions, clock: str, name_infix: str,
                     detail_prefix: str) -> List[Dict]:
    """The targets of :func:`fused_row_targets` from one clock's metrics (``{d}{clock}_ms``, ...)."""
    out = []
    missing = "not measured (no GPU rows)" if not configs else ""
    for direction in bandwidth_directions:
        cases = []
        for config in configs:
            best = best_seqpar(table, config, f"{direction}{clock}_ms")
            frac = table.get((config, best[1], f"{direction}{clock}_frac_copy")) if best else None
            if frac is not None:
                cases.append((frac, f"{config} {best[1]}", [(config, best[1])]))
        value, detail = worst([c[:2] for c in cases])
        if clock == GPU_CLOCK and cases:
            detail += _clock_notes(table, cases, direction)
        out.append(target(f"{op} {direction}{name_infix}: fraction of device-to-device copy bandwidth", value,
                          frac_goal, "fraction", ">=", missing or detail_prefix.format(d=direction) + detail))
    for peer in peers:
        cases = []
        for config in configs:
            best = best_seqpar(table, config, f"fwdbwd{clock}_ms")
            other = table.get((config, peer, f"fwdbwd{clock}_ms"))
            if best and other:
                cases.append((other / best[0], f"{config} {best[1]}", [(config, best[1]), (config, peer)]))
        goal = compile_goal if peer == "torch-compile" else 1.0
        value, detail = worst([c[:2] for c in cases])
        detail = detail_prefix.format(d="fwdbwd") + detail
        if clock == GPU_CLOCK and cases:
            detail += _clock_notes(table, cases, "fwdbwd")
        if not cases and configs:
            detail = f"{peer} did not run (not importable or failed; see the log)"
        name = (f"{op} fwd+bwd speed vs {peer} ({peer} time / seqpar time)" if not name_infix else
                f"{op} fwd+bwd{name_infix}: speed vs {peer} ({peer} time / seqpar time)")
        out.append(target(name, value, goal, "x", ">=", missing or detail))
    return out


def fused_row_targets(table, op: str, configs: List[str], peers: Tuple[str, ...], frac_goal: float,
                      compile_goal: float, bandwidth_directions=("fwd", "bwd")) -> List[Dict]:
    """Copy-bandwidth fractions (per direction) and fwd+bwd speed ratios vs torch.compile and the peers.

    The targets are about the kernels, so they read the GPU time (``{d}_gpu_ms``, ``{d}_gpu_frac_copy``)
    when the rows have it; rows without it (the first GPU run's) give the eager call time instead, and
    ``detail`` says so. The same targets from the eager call time follow as separate entries, named
    "... eager call time (launch overhead included)", so a launch-bound configuration stays visible."""
    has_gpu = any(m.endswith("_gpu_ms") for c, _, m in table if c in set(configs))
    kernel = _fused_row_clock(table, op, configs, peers, frac_goal, compile_goal, bandwidth_directions,
                              GPU_CLOCK if has_gpu else CALL_CLOCK, "",
                              (GPU_DETAIL if has_gpu else CALL_FALLBACK) + ": " if configs else "")
    call = _fused_row_clock(table, op, configs, peers, frac_goal, compile_goal, bandwidth_directions, CALL_CLOCK,
                            f", {CALL_NAME}", "")
    return kernel + call


def same_bytes_targets(table, op: str, configs: List[str], frac_goal: float,
                       directions=("fwd", "bwd")) -> List[Dict]:
    """Per direction, the worst over ``configs`` of (GPU time of a copy moving the same bytes) / (GPU time
    of the fastest seqpar backend): the copy-bandwidth fraction measured against what a copy of that size
    reaches (bench_layernorm_dropout.same_bytes_copy: provider "device-copy", its config without p) instead
    of the 1 GiB copy's bandwidth, which no kernel of a shard size (256 x 1024: 2 MB) can reach."""
    out = []
    for direction in directions:
        cases = []
        for config in configs:
            best = best_seqpar(table, config, f"{direction}_gpu_ms")
            copy = table.get((re.sub(r",p=[^,]*", "", config), "device-copy", f"{direction}_gpu_ms"))
            if best and copy:
                cases.append((copy / best[0], f"{config} {best[1]}", [(config, best[1])]))
        value, detail = worst([c[:2] for c in cases])
        if cases:
            detail = f"{GPU_DETAIL}: " + detail + _clock_notes(table, cases, direction)
        elif configs:
            detail = "no same-bytes copy rows (bench_layernorm_dropout writes them since 2026-11-26)"
        else:
            detail = "not measured (no GPU rows)"
        out.append(target(f"{op} {direction} vs a copy of the same bytes (copy GPU time / seqpar GPU time)",
                          value, frac_goal, "fraction", ">=", detail))
    return out


def layernorm_targets(rows: List[Dict]) -> List[Dict]:
    table = metric_table(rows)
    configs = sorted({c for c, p, _ in table
                      if "tokens=" in c and p != "device-copy" and int(config_fields(c)["tokens"]) in LN_TOKENS
                      and int(config_fields(c)["h"]) in LN_HIDDEN})
    op = "bias-dropout-add + LayerNorm"
    return require_sweep(fused_row_targets(table, op, configs, LN_PEERS, 0.85, 1.2)
                         + same_bytes_targets(table, op, configs, 0.85),
                         len(configs), len(LN_TOKENS) * len(LN_HIDDEN) * len(DROPOUTS), "(tokens, h, p) configurations")


def llama_ops_targets(rows: List[Dict]) -> List[Dict]:
    """The RMSNorm and SwiGLU targets, each op from its own latest run (:func:`read_csv`); an op whose rows
    are older than the file's latest run (one cut before it, or run for other ops) says so in ``detail``."""
    table = metric_table(rows)
    file_run = max(map(run_key, rows), default=None)
    out = []
    for op in ("rmsnorm", "swiglu"):       # issue 14's bandwidth targets; RoPE is compared with the peers
        configs = sorted({c for c, _, _ in table if config_fields(c).get("op") == op})
        targets = require_sweep(fused_row_targets(table, op, configs, LLAMA_PEERS, 0.85, 1.0), len(configs),
                                LLAMA_SWEEP[op], "sizes")
        op_run = max((run_key(r) for r in rows if part_of(r) == op), default=None)
        if op_run and op_run != file_run:
            date, device, commit = op_run
            older = (f"; from an older run ({date}, commit {commit}"
                     + (f", {device}" if device != file_run[1] else "")
                     + f"): the file's latest ({file_run[0]}, commit {file_run[2]}) has no {op} rows")
            for t in targets:
                t["detail"] += older
        out += targets
    return out


def attention_targets(rows: List[Dict]) -> List[Dict]:
    table = metric_table(rows)
    configs = sorted({c for c, p, m in table if p == "seqpar-triton" and m == "fwdbwd_ms"
                      and int(config_fields(c)["s"]) in ATTN_SEQLENS and int(config_fields(c)["d"]) in ATTN_HEAD_DIMS
                      and config_fields(c).get("causal") == "1"})
    missing = "" if configs else "not measured (no GPU rows)"
    cases = [(table[(c, SDPA_FLASH, "fwdbwd_ms")] / table[(c, "seqpar-triton", "fwdbwd_ms")], c)
             for c in configs if (c, SDPA_FLASH, "fwdbwd_ms") in table]
    value, detail = worst(cases)
    out = [target("attention core fwd+bwd speed vs SDPA flash (SDPA time / seqpar-triton time)", value, 0.9, "x",
                  ">=", missing or detail)]
    # No s^2 term: at a fixed b * s (the benchmark's shapes) the peak of one fwd+bwd beyond the inputs
    # stays flat in s for a flash-style core and grows like s for one that holds [s, s] probabilities.
    growth = []
    groups = defaultdict(dict)
    for c in configs:
        f = config_fields(c)
        peak = table.get((c, "seqpar-triton", "fwdbwd_peak_bytes"))
        if peak is not None:
            groups[(f["d"], f["p"])][int(f["s"])] = peak
    for (d, p), by_s in sorted(groups.items()):
        lo, hi = min(by_s), max(by_s)
        if hi > lo and not by_s[lo] <= 0:       # (a NaN peak passes: worst() names it)
            growth.append((by_s[hi] / by_s[lo] / (hi / lo), f"d={d} p={p}: {by_s[lo] / 2**20:.1f} MiB at s={lo}, "
                           f"{by_s[hi] / 2**20:.1f} MiB at s={hi}"))
    value, detail = worst(growth, lowest=False)
    flat = min(ATTN_SEQLENS) / max(ATTN_SEQLENS)
    out.append(target("attention core peak memory growth vs s at fixed b*s ((peak at the largest s / at the "
                      f"smallest) / (largest s / smallest s): an s^2 term gives 1, flat memory {flat:g})",
                      value, 0.5, "ratio", "<=", missing or detail))
    return require_sweep(out, len(configs), len(ATTN_SEQLENS) * len(ATTN_HEAD_DIMS) * len(DROPOUTS),
                         "(s, d, p) configurations")


def layer_targets(layer: Optional[Dict]) -> List[Dict]:
    rows = {r["experiment"]: r for r in (layer or {}).get("rows", [])}
    missing = "" if rows else "not measured (no GPU layer_bench json)"

    def overhead(name):
        return rows[name]["overhead"] if name in rows else None

    cfg = (layer or {}).get("config", {})
    shape = f"h={cfg.get('hidden')} a={cfg.get('heads')} s={cfg.get('seq_len')} b={cfg.get('batch')} t={cfg.get('tp')}"
    if (layer or {}).get("complete") is False:     # the bench rewrites its json after each experiment
        shape += f" (the run stopped after {len(rows)} of its experiments)"
    out = [target("layer: selective recompute overhead (vs no recompute)", overhead("selective recompute"), 0.03,
                  "fraction", "<=", missing or shape),
           target("layer: full recompute overhead (expected about +33% or worse)", overhead("full recompute"), 0.30,
                  "fraction", ">=", missing or shape)]
    for name, r in rows.items():
        ran = r.get("backends", {}).get("attention_core", "?")
        out.append(target(f"layer {name}: activation bytes / Table 2", r["activation_bytes"] / r["table2_bytes"],
                          1.05, "ratio", "<=", f"{shape}; attention core ran on {ran}"))
    return out


def megatron_targets(rows: List[Dict], layer: Optional[Dict]) -> List[Dict]:
    table = metric_table(rows)
    ours = {r["experiment"]: r for r in (layer or {}).get("rows", [])}
    out = []
    theirs_run = run_meta(rows)
    if theirs_run and layer and (theirs_run["device"], theirs_run["commit"]) != (layer.get("device"), layer.get("commit")):
        why = (f"not comparable: Megatron-Core's rows are from {theirs_run['device']} at {theirs_run['commit']}, "
               f"seqpar's layer bench from {layer.get('device')} at {layer.get('commit')}")
        return [target("layer vs Megatron-Core: time (megatron / seqpar)", None, 1.0, "x", ">=", why),
                target("layer vs Megatron-Core: activation bytes (megatron / seqpar)", None, 1.0, "x", ">=", why)]
    not_applicable = {r["config"]: r["value"] for r in rows if r["metric"] == "not_applicable"}
    for config, provider, metric in sorted(table):
        if metric != "combined_ms":
            continue
        experiment = experiment_of(config, ours)
        if experiment is None:
            continue
        mine = ours[experiment]
        theirs_bytes = table.get((config, provider, "activation_bytes"))
        out.append(target(f"layer {experiment} vs {provider}: time ({provider} / seqpar)",
                          table[(config, provider, "combined_ms")] / mine["combined_ms"], 1.0, "x", ">=", config))
        out.append(target(f"layer {experiment} vs {provider}: activation bytes ({provider} / seqpar)",
                          None if theirs_bytes is None else theirs_bytes / mine["activation_bytes"], 1.0, "x", ">=",
                          config))
    for config, reason in sorted(not_applicable.items()):
        out.append(target(f"Megatron-Core: {config}", None, 1.0, "x", ">=", f"not applicable: {reason}"))
    if not out:
        why = "not measured (no GPU rows of both seqpar's layer bench and bench_megatron_layer)"
        out.append(target("layer vs Megatron-Core: time (megatron / seqpar)", None, 1.0, "x", ">=", why))
        out.append(target("layer vs Megatron-Core: activation bytes (megatron / seqpar)", None, 1.0, "x", ">=", why))
    return out


def gemm_targets(rows: List[Dict]) -> List[Dict]:
    table = metric_table(r for r in rows if r.get("part") == "gemm")
    out = []
    for model in GEMM_MODELS:
        cases = [(v, f"{c} {p}") for (c, p, m), v in table.items()
                 if m == "throughput_vs_plain" and c.split()[0] == model and p == GEMM_CHUNKING]
        value, detail = worst(cases)
        if cases:   # bench_overlap times with the device time since it writes call_ms beside it
            clock = GPU_DETAIL if any(m == "call_ms" for _, _, m in table) else (
                "eager call time, one call at a time (rows before the device-time metric: the chunks' launches "
                "included)")
            detail = f"{clock}: {detail}"
        out.append(target(f"chunked GEMM throughput vs unchunked, {model} shapes (t = 8 row chunks)", value, 0.95,
                          "fraction", ">=", detail))
    return out


def profiles(rows: List[Dict]) -> Dict[str, Dict[str, List[Dict]]]:
    """Per case of profile_kernels.csv, from each tool's latest GPU run: ``ncu``, one entry per kernel
    launch (bench.profile_kernels.NCU_TABLE: duration in us, DRAM and SM throughput and achieved
    occupancy in % of peak, registers per thread); ``torch``, the kernels by device time (slowest
    first, at most 8: ``device_us``, ``calls``)."""
    from bench.profile_kernels import launch_table, ncu_parsed

    by_tool = defaultdict(list)
    for r in rows:
        by_tool[r["tool"]].append(r)
    ncu, torch_times = defaultdict(list), defaultdict(lambda: defaultdict(dict))
    for r in latest_run(by_tool["ncu"]):
        ncu[r["case"]].append(ncu_parsed(r["kernel"], r["metric"], r["value"]))
    for r in latest_run(by_tool["torch"]):
        torch_times[r["case"]][r["kernel"]][r["metric"]] = float(r["value"])
    out: Dict[str, Dict[str, List[Dict]]] = defaultdict(dict)
    for case, parsed in ncu.items():
        out[case]["ncu"] = [{k: round(v, 2) if isinstance(v, float) else v for k, v in launch.items()}
                            for launch in launch_table(parsed)]
    for case, kernels in torch_times.items():
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1].get("device_us", 0.0))[:8]
        out[case]["torch"] = [dict(kernel=kernel, **metrics) for kernel, metrics in ranked]
    return dict(out)


def summarize(folder: str) -> Dict:
    """{"device", "commit", "date", "runs", "targets", "profiles"} from the rows in ``folder``."""
    files = {name: read_csv(os.path.join(folder, f"{name}.csv")) for name in
             ("bench_layernorm_dropout", "bench_attention", "bench_megatron_layer", "bench_overlap", "bench_llama_ops")}
    layer = read_layer_json(folder)
    runs = {name: run_meta(rows) for name, rows in files.items()}
    runs["layer_bench"] = {k: layer[k] for k in ("device", "date", "commit")} if layer else None
    targets = (layernorm_targets(files["bench_layernorm_dropout"]) + attention_targets(files["bench_attention"])
               + layer_targets(layer) + megatron_targets(files["bench_megatron_layer"], layer)
               + gemm_targets(files["bench_overlap"]) + llama_ops_targets(files["bench_llama_ops"]))
    measured = [m for m in runs.values() if m]

    def joined(key):
        return ", ".join(sorted({m[key] for m in measured})) or None

    return dict(device=joined("device"), commit=joined("commit"),
                date=max((m["date"] for m in measured), default=None), runs=runs, targets=targets,
                profiles=profiles(read_rows(os.path.join(folder, "profile_kernels.csv"))))


# ----------------------------------------------------------------------------- plots
def _axes(columns: int, width: float = 6.5, height: float = 4.5):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * columns, height), layout="constrained")
    axes = fig.subplots(1, columns)
    return fig, (list(axes) if columns > 1 else [axes])


def _bars(ax, configs: List[str], providers: List[str], values: Dict[Tuple[str, str], float]) -> None:
    width = 0.8 / max(1, len(providers))
    for i, provider in enumerate(providers):
        xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(configs))]
        ax.bar(xs, [values.get((c, provider), 0.0) for c in configs], width, label=provider)
    ax.set_xticks(range(len(configs)), configs, rotation=60, ha="right", fontsize=6)
    ax.legend(fontsize=7)


def plot_fused_rows(rows: List[Dict], title: str, path: str, goal: float) -> bool:
    """Fraction of copy bandwidth per configuration and provider: forward and backward, from the GPU time
    when the rows have it (else the eager call time, as the panel titles say)."""
    table = metric_table(rows)
    configs = sorted({c for c, p, _ in table if p != "device-copy"},
                     key=lambda c: [int(v) if v.isdigit() else v for v in config_fields(c).values()])
    if not configs:
        return False
    providers = sorted({p for _, p, _ in table if p != "device-copy"})
    clock = GPU_CLOCK if any(m.endswith("_gpu_frac_copy") for _, _, m in table) else CALL_CLOCK
    fig, axes = _axes(2, width=9)
    for ax, direction in zip(axes, ("fwd", "bwd")):
        _bars(ax, [c.replace(",dtype=bfloat16", "") for c in configs], providers,
              {(c.replace(",dtype=bfloat16", ""), p): v for (c, p, m), v in table.items()
               if m == f"{direction}{clock}_frac_copy"})
        ax.axhline(goal, color="tab:red", ls="--", lw=1)
        ax.set_ylabel("fraction of device-to-device copy bandwidth")
        what = "GPU time, back-to-back calls" if clock == GPU_CLOCK else "eager call time, launch overhead included"
        ax.set_title(f"{direction}, {what} (target {goal:g}, dashed)")
    fig.suptitle(f"{title}: {rows[0]['device']}, {rows[0]['commit']}, {rows[0]['date']}", fontsize=9)
    fig.savefig(path, dpi=110)
    return True


def plot_attention(rows: List[Dict], path: str) -> bool:
    """fwd+bwd TFLOP/s against s per provider (one panel per head dim), and seqpar's peak memory."""
    table = metric_table(rows)
    if not table:
        return False
    dims = sorted({int(config_fields(c)["d"]) for c, _, m in table if m == "fwdbwd_tflops"})
    fig, axes = _axes(len(dims) + 1)
    for ax, d in zip(axes, dims):
        lines = defaultdict(list)
        for (c, p, m), v in table.items():
            f = config_fields(c)
            if m == "fwdbwd_tflops" and int(f["d"]) == d:
                lines[(p, f["p"])].append((int(f["s"]), v))
        for (provider, p), points in sorted(lines.items()):
            points.sort()
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", ls="-" if float(p) == 0 else "--",
                    label=f"{provider} p={p}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length s (b * s fixed)")
        ax.set_ylabel("fwd+bwd TFLOP/s")
        ax.set_title(f"causal attention, d={d}")
        ax.legend(fontsize=6)
    peak = axes[-1]
    lines = defaultdict(list)
    for (c, p, m), v in table.items():
        if m == "fwdbwd_peak_bytes":
            f = config_fields(c)
            lines[(p, f["d"], f["p"])].append((int(f["s"]), v / 2**20))
    for key, points in sorted(lines.items()):
        points.sort()
        peak.plot([s for s, _ in points], [v for _, v in points], marker="o", label="{} d={} p={}".format(*key))
    peak.set_xscale("log", base=2)
    peak.set_xlabel("sequence length s (b * s fixed)")
    peak.set_ylabel("peak MiB of one fwd+bwd beyond inputs and grads")
    peak.set_title("memory (flat: no s^2 term)")
    if lines:
        peak.legend(fontsize=6)
    fig.suptitle(f"attention core: {rows[0]['device']}, {rows[0]['commit']}, {rows[0]['date']}", fontsize=9)
    fig.savefig(path, dpi=110)
    return True


def plot_megatron(rows: List[Dict], layer: Optional[Dict], path: str) -> bool:
    """seqpar's and Megatron-Core's layer side by side: fwd+bwd time and activation bytes per experiment."""
    table = metric_table(rows)
    if not layer or not table:
        return False
    experiments = [r["experiment"] for r in layer["rows"]]
    fig, axes = _axes(2)
    for ax, metric, scale, label in ((axes[0], "combined_ms", 1.0, "fwd+bwd ms (median)"),
                                     (axes[1], "activation_bytes", 2**-20, "activation MiB")):
        values = {(e, "seqpar"): r[metric] * scale for e, r in zip(experiments, layer["rows"])}
        for (c, p, m), v in table.items():
            e = experiment_of(c, experiments)
            if m == metric and e:
                values[(e, p)] = v * scale
        _bars(ax, experiments, ["seqpar"] + sorted({p for (_, p) in values if p != "seqpar"}), values)
        ax.set_ylabel(label)
    fig.suptitle(f"one 22B layer, seqpar vs Megatron-Core: {rows[0]['device']}, {rows[0]['commit']}", fontsize=9)
    fig.savefig(path, dpi=110)
    return True


def plot_gemm(rows: List[Dict], path: str) -> bool:
    """Chunked / unchunked GEMM throughput per linear and pass."""
    table = metric_table(r for r in rows if r.get("part") == "gemm")
    points = sorted((c, v) for (c, p, m), v in table.items() if m == "throughput_vs_plain" and p == GEMM_CHUNKING)
    if not points:
        return False
    fig, (ax,) = _axes(1, width=10)
    ax.bar(range(len(points)), [v for _, v in points], color="tab:blue")
    ax.axhline(0.95, color="tab:red", ls="--", lw=1, label="target 0.95")
    ax.set_xticks(range(len(points)), [c.split(" [")[0] for c, _ in points], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("chunked throughput / unchunked")
    ax.legend(fontsize=7)
    gemm = run_meta([r for r in rows if r.get("part") == "gemm"])
    fig.suptitle(f"GEMMs in t = 8 row chunks: {gemm['device']}, {gemm['commit']}", fontsize=9)
    fig.savefig(path, dpi=110)
    return True


def draw_plots(folder: str, out: str) -> List[str]:
    """One PNG per benchmark that has GPU rows; returns the paths written."""
    from seqpar.bench.plots import plot_bench

    written = []

    def rows_of(name):
        return read_csv(os.path.join(folder, f"{name}.csv"))

    layer = read_layer_json(folder)
    jobs = [("gpu_layernorm.png", lambda p: plot_fused_rows(rows_of("bench_layernorm_dropout"),
                                                            "bias-dropout-add + LayerNorm", p, 0.85)),
            ("gpu_llama_ops.png", lambda p: plot_fused_rows(rows_of("bench_llama_ops"), "Llama ops", p, 0.85)),
            ("gpu_attention.png", lambda p: plot_attention(rows_of("bench_attention"), p)),
            ("gpu_megatron_layer.png", lambda p: plot_megatron(rows_of("bench_megatron_layer"), layer, p)),
            ("gpu_overlap_gemm.png", lambda p: plot_gemm(rows_of("bench_overlap"), p))]
    if layer:
        jobs.append(("gpu_layer_bench.png", lambda p: plot_bench(
            layer["rows"], f"seqpar bench --device cuda: {layer['device']}, {layer['commit']}", p) or True))
    for name, draw in jobs:
        path = os.path.join(out, name)
        if draw(path):
            written.append(path)
    return written


def format_targets(summary: Dict) -> str:
    from bench.profile_kernels import short_kernel_name   # the ncu table's (the JSON keeps the full names)

    lines = [f"# {summary['device']}  commit {summary['commit']}  {summary['date']}"]
    for t in summary["targets"]:
        state = {True: "met ", False: "MISS", None: "----"}[t["met"]]
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        lines.append(f"{state} {t['name']}: {value} (goal {t['compare']} {t['goal']:g} {t['unit']}); {t['detail']}")
    for case, tools in summary.get("profiles", {}).items():
        for launch in tools.get("ncu", []):
            cells = ", ".join(f"{k} {v:g}" for k, v in launch.items() if k != "kernel" and v is not None)
            lines.append(f"profile {case}: {short_kernel_name(launch['kernel'])}: {cells}")
        if "ncu" not in tools:
            lines += [f"profile {case}: {short_kernel_name(k['kernel'])}: {k.get('device_us', 0):.0f} us "
                      f"({k.get('calls', 0):g} calls)"
                      for k in tools.get("torch", [])[:3]]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=os.path.join(ROOT, "bench", "results"), help="folder with the result rows")
    ap.add_argument("--out", default=None, help="folder for gpu_summary.json and the PNGs (default: --rows)")
    ap.add_argument("--no-plots", action="store_true", help="write the JSON only (no matplotlib needed)")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.rows):
        ap.error(f"--rows {args.rows!r} is not a folder")
    out = args.out or args.rows
    summary = summarize(args.rows)
    path = os.path.join(out, "gpu_summary.json")
    try:
        os.makedirs(out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
    except OSError as exc:   # a folder that can't be made or written: one line, not a traceback
        print(f"{os.path.basename(__file__)}: error: --out {out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(format_targets(summary))
    print(f"wrote {path}")
    if not args.no_plots:
        for png in draw_plots(args.rows, out):
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
