"""Single-process tests of all_gather_matmul / matmul_reduce_scatter (group of one rank) and of the
ChunkPlan that decides between the plain and the overlapped (ring) path. Multi-rank parity, the
overlap order and the collective counts are in tests/distributed/test_comm_matmul_ranks.py."""
import pytest
import torch

import seqpar.parallel.overlap as overlap_mod
from seqpar.ops import all_gather_matmul, matmul_reduce_scatter
from seqpar.parallel.overlap import ChunkPlan
from tests.tolerances import TOLERANCES, assert_close

SHAPES = [(7, 3, 13, 11), (5, 1, 9, 6), (1, 2, 17, 3)]   # (s, b, k, n): odd, k and n not multiples of 8
OPS = {"all_gather_matmul": all_gather_matmul, "matmul_reduce_scatter": matmul_reduce_scatter}


@pytest.mark.parametrize("overlap", [True, False, ChunkPlan(1)], ids=["auto", "off", "plan1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", list(OPS), ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_single_rank_matches_linear(op, shape, dtype, overlap, bias):
    """With one rank both ops are a linear layer: forward and every gradient vs an fp64 reference."""
    s, b, k, n = shape
    x64, w64, b64, gy64 = (torch.randn(s, b, k, dtype=torch.float64), torch.randn(n, k, dtype=torch.float64),
                           torch.randn(n, dtype=torch.float64), torch.randn(s, b, n, dtype=torch.float64))
    x, w, bb = (t.to(dtype).requires_grad_() for t in (x64, w64, b64))
    y = OPS[op](x, w, bb if bias else None, group=None, overlap=overlap)
    y.backward(gy64.to(dtype))
    xr, wr, br = (t.to(dtype).double().requires_grad_() for t in (x64, w64, b64))
    yr = torch.nn.functional.linear(xr, wr, br if bias else None)
    yr.backward(gy64.to(dtype).double())
    pairs = [("y", y, yr), ("grad_x", x.grad, xr.grad), ("grad_w", w.grad, wr.grad)]
    pairs += [("grad_b", bb.grad, br.grad)] if bias else []
    assert bias or bb.grad is None
    for name, got, ref in pairs:
        assert got.dtype == dtype and got.shape == ref.shape, name
        if dtype == torch.float32:
            assert_close(got, ref, dtype, msg=name)
        else:   # GEMM outputs: error relative to the tensor's scale
            err, scale = (got.double() - ref).abs().max().item(), ref.abs().max().item()
            assert err <= TOLERANCES[dtype][1] * scale, f"{name}: {err:.3e} vs scale {scale:.3e}"


@pytest.mark.parametrize("overlap", [True, False, ChunkPlan(1)], ids=["auto", "off", "plan1"])
@pytest.mark.parametrize("op", list(OPS), ids=str)
def test_no_output_columns(op, overlap):
    """A weight shard of no rows (GPTModel's empty vocabulary shard on the last ranks): y [s, b, 0], zero
    input gradient, an empty weight gradient (no reshape with -1 beside the 0)."""
    x, w = torch.randn(6, 2, 5, requires_grad=True), torch.randn(0, 5, requires_grad=True)
    y = OPS[op](x, w, group=None, overlap=overlap)
    assert y.shape == (6, 2, 0)
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and w.grad.shape == (0, 5)

def test_chunk_plan_validation():
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="chunks"):
            ChunkPlan(bad)
        with pytest.raises(ValueError, match="prefetch"):
            ChunkPlan(2, prefetch=bad)
    with pytest.raises(ValueError, match="bulk_ag_backward"):
        ChunkPlan(2, bulk_ag_backward=1)
    assert ChunkPlan(4).validate(4).overlapped and not ChunkPlan(1).validate(4).overlapped
    with pytest.raises(ValueError, match="chunks=3"):
        ChunkPlan(3).validate(4)


def test_chunk_plan_choose_heuristic():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    choose = ChunkPlan.choose
    big = dict(chunk_rows=256, k=4096, n=4096)                   # 8.6 GFLOP per chunk
    assert choose(True, t=4, device=cpu, **big) == ChunkPlan(4, prefetch=1)      # gloo: one transfer ahead
    # NCCL: all issued at once; all_gather_matmul's backward keeps its bulk async collectives
    assert choose(True, t=4, device=cuda, **big) == ChunkPlan(4, prefetch=3, bulk_ag_backward=True)
    assert choose(True, t=1, device=cpu, **big) == ChunkPlan(1)   # nothing to overlap
    assert choose(False, t=4, device=cpu, **big) == ChunkPlan(1)
    assert choose(True, t=4, device=cpu, chunk_rows=5, k=13, n=11) == ChunkPlan(1)          # tiny GEMM
    assert choose(True, t=2, device=cpu, chunk_rows=8, k=2 ** 14, n=2 ** 14) == ChunkPlan(1)  # too few rows
    # the threshold is per device type: a GEMM worth chunking on CPU is too small for a GPU
    rows = overlap_mod.MIN_CHUNK_ROWS
    kn = int((overlap_mod.MIN_CHUNK_FLOPS["cpu"] / (2 * rows)) ** 0.5) + 1
    assert choose(True, t=2, device=cpu, chunk_rows=rows, k=kn, n=kn) == ChunkPlan(2)
    assert choose(True, t=2, device=cuda, chunk_rows=rows, k=kn, n=kn) == ChunkPlan(1)
    assert choose(ChunkPlan(2), t=2, device=cpu, chunk_rows=1, k=1, n=1) == ChunkPlan(2)    # forced
    with pytest.raises(ValueError, match="overlap"):
        choose("yes", t=2, device=cpu, **big)
    with pytest.raises(ValueError, match="group size 2"):
        choose(ChunkPlan(4), t=2, device=cpu, **big)


@pytest.mark.parametrize("op", list(OPS), ids=str)
def test_bad_inputs_raise(op):
    fn = OPS[op]
    x, w = torch.randn(4, 2, 6), torch.randn(5, 6)
    with pytest.raises(ValueError, match="int64"):
        fn(torch.ones(4, 2, 6, dtype=torch.int64), w, group=None)
    with pytest.raises(ValueError, match=r"\(5, 7\)"):
        fn(x, torch.randn(5, 7), group=None)
    with pytest.raises(ValueError, match="bfloat16"):
        fn(x, w.bfloat16(), group=None)
    with pytest.raises(ValueError, match=r"bias must be a \[5\] tensor, got \(4,\)"):
        fn(x, w, torch.randn(4), group=None)
    # A bias of another dtype or device would promote y (fp32 bias on bf16 GEMMs) or fail inside addmm.
    with pytest.raises(ValueError, match="bias is torch.float32 on cpu but x.* is torch.bfloat16"):
        fn(x.bfloat16(), w.bfloat16(), torch.randn(5), group=None)
    with pytest.raises(ValueError, match="bias is torch.float32 on meta"):
        fn(x, w, torch.randn(5, device="meta"), group=None)
    with pytest.raises(ValueError, match=r"bias must be a \[5\] tensor, got list"):
        fn(x, w, [0.0] * 5, group=None)
    with pytest.raises(ValueError, match=r"weight must be a \[n, 6\] tensor.*got list"):
        fn(x, [[0.0] * 6] * 5, group=None)
    with pytest.raises(ValueError, match="ProcessGroup or None, got 'world'"):
        fn(x, w, group="world")                           # not silently "no parallelism"
    with pytest.raises(ValueError, match="group size 1"):
        fn(x, w, group=None, overlap=ChunkPlan(2))        # a forced plan must fit the group
    with pytest.raises(ValueError, match="overlap"):
        fn(x, w, group=None, overlap=2)
