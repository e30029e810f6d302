"""bench/bench_overlap.py: the projection's schedule model against hand-computed timelines, and a
smoke run of every part at --quick size (the harness users run must keep working)."""
import csv
import math

import pytest
import torch

from bench import bench_overlap
from seqpar.parallel.overlap import ChunkPlan

# durations in us: chunk GEMMs 10, plain GEMMs 20 (= t chunks at t = 2), weight gradient 15, one shard
# transfer 4, the bulk collective (t-1 = 1 shard) 4, partials sum 1
T = dict(g_fwd=10.0, g_dgrad=10.0, G_fwd=20.0, G_dgrad=20.0, W=15.0, c=4.0, C=4.0, sum=1.0)
CHUNKED, BULK_BWD, PLAIN = ChunkPlan(2), ChunkPlan(2, bulk_ag_backward=True), ChunkPlan(1)


@pytest.mark.parametrize("op,pss,plan,total,compute", [
    # plain all-gather fwd: gather 0..4, GEMM 4..24
    ("ag", "fwd", PLAIN, 24.0, 20.0),
    # chunked: own chunk 0..10 while the peer's shard travels 0..4, peer chunk 10..20
    ("ag", "fwd", CHUNKED, 20.0, 20.0),
    # plain reduce-scatter fwd: GEMM 0..20, then the collective 20..24
    ("rs", "fwd", PLAIN, 24.0, 20.0),
    # chunked: peer's partial 0..10, sent 10..14 beside the own partial 10..20, sum 20..21
    ("rs", "fwd", CHUNKED, 21.0, 21.0),
    # plain rs bwd: gather grad 0..4, dgrad 4..24, wgrad 24..39
    ("rs", "bwd", PLAIN, 39.0, 35.0),
    # chunked rs bwd: own dgrad chunk 0..10 beside the gather 0..4, peer chunk 10..20, wgrad 20..35
    ("rs", "bwd", CHUNKED, 35.0, 35.0),
    # plain / bulk ag bwd: re-gather 0..4 beside dgrad 0..20, reduce-scatter 20..24 beside wgrad 20..35
    ("ag", "bwd", PLAIN, 35.0, 35.0),
    ("ag", "bwd", BULK_BWD, 35.0, 35.0),
    # chunked ag bwd: re-gather 0..4; peer partial 0..10, sent 10..14; own partial 10..20; wgrad
    # 20..35; sum 35..36 -- one sum more than bulk, nothing left to hide (why the GPU plan keeps bulk)
    ("ag", "bwd", CHUNKED, 36.0, 36.0),
])
def test_schedule_matches_hand_timeline(op, pss, plan, total, compute):
    sim = bench_overlap._schedule(op, pss, plan, 2, T)
    assert sim.total == pytest.approx(total)
    assert sim.compute_busy == pytest.approx(compute)


def test_prefetch_sets_when_gather_transfers_are_issued():
    # t = 3, chunk GEMMs 10, transfers 4: prefetch 1 issues transfer 2 only when GEMM 1 starts (at 10,
    # so the link is busy until 14); prefetch 2 queues both at 0 (link done at 8). The GEMMs never wait.
    for prefetch, link_done in ((1, 14.0), (2, 8.0)):
        sim = bench_overlap._schedule("ag", "fwd", ChunkPlan(3, prefetch=prefetch), 3, T)
        assert sim.link == pytest.approx(link_done) and sim.link_busy == pytest.approx(8.0)
        assert sim.total == pytest.approx(30.0)


@pytest.mark.timeout(240)
def test_quick_run_writes_rows(tmp_path):
    bench_overlap.main(["--quick", "--world-sizes", "2", "--out", str(tmp_path)])
    with open(tmp_path / "bench_overlap.csv") as f:
        rows = list(csv.DictReader(f))
    parts = {r["part"] for r in rows}
    assert parts == {"gemm", "gloo", "project"}, parts
    metrics = {(r["part"], r["metric"]) for r in rows}
    for needed in [("gloo", "speedup_vs_plain_ci_low"), ("gloo", "exposed_comm_ms"), ("gloo", "comm_hidden"),
                   ("project", "comm_hidden"), ("project", "chunked_bwd_us"), ("gemm", "throughput_vs_plain"),
                   ("gemm", "call_ms")]:
        assert needed in metrics, needed
    for r in rows:
        if r["metric"].endswith("_ms") or r["metric"].endswith("_us"):
            assert math.isfinite(float(r["value"])) and float(r["value"]) > 0, r


def test_chunk_variants_compute_the_whole_product():
    """Every chunking bench_overlap times writes a @ w into every row of the output (CPU: no streams)."""
    g = torch.Generator().manual_seed(5)
    a, w = torch.randn(64, 24, generator=g), torch.randn(24, 40, generator=g)
    out = torch.empty(64, 40)
    variants = bench_overlap.chunk_variants(a, w, out, 8, torch.device("cpu"))
    assert set(variants) == {"chunked x8", "chunked x4"}
    for name, fn in variants.items():
        out.fill_(float("nan"))
        fn()
        torch.testing.assert_close(out, a @ w, msg=name)


@pytest.mark.parametrize("argv, match", [
    (["--bandwidth-gbs", "0"], "--bandwidth-gbs must be finite and positive, got 0.0"),   # a ZeroDivisionError
    (["--latency-us", "inf"], "--latency-us must be finite and non-negative, got inf"),   # NaN rows, exit 0
    (["--tflops", "-1"], "--tflops must be finite and positive, got -1.0"),
    (["--world-sizes", ","], "--world-sizes must be comma-separated sizes >= 2, got ','"),     # 0 rows, exit 0
], ids=["bandwidth", "latency", "tflops", "world-sizes"])
def test_bad_options_are_usage_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_overlap.parse_args(["--quick", *argv])
    assert exit_info.value.code == 2 and match in capsys.readouterr().err


def test_quick_writes_nothing_without_out_and_appends_refuse_another_header(tmp_path):
    """--quick appended its smoke rows to the checked-in bench/results/bench_overlap.csv by default. An
    append to a CSV of other columns wrote rows of another width under its header, and one to a file
    without a final newline glued the first row onto its last line."""
    from seqpar.bench.results import ResultRows

    assert bench_overlap.parse_args(["--quick"]).out is None
    rows = ResultRows("cpu", "bench_x", ("config", "value"))
    rows.rows.append({"device": "cpu", "date": "d", "commit": "c", "config": "a", "value": 1})
    assert rows.finish(None, quick=True) == 0                       # nothing written, no default path
    unended = tmp_path / "unended.csv"
    unended.write_text("device,date,commit,config,value\ncpu,d0,c0,z,0")
    rows.write(str(unended))
    assert unended.read_text().splitlines() == ["device,date,commit,config,value", "cpu,d0,c0,z,0", "cpu,d,c,a,1"]
    other = tmp_path / "other.csv"
    other.write_text("device,date,commit,part,config,value\n")
    with pytest.raises(ValueError, match="has the columns .*'part'.* not this benchmark's"):
        rows.write(str(other))
    assert other.read_text() == "device,date,commit,part,config,value\n"
