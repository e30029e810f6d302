"""The counter-based RNG: torch reference == tl.rand == csrc/philox.cuh, and the mask scheme."""
import os
import random
import shutil

import pytest
import torch

import seqpar
from seqpar.random import philox_uniform, stream_seed


def test_philox_matches_triton_rand():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")

    @triton.jit
    def rand_rows(out, seed, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        u = tl.rand(seed.to(tl.int64) + row, cols)
        tl.store(out + row * n_cols + cols, u, mask=cols < n_cols)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seed in (0, 12345, 2**40 + 17, 2**62 - 9):
        out = torch.full((3, 300), float("nan"), device=device)
        rand_rows[(3,)](out, seed, 300, BLOCK=512)
        ref = philox_uniform(torch.arange(3).unsqueeze(1) + seed, torch.arange(300).unsqueeze(0))
        assert torch.equal(out.cpu(), ref), f"seed {seed}"


def test_philox_matches_cuda_header_host_build():
    from seqpar import _ext

    if _ext.cuda_extension_error():
        if shutil.which("nvcc"):
            pytest.fail(f"nvcc is present but seqpar._C is not built: {_ext.cuda_extension_error()}")
        pytest.skip(f"seqpar._C not built: {_ext.cuda_extension_error()}")
    ext = _ext.cuda_extension()
    rng = random.Random(0)
    pairs = [(rng.randrange(2**62), rng.randrange(2**31)) for _ in range(300)] + [(0, 0), (2**62 - 1, 2**31 - 1)]
    ref = philox_uniform(torch.tensor([s for s, _ in pairs]), torch.tensor([o for _, o in pairs]))
    host = torch.tensor([ext.philox_uniform_host(s, o) for s, o in pairs])
    assert torch.equal(host, ref)


def test_uniform_statistics():
    u = philox_uniform(torch.arange(64).unsqueeze(1) + 99, torch.arange(4096).unsqueeze(0))
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(u.var().item() - 1 / 12) < 0.005
    keep = (u >= 0.3).float().mean().item()
    assert abs(keep - 0.7) < 0.01


def test_stream_seeds_differ_and_are_deterministic():
    seeds = {stream_seed(1, layer, site, call) for layer in range(4) for site in range(4) for call in range(4)}
    assert len(seeds) == 64 and all(0 <= s < 2**62 for s in seeds)
    assert stream_seed(7, 2, 1, 3) == stream_seed(7, 2, 1, 3)


def test_manual_seed_resets_layer_calls():
    seqpar.manual_seed(5)
    first = [seqpar.random.next_layer_seed(0), seqpar.random.next_layer_seed(0), seqpar.random.next_layer_seed(1)]
    assert first[0] != first[1]
    seqpar.manual_seed(5)
    again = [seqpar.random.next_layer_seed(0), seqpar.random.next_layer_seed(0), seqpar.random.next_layer_seed(1)]
    assert first == again
    seqpar.manual_seed(6)
    assert seqpar.random.next_layer_seed(0) != first[0]


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_manual_seed_rejects(bad):
    with pytest.raises(ValueError, match="seed"):
        seqpar.manual_seed(bad)
