"""bench/profile_kernels.py's ncu parser against what ncu 2025.x (CUDA 13) wrote on the H200 run
(bench/results/profile_kernels.csv): durations in "ns" (older ncu: "nsecond"), thousands separators, rule
rows without a metric, and C++ template kernel names hundreds of characters long."""
import csv
import io

import pytest
import torch

from bench.profile_kernels import launch_table, ncu_parsed, ncu_row, ncu_table, parse_ncu_csv, short_kernel_name

FLASH_FWD = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 32, 4, 0, 0, cutlass::bfloat16_t, "
             "Flash_kernel_traits<128, 128, 32, 4, cutlass::bfloat16_t>>, 1, 1, 0, 0, 1, 1, 0, 0>"
             "(pytorch_flash::Flash_fwd_params)")
COPY = ("void at::elementwise_kernel<128, 4, void at::gpu_kernel_impl_nocast<at::direct_copy_kernel_cuda("
        "at::TensorIteratorBase &)::[lambda() (instance 3)]::operator ()() const::[lambda() (instance 12)]::operator "
        "()() const::[lambda(c10::BFloat16) (instance 1)]>(at::TensorIteratorBase &, const T1 &)::[lambda(int) "
        "(instance 1)]>(int, T3)")

# Rows of bench/results/profile_kernels.csv as the H200 run wrote them (ncu rows, copied verbatim).
RESULT_ROWS = f'''device,date,commit,case,tool,kernel,metric,value
NVIDIA H200,2026-11-25T23:49:57,96c73a0,attn-seqpar-triton-s4096-p0.1,ncu,0 _attn_fwd_kernel,GPU Speed Of Light Throughput: DRAM Throughput [%],4.19
NVIDIA H200,2026-11-25T23:49:57,96c73a0,attn-seqpar-triton-s4096-p0.1,ncu,0 _attn_fwd_kernel,GPU Speed Of Light Throughput: Duration [ns],"630,624"
NVIDIA H200,2026-11-25T23:49:57,96c73a0,attn-seqpar-triton-s4096-p0.1,ncu,0 _attn_fwd_kernel,SpeedOfLight: ,
NVIDIA H200,2026-11-25T23:49:57,96c73a0,attn-seqpar-triton-s4096-p0.1,ncu,0 _attn_fwd_kernel,GPU Speed Of Light Throughput: Compute (SM) Throughput [%],38.71
NVIDIA H200,2026-11-25T23:49:57,96c73a0,attn-seqpar-triton-s4096-p0.1,ncu,0 _attn_fwd_kernel,Launch Statistics: Registers Per Thread [register/thread],195
NVIDIA H200,2026-11-25T23:49:57,96c73a0,attn-seqpar-triton-s4096-p0.1,ncu,0 _attn_fwd_kernel,Occupancy: Achieved Occupancy [%],12.49
NVIDIA H200,2026-11-25T23:49:57,96c73a0,attn-torch-sdpa-flash-s4096-p0.1,ncu,"0 {FLASH_FWD}",GPU Speed Of Light Throughput: Duration [ns],"807,616"
NVIDIA H200,2026-11-25T23:49:57,96c73a0,attn-torch-sdpa-flash-s4096-p0.1,ncu,"0 {FLASH_FWD}",Launch Statistics: Registers Per Thread [register/thread],255
NVIDIA H200,2026-11-25T23:49:57,96c73a0,attn-torch-sdpa-flash-s4096-p0.1,ncu,"1 {COPY}",GPU Speed Of Light Throughput: Duration [ns],"57,600"
NVIDIA H200,2026-11-25T23:49:57,96c73a0,attn-torch-sdpa-flash-s4096-p0.1,ncu,"1 {COPY}",Occupancy: Achieved Occupancy [%],90.44
'''

# The same metrics as ncu itself prints them with --csv --page details (the format those rows imply: one
# row per launch and metric, the section's display name, the unit apart), after the program's own output.
NCU_2025_CSV = f'''==PROF== Connected to process 41 (/usr/bin/python3.12)
==PROF== Profiling "_attn_fwd_kernel": 0%....50%....100% - 9 passes
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","41","python3.12","127.0.0.1","_attn_fwd_kernel","1","7","(128, 1, 1)","(32, 32, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","4.19"
"0","41","python3.12","127.0.0.1","_attn_fwd_kernel","1","7","(128, 1, 1)","(32, 32, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","ns","630,624"
"0","41","python3.12","127.0.0.1","_attn_fwd_kernel","1","7","(128, 1, 1)","(32, 32, 1)","0","9.0","GPU Speed Of Light Throughput","Compute (SM) Throughput","%","38.71"
"0","41","python3.12","127.0.0.1","_attn_fwd_kernel","1","7","(128, 1, 1)","(32, 32, 1)","0","9.0","SpeedOfLight","","",""
"0","41","python3.12","127.0.0.1","_attn_fwd_kernel","1","7","(128, 1, 1)","(32, 32, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","195"
"0","41","python3.12","127.0.0.1","_attn_fwd_kernel","1","7","(128, 1, 1)","(32, 32, 1)","0","9.0","Occupancy","Achieved Occupancy","%","12.49"
"1","41","python3.12","127.0.0.1","{COPY}","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","ns","57,600"
"1","41","python3.12","127.0.0.1","{COPY}","1","7","(128, 1, 1)","(1024, 1, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","17.83"
==PROF== Disconnected from process 41
'''


def test_ncu_2025_output_gives_every_column_of_the_table():
    parsed = parse_ncu_csv(NCU_2025_CSV)
    assert len(parsed) == 7                                # the rule row (no metric) is dropped
    fwd, copy = launch_table(parsed)
    assert fwd == {"kernel": "_attn_fwd_kernel", "us": pytest.approx(630.624), "DRAM%": 4.19, "SM%": 38.71,
                   "occ%": 12.49, "regs": 195.0}
    assert copy["kernel"] == COPY and copy["us"] == pytest.approx(57.6) and copy["DRAM%"] == 17.83
    line_fwd, line_copy = ncu_table("attn", parsed)
    assert "us    630.6 DRAM%      4.2 SM%     38.7 occ%     12.5 regs    195.0" in line_fwd
    assert "at::elementwise_kernel (direct_copy)" in line_copy and "us     57.6" in line_copy
    assert "nan" not in line_fwd + line_copy and len(line_copy) < 200
    # what goes to the CSV keeps the full kernel name and ncu's unit
    assert ncu_row(parsed[1]) == ("0 _attn_fwd_kernel", "GPU Speed Of Light Throughput: Duration [ns]", "630,624")
    assert ncu_row(parsed[-1])[0] == f"1 {COPY}"


def test_rows_of_the_h200_run_read_back_with_durations_in_us():
    """bench/gpu_summary.py's path: the CSV rows -> ncu_parsed -> launch_table."""
    by_case = {}
    for r in csv.DictReader(io.StringIO(RESULT_ROWS)):
        by_case.setdefault(r["case"], []).append(ncu_parsed(r["kernel"], r["metric"], r["value"]))
    [triton] = launch_table(by_case["attn-seqpar-triton-s4096-p0.1"])
    assert triton == {"kernel": "_attn_fwd_kernel", "us": pytest.approx(630.624), "DRAM%": 4.19, "SM%": 38.71,
                      "occ%": 12.49, "regs": 195.0}
    flash, copy = launch_table(by_case["attn-torch-sdpa-flash-s4096-p0.1"])
    assert (flash["kernel"], flash["us"], flash["regs"]) == (FLASH_FWD, pytest.approx(807.616), 255.0)
    assert (copy["us"], copy["occ%"]) == (pytest.approx(57.6), 90.44)


@pytest.mark.parametrize("unit, us", [("ns", 1.5e-3), ("nsecond", 1.5e-3), ("us", 1.5), ("usecond", 1.5),
                                      ("ms", 1500.0), ("msecond", 1500.0), ("s", 1.5e6)])
def test_duration_units_convert_to_us(unit, us):
    parsed = [dict(id=0, kernel="k", section="GPU Speed Of Light Throughput", metric="Duration", unit=unit,
                   value="1.5")]
    assert launch_table(parsed)[0]["us"] == pytest.approx(us)


def test_thousands_separators_missing_metrics_and_no_profile():
    parsed = [dict(id=1, kernel="_bwd_kernel", section="GPU Speed Of Light Throughput", metric="Duration",
                   unit="usecond", value="1,024.00")]
    [row] = launch_table(parsed)
    assert row["us"] == pytest.approx(1024.0) and row["SM%"] is None and row["occ%"] is None
    assert "SM%      n/a" in ncu_table("c", parsed)[0]
    assert parse_ncu_csv("no profile\n") == []


def test_an_unknown_duration_unit_is_not_a_number():
    parsed = [dict(id=0, kernel="k", section="GPU Speed Of Light Throughput", metric="Duration", unit="cycle",
                   value="1.5")]
    assert launch_table(parsed)[0]["us"] is None
    assert "us      n/a" in ncu_table("c", parsed)[0]


@pytest.mark.parametrize("name, short", [
    ("_attn_fwd_kernel", "_attn_fwd_kernel"),
    (FLASH_FWD, "pytorch_flash::flash_fwd_kernel<...>"),
    (COPY, "at::elementwise_kernel (direct_copy)"),
    ("void at::vectorized_elementwise_kernel<8, at::bfloat16_copy_kernel_cuda(at::TensorIteratorBase &)::"
     "[lambda(float) (instance 1)], std::array<char *, 2>>(int, T2, T3)",
     "at::vectorized_elementwise_kernel (bfloat16_copy)"),
    ("void bdaln::fwd_kernel<__nv_bfloat16, 8, 16, 0>(bdaln::FwdArgs, long)",
     "bdaln::fwd_kernel<__nv_bfloat16, 8, 16, 0>"),
    ("void seqpar::reduce_partials_kernel<8>(seqpar::PartialSums, long, long)", "seqpar::reduce_partials_kernel<8>"),
])
def test_kernel_names_are_shortened_for_the_table(name, short):
    assert short_kernel_name(name) == short


def test_a_long_short_name_is_cut_to_the_column():
    name = ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, "
            "2, 4, 2, 0, 0, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t>>, 1, 1, 0, "
            "0, 1, 1, 0>(pytorch_flash::Flash_bwd_params)")
    short = short_kernel_name(name, width=40)
    assert len(short) == 40 and short.startswith("pytorch_flash::flash_bwd_dq_dk") and short.endswith("...")


def test_ncu_skips_providers_that_cannot_run_and_stops_when_ncu_cannot_profile(monkeypatch, tmp_path, capsys):
    """Each case under ncu starts ncu and a Python child (~12 s on the H200): a provider that was not
    importable failed only inside that child, case after case, and a machine where ncu can't initialise
    spent the step's whole limit producing nothing. (torch.cuda and the two calls faked: no GPU here.)"""
    from bench import profile_kernels as P

    built, profiled = [], []

    def build_step(family, provider, shape, device):
        built.append(provider)
        if provider.startswith("liger"):
            raise ImportError("No module named 'liger_kernel'")
        return lambda: None

    def run_ncu(case, quick, timeout_s):
        profiled.append(case)
        if len(profiled) == 2:
            raise RuntimeError("ncu exit status 1, 0 rows: ==ERROR== Failed to initialize the profiler: "
                               "LibraryNotLoaded")
        return []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(P, "build_step", build_step)
    monkeypatch.setattr(P, "run_ncu", run_ncu)
    names = list(P.cases(False))
    liger = [n for n in names if P.cases(False)[n][1].startswith("liger")][:1]
    others = [n for n in names if n not in liger][:4]
    P.main(["--tool", "ncu", "--out", str(tmp_path)] + [a for n in liger + others for a in ("--case", n)])
    assert profiled == others[:2]                      # the liger case never started ncu; then ncu failed: stop
    assert "ncu can't profile on this machine" in capsys.readouterr().out
