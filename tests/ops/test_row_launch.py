"""The launch policy shared by the row kernels' backward passes (seqpar.triton_kernels.rows): one wave of
resident programs, each writing one partial row, and the column reduction of those partial rows with the
block sizes a GPU uses (here under the Triton interpreter)."""
from types import SimpleNamespace

import pytest
import torch

from seqpar.triton_kernels import rows as R

H100 = SimpleNamespace(regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                       shared_memory_per_multiprocessor=233472)


@pytest.mark.parametrize("n_regs,num_warps,shared,expected", [
    (99, 16, 0, 1),      # the LayerNorm backward at h = 4096 (ncu on an H200: 99 registers, 16 warps)
    (32, 16, 0, 4),      # threads: 2048 / 512
    (32, 4, 0, 16),      # threads: 2048 / 128
    (64, 8, 0, 4),       # registers: 65536 / (64 * 256)
    (65, 8, 0, 3),       # 65 registers allocate as 72 per thread: 65536 / (72 * 32) // 8 warps
    (255, 4, 0, 2),      # 256 per thread: 8 warps' worth per SM
    (32, 4, 100_000, 2),  # shared memory: 233472 // (100000 + 1024)
])
def test_occupancy_follows_the_cuda_occupancy_rules(n_regs, num_warps, shared, expected):
    assert R.occupancy(n_regs, num_warps, shared, H100) == expected


def test_split_rows_covers_every_row_once_with_at_most_max_programs():
    for n_rows in (1, 7, 255, 1024, 16384, 16385):
        for block_m in (1, 2, 8):
            for max_programs in (1, 132, 528):
                programs, per_program = R.split_rows(n_rows, block_m, max_programs)
                assert per_program % block_m == 0
                assert programs <= max_programs
                assert (programs - 1) * per_program < n_rows <= programs * per_program


@pytest.mark.parametrize("h", [256, 1024, 4096, 8192, 12288, 16384])
def test_row_tiles_keep_a_thread_to_a_few_elements(monkeypatch, h):
    """The GPU launch policy of the LayerNorm and RMSNorm backward (and the LayerNorm forward, below):
    whole rows of up to 4096 columns at 4 elements per thread, so that ptxas fits a 1024-thread program
    in 64 registers (kernel_report: 37-64); the chunks of wider rows at 4 per thread too, after a row-sum
    pass at 8 per thread. The RMSNorm backward's tiles of one row (h >= 4096) at 8 per thread, 16 warps
    (the H200's times at 508368d: two 512-thread programs per SM beat one of 1024 threads at h = 4096)."""
    from seqpar.triton_kernels import bias_dropout_add_layer_norm as L, rms_norm as M

    monkeypatch.setattr(R, "interpreting", lambda: False)
    block_m, block_n, n_chunks, launch = L._bwd_config(16384, h)
    per_thread = block_m * block_n // (32 * launch["num_warps"])
    assert (per_thread, launch["num_warps"]) == (4, 32) and (n_chunks > 1) == (h > 4096)
    assert block_n * n_chunks >= h and block_m * block_n <= 4096
    sums_block_m, sums_launch = R.row_sums_config(16384, block_n)
    assert sums_block_m * block_n // (32 * sums_launch["num_warps"]) == 8
    block_m, block_n, chunked, launch = M._bwd_config(16384, h)
    per_thread = block_m * block_n // (32 * launch["num_warps"])
    assert (launch["num_warps"], per_thread) == ((16, 8) if block_m == 1 else (32, 4)) and chunked == (h > 4096)
    assert (block_m == 1) == (h >= 4096)   # (these widths: 4096-column chunks; 5120 / 6144 chunk narrower)
    # The LayerNorm forward: whole rows up to 8192 columns at up to 32 warps, wider rows in 4096-column
    # chunks at 16 warps (on an H200 h = 12288 in chunks took 0.67-0.89x a whole 16384-wide tile's time);
    # 8 elements per thread either way.
    block_m, block_n, chunked, launch = L._fwd_config(16384, h)
    per_thread = block_m * block_n // (32 * launch["num_warps"])
    assert chunked == (h > 8192) and per_thread == 8
    assert launch["num_warps"] == (32 if 4096 < h <= 8192 else 16) and block_n == (4096 if chunked else h)


def test_one_wave_sizes_the_layer_norm_backward_at_a_shard(monkeypatch):
    """1024 x 4096 on 132 SMs with one 32-warp program per SM: 132 programs of 8 rows (the old 4-waves
    policy wrote 512 partial rows of 2 rows each: partial traffic 1.2x the data)."""
    monkeypatch.setattr(R, "interpreting", lambda: False)
    monkeypatch.setattr(R, "sm_count", lambda index: 132)
    monkeypatch.setattr(R, "resident_per_sm", lambda kernel, args, launch, device: 1)
    max_programs = R.wave_programs(None, (), {}, torch.device("cuda", 0), n_chunks=1)
    assert max_programs == 132
    assert R.split_rows(1024, 1, max_programs) == (128, 8)
    # two column chunks (h > 4096) share the wave
    assert R.wave_programs(None, (), {}, torch.device("cuda", 0), n_chunks=2) == 66


class _FakeKernel:
    __name__ = "_fake_bwd_kernel"

    def __init__(self, n_regs=None):
        self.n_regs, self.warmups = n_regs, 0

    def warmup(self, *args, grid, **launch):
        self.warmups += 1
        kernel = self

        class Compiled:
            metadata = SimpleNamespace(num_warps=launch["num_warps"], shared=0)

            def _init_handles(self):
                if kernel.n_regs is None:
                    raise AttributeError("no binary loader")
                self.n_regs = kernel.n_regs

        return Compiled()


def test_resident_per_sm_reads_the_compiled_kernel_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: H100)
    monkeypatch.setattr(R, "_resident", {})
    kernel = _FakeKernel(n_regs=99)
    x = torch.empty(4, dtype=torch.bfloat16)
    device = torch.device("cuda", 0)
    assert R.resident_per_sm(kernel, (x, 4), {"num_warps": 16}, device) == 1
    assert R.resident_per_sm(kernel, (x, 8), {"num_warps": 16}, device) == 1
    assert kernel.warmups == 1                       # cached: same dtypes and launch
    assert R.resident_per_sm(kernel, (x, 4), {"num_warps": 4}, device) == 4   # 99 -> 104 registers: 19 warps
    assert kernel.warmups == 2


def test_resident_per_sm_falls_back_without_triton_internals(monkeypatch):
    monkeypatch.setattr(R, "_resident", {})
    assert R.resident_per_sm(_FakeKernel(n_regs=None), (1,), {"num_warps": 8}, torch.device("cuda", 0)) \
        == R.FALLBACK_RESIDENT_PER_SM


@pytest.mark.parametrize("n_buffers", [1, 2, 3])
@pytest.mark.parametrize("n_partials,h", [(1, 1), (70, 100), (129, 64)])
def test_reduce_partials_with_the_gpu_block_sizes(monkeypatch, n_buffers, n_partials, h):
    """The GPU's grid (one program per 32-column block and buffer, 64 partial rows a step), run by the
    interpreter: every column of every buffer summed once, against fp64."""
    monkeypatch.setattr(R, "interpreting", lambda: False)
    g = torch.Generator().manual_seed(n_partials * 31 + h)
    partials = torch.randn(n_buffers, n_partials, h, generator=g)
    sums = R.reduce_partials(partials)
    assert len(sums) == n_buffers
    for q, s in enumerate(sums):
        ref = partials[q].double().sum(0)
        torch.testing.assert_close(s.double(), ref, rtol=1e-6, atol=1e-5 * n_partials ** 0.5)


@pytest.mark.parametrize("h,expected", [(6144, 2048), (8192, 4096), (12288, 4096), (5120, 1024), (14336, 2048),
                                        (25600, 4096), (4097, 1024)])
def test_chunk_columns_split_wide_rows_evenly(h, expected):
    """The chunks of a row wider than one backward program: the widest power of two whose padding is at most
    h / 8 (1024 at the least), so h = 6144 is 3 x 2048 rather than 4096 + a half-masked 4096."""
    block_n = R.chunk_columns(h, 4096)
    assert block_n == expected
    padding = -(-h // block_n) * block_n - h
    assert padding <= h // 8 or block_n == 1024
    assert R.chunk_columns(100, 32) == 32          # narrower than 1024: the widest chunk is the only one


def test_the_interpreters_bf16_rounding_rounds_to_nearest_even_and_keeps_nan():
    """cast_rne's bit rounding (the CPU interpreter's fp32 -> bf16) against torch's conversion, bit for bit:
    ties to even, the largest finite values rounding to inf, and NaNs of any payload staying NaN (a full
    mantissa carried into the sign bit or past 2**32 and came out as -0 / +0)."""
    import triton
    import triton.language as tl

    if not R.interpreting():
        pytest.skip("the bit rounding is the interpreter's path (a GPU converts natively)")

    @triton.jit
    def to_bf16(X, Y, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        v = tl.load(X + offs, mask=offs < n, other=0.0)
        tl.store(Y + offs, R.cast_rne(v, tl.bfloat16, True), mask=offs < n)

    patterns = [0x7F800001, 0x7FC00000, 0x7FFF8000, 0x7FFFFFFF, 0xFFFFFFFF, 0xFFC00001,   # NaNs
                0x3F808000, 0x3F818000, 0x3F808001, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0x00000001, 0x80000000]
    x = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    y = torch.empty(len(patterns), dtype=torch.bfloat16)
    to_bf16[(1,)](x, y, len(patterns), BLOCK=16)
    want = x.to(torch.bfloat16)
    assert torch.isnan(y[:6]).all(), y[:6]
    assert torch.equal(y[6:].view(torch.int16), want[6:].view(torch.int16)), (y[6:], want[6:])
