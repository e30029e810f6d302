"""bench/gpu_summary.py: the issue-10 targets computed from hand-made result rows (written by the same
ResultRows the benchmarks use, configs spelled as the benchmarks spell them), every expected value worked
out here by hand: which rows count (GPU, latest run), worst cases over the sweeps, ratios, and the
"not measured" entries when a file is missing."""
import json
import math

import pytest

from bench import gpu_summary as S
from seqpar.bench.results import ResultRows

H100 = "NVIDIA H100 80GB HBM3"


def write_rows(folder, name, rows, device=H100, date="2026-12-01T10:00:00", commit="abc1234", columns=None):
    """Append ``rows`` (tuples in ``columns`` order) to ``folder/name.csv`` as one run."""
    out = ResultRows(device, name, columns or ("config", "provider", "metric", "value"))
    out.meta.update(date=date, commit=commit)
    for row in rows:
        out.add(*row)
    out.write(str(folder))


def by_name(summary, fragment):
    found = [t for t in summary["targets"] if fragment in t["name"]]
    assert len(found) == 1, [t["name"] for t in summary["targets"]]
    return found[0]


def ln_rows(config, ms, copy_gbps=3000.0, nbytes=1e9, clock=""):
    """fwd / bwd / fwdbwd rows of each provider in ``ms`` ({provider: (fwd, bwd, fwdbwd)}), with the
    copy fraction derived from the time the way the benchmark derives it (bytes / time / copy); ``clock``
    "_gpu" writes the GPU-time metrics ({d}_gpu_ms, {d}_gpu_frac_copy) instead of the call time's."""
    rows = []
    for provider, times in ms.items():
        for direction, t in zip(("fwd", "bwd", "fwdbwd"), times):
            rows.append((config, provider, f"{direction}{clock}_ms", t))
            rows.append((config, provider, f"{direction}{clock}_frac_copy", nbytes / (t * 1e-3) / 1e9 / copy_gbps))
    return rows


def test_only_the_latest_gpu_run_counts(tmp_path):
    cfg = "tokens=256,h=1024,p=0.0,dtype=bfloat16"
    write_rows(tmp_path, "bench_layernorm_dropout", ln_rows(cfg, {"seqpar-triton": (1.0, 1.0, 1.0)}),
               device="cpu", date="2026-12-09T00:00:00")
    write_rows(tmp_path, "bench_layernorm_dropout", ln_rows(cfg, {"seqpar-triton": (2.0, 2.0, 2.0)}),
               date="2026-12-01T00:00:00", commit="old")
    write_rows(tmp_path, "bench_layernorm_dropout", ln_rows(cfg, {"seqpar-triton": (4.0, 4.0, 4.0)}),
               date="2026-12-02T00:00:00", commit="new")
    rows = S.read_csv(str(tmp_path / "bench_layernorm_dropout.csv"))
    assert {r["commit"] for r in rows} == {"new"}
    assert {float(r["value"]) for r in rows if r["metric"] == "fwd_ms"} == {4.0}
    summary = S.summarize(str(tmp_path))
    assert summary["runs"]["bench_layernorm_dropout"] == dict(device=H100, date="2026-12-02T00:00:00", commit="new")
    # 1e9 bytes in 4 ms = 250 GB/s = 1/12 of a 3000 GB/s copy
    assert by_name(summary, "LayerNorm fwd: fraction")["value"] == pytest.approx(250 / 3000, abs=1e-4)
    # a later run cut off before its first configuration (only the copy ceiling) hides nothing
    write_rows(tmp_path, "bench_layernorm_dropout", [("bytes=1073741824", "device-copy", "copy_gbps", 3000.0)],
               date="2026-12-03T00:00:00", commit="cut")
    assert {r["commit"] for r in S.read_csv(str(tmp_path / "bench_layernorm_dropout.csv"))} == {"new"}


def test_layernorm_targets_take_the_fastest_seqpar_backend_and_the_worst_configuration(tmp_path):
    small, large = "tokens=256,h=1024,p=0.1,dtype=bfloat16", "tokens=16384,h=12288,p=0.0,dtype=bfloat16"
    rows = (ln_rows(small, {"seqpar-triton": (0.5, 1.0, 1.5), "seqpar-cuda": (0.4, 1.2, 1.6),
                            "seqpar-torch": (0.1, 0.1, 0.1),       # the reference is no kernel: never "seqpar"
                            "torch-compile": (0.6, 1.4, 2.0), "liger-ln": (0.5, 1.0, 1.8)})
            + ln_rows(large, {"seqpar-triton": (0.5, 0.8, 1.2), "seqpar-cuda": (0.6, 0.9, 1.5),
                              "torch-compile": (0.7, 1.3, 1.2)})
            # outside the sweep (tokens = 64): plotted, never a target
            + ln_rows("tokens=64,h=1024,p=0.0,dtype=bfloat16", {"seqpar-triton": (9.0, 9.0, 9.0),
                                                                  "torch-compile": (0.1, 0.1, 0.1)}))
    rows.append(("bytes=1000", "device-copy", "copy_gbps", 3000.0))
    write_rows(tmp_path, "bench_layernorm_dropout", rows)
    summary = S.summarize(str(tmp_path))
    frac = 1e9 / 1e-3 / 1e9 / 3000.0                  # the fraction at 1 ms
    fwd = by_name(summary, "LayerNorm fwd: fraction")
    # fastest fwd: cuda 0.4 ms (small), triton 0.5 ms (large): the worst is the large one at 0.5 ms
    assert fwd["value"] == pytest.approx(frac / 0.5, abs=1e-4) and fwd["met"] is False
    assert "tokens=16384" in fwd["detail"] and "seqpar-triton" in fwd["detail"] and "2 configurations" in fwd["detail"]
    bwd = by_name(summary, "LayerNorm bwd: fraction")
    assert bwd["value"] == pytest.approx(frac / 1.0, abs=1e-4) and "tokens=256" in bwd["detail"]
    # vs torch.compile, per config compile / fastest seqpar fwd+bwd: small 2.0 / 1.5, large 1.2 / 1.2
    compiled = by_name(summary, "LayerNorm fwd+bwd speed vs torch-compile")
    assert compiled["value"] == pytest.approx(1.0) and compiled["goal"] == 1.2 and compiled["met"] is False
    liger = by_name(summary, "fwd+bwd speed vs liger-ln")          # measured on the small config only
    # met on 2 of the 18 configurations of the sweep: not known to be met (test_a_cut_sweep_...)
    assert liger["value"] == pytest.approx(1.8 / 1.5, abs=1e-4) and liger["met"] is None
    assert "1 configurations" in liger["detail"]
    apex = by_name(summary, "fwd+bwd speed vs apex-ln")
    assert apex["value"] is None and apex["met"] is None and "did not run" in apex["detail"]
    # rows without GPU-time metrics: the kernel targets fall back to the call time and say so; the call-time
    # entries carry the same values under their own names
    assert "predate the GPU-time metric fwd_gpu_ms" in fwd["detail"]
    call_fwd = by_name(summary, "LayerNorm fwd, eager call time (launch overhead included): fraction")
    assert call_fwd["value"] == fwd["value"] and "predate" not in call_fwd["detail"]
    call_compiled = by_name(summary, "LayerNorm fwd+bwd, eager call time (launch overhead included): speed vs "
                                     "torch-compile")
    assert call_compiled["value"] == pytest.approx(1.0) and call_compiled["goal"] == 1.2


def test_kernel_targets_read_the_gpu_time_and_the_call_time_stays_beside_them(tmp_path):
    """Rows of both clocks: launch-bound call times (every provider ~0.1 ms per call) and GPU times that
    differ. The bandwidth and peer targets read the GPU time; the call-time entries keep the call time;
    the GPU time's checks (a drained queue, data reused within 2 L2 sizes) are named in the detail."""
    small, large = "tokens=256,h=1024,p=0.1,dtype=bfloat16", "tokens=16384,h=4096,p=0.0,dtype=bfloat16"
    call = {"seqpar-triton": (0.1, 0.2, 0.3), "seqpar-cuda": (0.12, 0.25, 0.35), "torch-compile": (0.08, 0.15, 0.24),
            "liger-ln": (0.1, 0.3, 0.36)}
    rows = ln_rows(small, call) + ln_rows(large, {p: (10 * a, 10 * b, 10 * c) for p, (a, b, c) in call.items()})
    rows += ln_rows(small, {"seqpar-triton": (0.4, 0.8, 1.2), "seqpar-cuda": (0.5, 0.6, 1.1),
                            "torch-compile": (0.6, 1.2, 1.65), "liger-ln": (0.5, 1.0, 1.5)}, clock="_gpu")
    rows += ln_rows(large, {"seqpar-triton": (1.0, 2.0, 3.0), "seqpar-cuda": (1.25, 2.5, 3.75),
                            "torch-compile": (1.5, 2.4, 3.9), "liger-ln": (1.0, 4.0, 5.0)}, clock="_gpu")
    rows += [(small, p, f"{d}_gpu_queue_full", 1.0) for p in call for d in ("fwd", "bwd", "fwdbwd")]
    rows += [(large, p, f"{d}_gpu_queue_full", 0.5 if p == "torch-compile" else 1.0) for p in call
             for d in ("fwd", "bwd", "fwdbwd")]
    rows += [(small, p, f"{d}_gpu_l2_reuse", 2.0) for p in call for d in ("fwd", "bwd", "fwdbwd")]
    rows += [(large, p, "fwd_gpu_l2_reuse", 1.5) for p in call]           # (as if the rotation were capped)
    write_rows(tmp_path, "bench_layernorm_dropout", rows)
    summary = S.summarize(str(tmp_path))
    frac = 1e9 / 1e-3 / 1e9 / 3000.0                  # the fraction at 1 ms
    fwd = by_name(summary, "LayerNorm fwd: fraction")
    # GPU time: fastest fwd 0.4 (small, triton), 1.0 (large, triton): the worst is large
    assert fwd["value"] == pytest.approx(frac / 1.0, abs=1e-4) and "tokens=16384" in fwd["detail"]
    assert fwd["detail"].startswith("GPU time") and "predate" not in fwd["detail"]
    assert "1 of 2 measurements reuse their data after less than 2 L2 sizes" in fwd["detail"]
    assert "drained" not in fwd["detail"]
    bwd = by_name(summary, "LayerNorm bwd: fraction")  # fastest bwd: cuda 0.6 (small), triton 2.0 (large)
    assert bwd["value"] == pytest.approx(frac / 2.0, abs=1e-4) and "L2" not in bwd["detail"]
    # vs torch-compile, GPU time: small 1.65 / 1.1 = 1.5, large 3.9 / 3.0 = 1.3; the large one drained
    compiled = by_name(summary, "LayerNorm fwd+bwd speed vs torch-compile")
    assert compiled["value"] == pytest.approx(1.3) and compiled["met"] is None   # a partial sweep
    assert "drained in some batches of 1 of 4 measurements" in compiled["detail"]
    liger = by_name(summary, "LayerNorm fwd+bwd speed vs liger-ln")     # small 1.5 / 1.1, large 5 / 3
    assert liger["value"] == pytest.approx(1.5 / 1.1, abs=1e-4) and liger["met"] is None   # partial sweep
    # the call-time entries: fastest call fwd 0.1 ms (small) and 1.0 ms (large); compile 0.24 / 0.3 in both
    call_fwd = by_name(summary, "LayerNorm fwd, eager call time (launch overhead included): fraction")
    assert call_fwd["value"] == pytest.approx(frac / 1.0, abs=1e-4) and "GPU time" not in call_fwd["detail"]
    call_name = "LayerNorm fwd+bwd, eager call time (launch overhead included): speed vs "
    call_compiled = by_name(summary, call_name + "torch-compile")
    assert call_compiled["value"] == pytest.approx(0.8) and call_compiled["met"] is False
    assert by_name(summary, call_name + "liger-ln")["value"] == pytest.approx(1.2)


def test_layernorm_bandwidth_against_a_copy_of_the_same_bytes(tmp_path):
    """The same-bytes entries: per config, the copy's GPU time (its config without p) over the fastest
    seqpar backend's GPU time, worst case over the sweep; none where no copy rows were written."""
    small, large = "tokens=256,h=1024,p=0.1,dtype=bfloat16", "tokens=16384,h=4096,p=0.0,dtype=bfloat16"
    rows = ln_rows(small, {"seqpar-triton": (0.004, 0.010, 0.014), "seqpar-cuda": (0.005, 0.008, 0.013)},
                   clock="_gpu")
    rows += ln_rows(large, {"seqpar-triton": (0.20, 0.40, 0.60), "seqpar-cuda": (0.25, 0.30, 0.55)}, clock="_gpu")
    copy = {"tokens=256,h=1024,dtype=bfloat16": (0.003, 0.006), "tokens=16384,h=4096,dtype=bfloat16": (0.17, 0.21)}
    for config, (fwd, bwd) in copy.items():
        rows += [(config, "device-copy", "fwd_gpu_ms", fwd), (config, "device-copy", "bwd_gpu_ms", bwd),
                 (config, "device-copy", "fwdbwd_gpu_ms", fwd + bwd)]
    write_rows(tmp_path, "bench_layernorm_dropout", rows)
    summary = S.summarize(str(tmp_path))
    # fwd: small 0.003 / 0.004 (triton) = 0.75, large 0.17 / 0.20 = 0.85: the worst is the small one
    fwd = by_name(summary, "LayerNorm fwd vs a copy of the same bytes")
    assert fwd["value"] == pytest.approx(0.75) and fwd["met"] is False and fwd["goal"] == 0.85
    assert "tokens=256" in fwd["detail"] and "seqpar-triton" in fwd["detail"] and "2 configurations" in fwd["detail"]
    # bwd: small 0.006 / 0.008 (cuda) = 0.75, large 0.21 / 0.30 = 0.7: the large one
    bwd = by_name(summary, "LayerNorm bwd vs a copy of the same bytes")
    assert bwd["value"] == pytest.approx(0.7) and "tokens=16384" in bwd["detail"] and "seqpar-cuda" in bwd["detail"]
    # the copy rows are not a configuration of the sweep: the 1 GiB fraction still counts 2
    assert "2 configurations" in by_name(summary, "LayerNorm fwd: fraction")["detail"]

    older = tmp_path / "older"
    older.mkdir()
    write_rows(older, "bench_layernorm_dropout", [r for r in rows if r[1] != "device-copy"])
    none = by_name(S.summarize(str(older)), "LayerNorm fwd vs a copy of the same bytes")
    assert none["value"] is None and none["met"] is None and "no same-bytes copy rows" in none["detail"]


def test_attention_targets_speed_vs_flash_and_the_s_squared_term(tmp_path):
    rows = []
    # b * s = 16384 fixed: a flash-style core's extra memory is flat in s, a stored [s, s] one grows like s
    for s, ours, flash, peak in ((1024, 2.0, 1.8, 64.0), (2048, 2.2, 2.2, 66.0), (4096, 2.6, 2.4, 70.0)):
        cfg = f"b={16384 // s} H=16 s={s} d=128 causal=1 p=0.1 bf16"
        rows += [(cfg, "seqpar-triton", "fwdbwd_ms", ours), (cfg, "torch-sdpa-flash", "fwdbwd_ms", flash),
                 (cfg, "seqpar-triton", "fwdbwd_peak_bytes", peak * 2**20)]
        cfg0 = f"b={16384 // s} H=16 s={s} d=64 causal=1 p=0.0 bf16"
        rows += [(cfg0, "seqpar-triton", "fwdbwd_ms", 1.0), (cfg0, "torch-sdpa-flash", "fwdbwd_ms", 1.0),
                 (cfg0, "seqpar-triton", "fwdbwd_peak_bytes", 2**20 * s / 64)]        # grows like s
    rows.append(("b=4 H=16 s=4096 d=128 causal=0 p=0.0 bf16", "seqpar-triton", "fwdbwd_ms", 100.0))  # not causal
    write_rows(tmp_path, "bench_attention", rows)
    summary = S.summarize(str(tmp_path))
    speed = by_name(summary, "vs SDPA flash")
    assert speed["value"] == pytest.approx(1.8 / 2.0) and speed["met"] is None   # 0.9 >= 0.9, on a partial sweep
    assert "incomplete sweep" in speed["detail"]
    assert "s=1024 d=128" in speed["detail"] and "6 configurations" in speed["detail"]
    growth = by_name(summary, "peak memory growth")
    # d=64: (64 / 16) / (4096 / 1024) = 1, the worst; d=128: (70 / 64) / 4 = 0.27
    assert growth["value"] == pytest.approx(1.0) and growth["met"] is False and "d=64" in growth["detail"]


def test_layer_megatron_and_gemm_targets(tmp_path):
    experiments = [("no recompute", 10.0, 0.0, 1000.0), ("selective recompute", 10.2, 0.02, 600.0),
                   ("full recompute", 13.5, 0.35, 100.0)]
    layer = dict(device=H100, date="2026-12-01T10:00:00", commit="abc1234",
                 config=dict(hidden=6144, heads=64, seq_len=2048, batch=4, tp=1),
                 rows=[dict(experiment=e, combined_ms=ms, overhead=o, activation_bytes=a, table2_bytes=1000.0,
                            backends={"attention_core": "cuda"}) for e, ms, o, a in experiments])
    (tmp_path / "layer_bench_gpu.json").write_text(json.dumps(layer))
    # an older run under the older name does not win over it
    (tmp_path / "layer_bench.json").write_text(json.dumps(dict(layer, date="2026-11-25", rows=[])))
    shape = "s2048 b4 h6144 a64 t1 bf16 p0.1"
    write_rows(tmp_path, "bench_megatron_layer", [
        (f"{shape} no recompute", "megatron-core-0.16.1", "combined_ms", 12.0),
        (f"{shape} no recompute", "megatron-core-0.16.1", "activation_bytes", 1500.0),
        (f"{shape} selective recompute", "megatron-core-0.16.1", "combined_ms", 9.18),
        (f"{shape} selective recompute", "megatron-core-0.16.1", "activation_bytes", 600.0),
        (f"{shape} sequence parallel", "megatron-core-0.16.1", "not_applicable",
         "sequence parallelism needs TP > 1"),
    ])
    write_rows(tmp_path, "bench_overlap", [
        ("gemm", "22B qkv fwd [8192x6144]@[6144x2304]", "chunked x8", "throughput_vs_plain", 0.97),
        ("gemm", "22B fc2 dgrad [8192x6144]@[6144x3072]", "chunked x8", "throughput_vs_plain", 0.93),
        ("gemm", "175B qkv fwd [2048x12288]@[12288x4608]", "chunked x8", "throughput_vs_plain", 0.99),
        # the other chunkings bench_overlap times beside it are not what the overlapped path runs: ignored
        ("gemm", "175B qkv fwd [2048x12288]@[12288x4608]", "chunked x4", "throughput_vs_plain", 0.5),
        ("gemm", "175B qkv fwd [2048x12288]@[12288x4608]", "chunked x8 on 2 streams", "throughput_vs_plain", 0.6),
        ("gemm", "175B qkv fwd [2048x12288]@[12288x4608]", "plain", "ms", 1.0),
        ("gloo", "t=2 layer", "overlapped", "speedup_vs_plain_median", 0.5),     # another part: ignored
    ], columns=("part", "config", "provider", "metric", "value"))
    summary = S.summarize(str(tmp_path))
    selective = by_name(summary, "selective recompute overhead")
    assert selective["value"] == pytest.approx(0.02) and selective["met"] is True
    assert "h=6144 a=64 s=2048 b=4 t=1" in selective["detail"]
    assert by_name(summary, "full recompute overhead")["met"] is True
    assert by_name(summary, "layer no recompute: activation bytes")["value"] == pytest.approx(1.0)
    # "selective recompute" vs Megatron: 9.18 / 10.2 = 0.9 (slower than Megatron), bytes 600 / 600
    time_sel = by_name(summary, "layer selective recompute vs megatron-core-0.16.1: time")
    assert time_sel["value"] == pytest.approx(0.9) and time_sel["met"] is False
    assert by_name(summary, "layer no recompute vs megatron-core-0.16.1: activation")["value"] == pytest.approx(1.5)
    na = by_name(summary, "Megatron-Core: " + shape + " sequence parallel")
    assert na["value"] is None and "needs TP > 1" in na["detail"]
    g22 = by_name(summary, "22B shapes")
    assert g22["value"] == pytest.approx(0.93) and g22["met"] is False and "fc2 dgrad" in g22["detail"]
    assert by_name(summary, "175B shapes")["met"] is True


def test_a_layer_run_stopped_part_way_gives_what_it_measured(tmp_path):
    """``python -m seqpar bench --json`` rewrites the file after each experiment ("complete": false)."""
    rows = [dict(experiment=e, combined_ms=10.0, overhead=0.0, activation_bytes=900.0, table2_bytes=1000.0)
            for e in ("no recompute", "sequence parallel")]
    (tmp_path / "layer_bench_gpu.json").write_text(json.dumps(dict(
        device=H100, date="2026-12-01", commit="abc1234", complete=False, rows=rows,
        config=dict(hidden=6144, heads=64, seq_len=2048, batch=4, tp=1))))
    summary = S.summarize(str(tmp_path))
    selective = by_name(summary, "selective recompute overhead")
    assert selective["value"] is None and selective["met"] is None
    assert "stopped after 2 of its experiments" in selective["detail"]
    assert by_name(summary, "layer sequence parallel: activation bytes")["value"] == pytest.approx(0.9)


def test_missing_rows_list_every_target_as_not_measured(tmp_path):
    summary = S.summarize(str(tmp_path))
    assert summary["device"] is None and summary["date"] is None
    assert all(v is None for v in summary["runs"].values())
    names = [t["name"] for t in summary["targets"]]
    for fragment in ("LayerNorm fwd", "LayerNorm bwd", "LayerNorm fwd+bwd speed vs torch-compile", "vs liger-ln",
                     "LayerNorm bwd vs a copy of the same bytes",
                     "LayerNorm fwd, eager call time (launch overhead included)", "rmsnorm fwd+bwd, eager call time",
                     "vs SDPA flash", "peak memory growth", "selective recompute overhead", "Megatron-Core", "22B shapes",
                     "175B shapes", "rmsnorm fwd", "swiglu bwd"):
        assert any(fragment in n for n in names), (fragment, names)
    for t in summary["targets"]:
        assert t["value"] is None and t["met"] is None and t["detail"], t


def test_cli_writes_the_summary_and_a_plot_per_benchmark(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    cfg = "tokens=1024,h=4096,p=0.1,dtype=bfloat16"
    write_rows(tmp_path, "bench_layernorm_dropout", ln_rows(cfg, {"seqpar-triton": (0.5, 1.0, 1.5),
                                                                   "torch-compile": (0.9, 2.0, 2.9)}))
    write_rows(tmp_path, "bench_attention", [("b=8 H=16 s=2048 d=128 causal=1 p=0.0 bf16", p, m, v)
                                             for p in ("seqpar-triton", "torch-sdpa-flash")
                                             for m, v in (("fwdbwd_ms", 2.0), ("fwdbwd_tflops", 300.0))])
    rms = "op=rmsnorm,tokens=16384,h=4096,dtype=bfloat16"            # both clocks: the plot draws the GPU time
    write_rows(tmp_path, "bench_llama_ops", ln_rows(rms, {"seqpar-cuda": (0.6, 1.0, 1.6)})
               + ln_rows(rms, {"seqpar-cuda": (0.5, 0.9, 1.4)}, clock="_gpu"))
    out = tmp_path / "summary"
    assert S.main(["--rows", str(tmp_path), "--out", str(out)]) == 0
    summary = json.loads((out / "gpu_summary.json").read_text())
    assert summary["device"] == H100 and summary["commit"] == "abc1234"
    compiled = by_name(summary, "LayerNorm fwd+bwd speed vs torch-compile")
    assert compiled["value"] == pytest.approx(2.9 / 1.5, abs=1e-4) and compiled["met"] is None   # partial sweep
    assert all(set(t) >= {"name", "value", "goal", "unit", "met"} for t in summary["targets"])
    assert sorted(p.name for p in out.glob("*.png")) == ["gpu_attention.png", "gpu_layernorm.png", "gpu_llama_ops.png"]
    rms_fwd = by_name(summary, "rmsnorm fwd: fraction")                 # from the GPU time 0.5 ms, not 0.6
    assert rms_fwd["value"] == pytest.approx(1e9 / 0.5e-3 / 1e9 / 3000.0, abs=1e-4)
    printed = capsys.readouterr().out
    assert "---- bias-dropout-add + LayerNorm fwd+bwd speed vs torch-compile" in printed
    assert "---- " in printed                          # the targets nobody measured are listed too


def test_target_rejects_non_finite_values():
    t = S.target("x", math.inf, 1.0, "x", ">=", "d")
    assert t["value"] is None and t["met"] is None


def test_profiles_give_each_case_its_kernels_from_each_tools_latest_run(tmp_path):
    columns = ("case", "tool", "kernel", "metric", "value")
    sol, occ = "GPU Speed Of Light Throughput", "Occupancy"
    write_rows(tmp_path, "profile_kernels", [
        ("attn-a", "ncu", "0 _attn_fwd_kernel", f"{sol}: Duration [msecond]", "9.0")],
        date="2026-12-01T09:00:00", columns=columns)                         # an older ncu run: ignored
    write_rows(tmp_path, "profile_kernels", [
        ("attn-a", "ncu", "0 _attn_fwd_kernel", f"{sol}: Duration [msecond]", "1.5"),
        ("attn-a", "ncu", "0 _attn_fwd_kernel", f"{sol}: DRAM Throughput [%]", "20.25"),
        ("attn-a", "ncu", "1 _attn_bwd_kernel", f"{sol}: Duration [usecond]", "2,500.00"),
        ("attn-a", "ncu", "1 _attn_bwd_kernel", f"{occ}: Achieved Occupancy [%]", "31.0")],
        date="2026-12-01T10:00:00", columns=columns)
    write_rows(tmp_path, "profile_kernels", [
        ("attn-a", "torch", "fwd", "calls", 1.0), ("attn-a", "torch", "fwd", "device_us", 1500.0),
        ("attn-a", "torch", "bwd", "calls", 2.0), ("attn-a", "torch", "bwd", "device_us", 2600.0),
        ("ln-b", "torch", "ln_fwd", "device_us", 12.0)],
        date="2026-12-01T11:00:00", columns=columns)                         # torch's run came later
    write_rows(tmp_path, "profile_kernels", [("ln-b", "torch", "ln_fwd", "device_us", 99.0)],
               device="cpu", date="2026-12-02T00:00:00", columns=columns)     # a CPU run: ignored
    prof = S.summarize(str(tmp_path))["profiles"]
    assert prof["attn-a"]["ncu"] == [
        {"kernel": "_attn_fwd_kernel", "us": 1500.0, "DRAM%": 20.25, "SM%": None, "occ%": None, "regs": None},
        {"kernel": "_attn_bwd_kernel", "us": 2500.0, "DRAM%": None, "SM%": None, "occ%": 31.0, "regs": None}]
    assert prof["attn-a"]["torch"] == [dict(kernel="bwd", calls=2.0, device_us=2600.0),
                                       dict(kernel="fwd", calls=1.0, device_us=1500.0)]
    assert prof["ln-b"] == {"torch": [dict(kernel="ln_fwd", device_us=12.0)]}
    assert "profile attn-a: _attn_bwd_kernel: us 2500, occ% 31" in S.format_targets(S.summarize(str(tmp_path)))


def test_long_cpp_kernel_names_are_shortened_in_the_printout_only(tmp_path):
    flash = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
             "cutlass::bfloat16_t>, false, true>(pytorch_flash::Flash_fwd_params)")
    long_plain = "triton_per_fused_add_native_layer_norm_native_dropout_" + "x" * 40
    write_rows(tmp_path, "profile_kernels", [("ln-c", "torch", flash, "device_us", 90.0),
                                             ("ln-c", "torch", long_plain, "device_us", 80.0),
                                             ("ln-c", "torch", "_fwd_kernel", "device_us", 12.0)],
               columns=("case", "tool", "kernel", "metric", "value"))
    summary = S.summarize(str(tmp_path))
    assert [k["kernel"] for k in summary["profiles"]["ln-c"]["torch"]] == [flash, long_plain, "_fwd_kernel"]
    printed = S.format_targets(summary)
    assert "profile ln-c: pytorch_flash::flash_fwd_kernel<...>: 90 us" in printed
    assert f"profile ln-c: {long_plain[:53]}...: 80 us" in printed and "profile ln-c: _fwd_kernel: 12 us" in printed
    assert "Flash_fwd_params" not in printed


def test_a_cut_sweep_is_not_met_and_a_miss_stays_a_miss(tmp_path):
    """gpu_suite.sh runs the largest sizes first and stops a step at its time limit: a target met on the
    part measured (the small shards, where the targets miss, cut off) read "met". Full sweep: met; one
    configuration fewer: None, and the detail says so; a miss on the part measured: still False."""
    def sweep(skip=()):
        folder = tmp_path / f"skip{len(skip)}"
        folder.mkdir()
        rows = []
        for tokens in S.LN_TOKENS:
            for h in S.LN_HIDDEN:
                for p in S.DROPOUTS:
                    config = f"tokens={tokens},h={h},p={p},dtype=bfloat16"
                    if config not in skip:   # seqpar at 95 % of copy; torch.compile 1.5x slower than seqpar
                        rows += ln_rows(config, {"seqpar-triton": (1.0, 1.0, 1.0), "torch-compile": (1.5, 1.5, 1.5)},
                                        nbytes=0.95 * 3000 * 1e6)
        write_rows(folder, "bench_layernorm_dropout", rows)
        return S.summarize(str(folder))

    full = sweep()
    assert by_name(full, "LayerNorm fwd: fraction")["met"] is True
    assert by_name(full, "LayerNorm fwd+bwd speed vs torch-compile")["met"] is True
    cut = sweep(skip=("tokens=256,h=1024,p=0.1,dtype=bfloat16",))
    fwd = by_name(cut, "LayerNorm fwd: fraction")
    assert fwd["met"] is None and "incomplete sweep: 17 of 18" in fwd["detail"]
    apex = by_name(cut, "LayerNorm fwd+bwd speed vs apex-ln")          # did not run at all: unknown anyway
    assert apex["met"] is None


def test_rows_from_another_run_or_cut_short_are_not_read(tmp_path):
    """Megatron's rows beside a layer bench of another device or commit (the JSON of an earlier run
    stays in bench/results/ when the layer step is cut): a ratio across runs read "met". A header
    appended mid-file (cat a.csv >> b.csv) was the "latest GPU run", a row cut short a TypeError, a
    layer JSON cut short a JSON error."""
    layer = dict(device="NVIDIA H200", date="2026-12-01T10:00:00", commit="old1234", config={},
                 rows=[dict(experiment="no recompute", combined_ms=10.0, overhead=0.0, activation_bytes=1.0,
                            table2_bytes=1.0, backends={})])
    (tmp_path / "layer_bench_gpu.json").write_text(json.dumps(layer))
    write_rows(tmp_path, "bench_megatron_layer", [("s2048 no recompute", "megatron-core", "combined_ms", 13.0)])
    targets = S.megatron_targets(S.read_csv(str(tmp_path / "bench_megatron_layer.csv")), S.read_layer_json(str(tmp_path)))
    assert [t["met"] for t in targets] == [None, None] and "not comparable" in targets[0]["detail"], targets
    csv_path = tmp_path / "bench_megatron_layer.csv"
    text = csv_path.read_text()
    csv_path.write_text(text + text.splitlines()[0] + "\n" + f"{H100},2026-12-09T00:00:00,abc1234,s2048 no rec\n")
    rows = S.read_csv(str(csv_path))
    assert {r["commit"] for r in rows} == {"abc1234"} and len(rows) == 1
    (tmp_path / "layer_bench_gpu.json").write_text(json.dumps(layer)[:40])
    assert S.read_layer_json(str(tmp_path)) is None


@pytest.mark.parametrize("broken", [1024, 2048, 4096], ids=["first", "middle", "last"])
def test_a_nan_in_a_sweep_makes_its_target_unknown_wherever_it_stands(broken, tmp_path):
    """min() skips a NaN unless it comes first, where it is returned: one NaN row either vanished (the
    target "met") or blanked it without a word, depending on the configurations' order."""
    rows = []
    for s in (1024, 2048, 4096):
        cfg = f"b={16384 // s} H=16 s={s} d=128 causal=1 p=0.1 bf16"
        rows += [(cfg, "seqpar-triton", "fwdbwd_ms", math.nan if s == broken else 1.0),
                 (cfg, "torch-sdpa-flash", "fwdbwd_ms", 1.0)]
    write_rows(tmp_path, "bench_attention", rows)
    speed = by_name(S.summarize(str(tmp_path)), "vs SDPA flash")
    assert speed["value"] is None and speed["met"] is None, speed
    assert f"not a number in 1 of 3 configurations (a broken measurement?), e.g. b={16384 // broken} H=16 s={broken}" \
        in speed["detail"], speed["detail"]


def test_a_later_run_of_one_overlap_part_keeps_the_other_parts(tmp_path):
    """The latest run of bench_overlap.csv hid an older run's gemm rows when the later run measured
    only --part project: the GEMM targets read "not measured"."""
    columns = ("part", "config", "provider", "metric", "value")
    write_rows(tmp_path, "bench_overlap", [
        ("gemm", "22B qkv fwd [8192x6144]@[6144x2304]", "chunked x8", "throughput_vs_plain", 0.97),
        ("gemm", "175B qkv fwd [2048x12288]@[12288x4608]", "chunked x8", "throughput_vs_plain", 0.99),
        ("project", "22B t=8", "overlapped", "exposed_ms", 1.0)],
        date="2026-12-01T10:00:00", commit="first", columns=columns)
    write_rows(tmp_path, "bench_overlap", [("project", "22B t=8", "overlapped", "exposed_ms", 2.0)],
               date="2026-12-02T10:00:00", commit="later", columns=columns)
    rows = S.read_csv(str(tmp_path / "bench_overlap.csv"))
    assert sorted((r["part"], r["commit"]) for r in rows) == [("gemm", "first"), ("gemm", "first"),
                                                              ("project", "later")]
    summary = S.summarize(str(tmp_path))
    assert by_name(summary, "22B shapes")["value"] == pytest.approx(0.97)
    assert by_name(summary, "175B shapes")["met"] is True
    assert summary["runs"]["bench_overlap"]["commit"] == "later"          # the latest run of the file
    assert summary["runs"]["bench_overlap"]["parts"] == {                   # and each part's own run
        "gemm": dict(device=summary["runs"]["bench_overlap"]["device"], date="2026-12-01T10:00:00", commit="first"),
        "project": dict(device=summary["runs"]["bench_overlap"]["device"], date="2026-12-02T10:00:00",
                        commit="later")}


def test_a_llama_run_cut_after_rmsnorm_keeps_the_older_swiglu_rows_and_says_so(tmp_path):
    """The latest run of bench_llama_ops.csv hid an older complete run's swiglu rows when the later run
    was cut after rmsnorm: every swiglu target read "not measured (no GPU rows)". Each op takes its own
    latest run, and an op read from an older run than the file's latest names it."""
    def llama(op, size, fwdbwd_ms):
        return ln_rows(f"op={op},tokens=16384,{size},dtype=bfloat16",
                       {"seqpar-triton": (1.0, 1.0, fwdbwd_ms), "liger": (2.0, 2.0, 3.0)}, clock="_gpu")

    ceiling = [("bytes=1073741824", "device-copy", "copy_gbps", 3000.0)]
    write_rows(tmp_path, "bench_llama_ops", ceiling + llama("rmsnorm", "h=4096", 2.0) + llama("swiglu", "n=11008", 1.5),
               date="2026-12-01T10:00:00", commit="first")
    write_rows(tmp_path, "bench_llama_ops", ceiling + llama("rmsnorm", "h=4096", 1.0),
               date="2026-12-02T10:00:00", commit="cut")
    rows = S.read_csv(str(tmp_path / "bench_llama_ops.csv"))
    assert {(S.part_of(r), r["commit"]) for r in rows} == {("rmsnorm", "cut"), ("swiglu", "first")}
    summary = S.summarize(str(tmp_path))
    swiglu = by_name(summary, "swiglu fwd+bwd speed vs liger")
    assert swiglu["value"] == pytest.approx(3.0 / 1.5), swiglu
    assert swiglu["detail"].endswith("; from an older run (2026-12-01T10:00:00, commit first): the file's latest "
                                     "(2026-12-02T10:00:00, commit cut) has no swiglu rows"), swiglu["detail"]
    rmsnorm = by_name(summary, "rmsnorm fwd+bwd speed vs liger")
    assert rmsnorm["value"] == pytest.approx(3.0) and "older run" not in rmsnorm["detail"], rmsnorm
    runs = summary["runs"]["bench_llama_ops"]
    assert runs["commit"] == "cut" and {part: run["commit"] for part, run in runs["parts"].items()} == {
        "rmsnorm": "cut", "swiglu": "first"}


def test_an_out_folder_that_cannot_be_made_is_one_line_exit_1(tmp_path, capsys):
    """--out under a file (or /proc): makedirs' traceback."""
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "summary"
    assert S.main(["--rows", str(tmp_path), "--out", str(out), "--no-plots"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"gpu_summary.py: error: --out {out}: Not a directory", err


def test_the_peak_memory_targets_name_says_what_flat_memory_gives(tmp_path):
    """The name said "s^2 term: 1, none: ~0", but a peak flat in s gives (1 / 1) / (4096 / 1024) = 0.25."""
    rows = []
    for s in S.ATTN_SEQLENS:
        cfg = f"b={16384 // s} H=16 s={s} d=128 causal=1 p=0.1 bf16"
        rows += [(cfg, "seqpar-triton", "fwdbwd_ms", 1.0), (cfg, "seqpar-triton", "fwdbwd_peak_bytes", 2**26)]
    write_rows(tmp_path, "bench_attention", rows)
    growth = by_name(S.summarize(str(tmp_path)), "peak memory growth")
    assert growth["value"] == pytest.approx(0.25)
    assert "an s^2 term gives 1, flat memory 0.25" in growth["name"] and "~0" not in growth["name"]


def test_the_gemm_targets_say_which_clock_timed_them(tmp_path):
    """bench_overlap's gemm part times with the device time since it writes call_ms beside it; older rows
    were eager calls one at a time, host launches included (0.72 in one run and 0.56 in another)."""
    columns = ("part", "config", "provider", "metric", "value")
    row = ("gemm", "22B proj dgrad [8192x6144]@[6144x768]", "chunked x8", "throughput_vs_plain", 0.9)
    write_rows(tmp_path, "bench_overlap", [row], date="2026-12-01T10:00:00", commit="old", columns=columns)
    assert by_name(S.summarize(str(tmp_path)), "22B shapes")["detail"].startswith("eager call time, one call")
    write_rows(tmp_path, "bench_overlap", [row, row[:3] + ("call_ms", 0.2)], date="2026-12-02T10:00:00",
               commit="new", columns=columns)
    assert by_name(S.summarize(str(tmp_path)), "22B shapes")["detail"].startswith("GPU time (back-to-back")
