"""The dropout mask: torch reference == Triton kernel helper (interpreter) == host build of csrc/philox.cuh,
against an element-wise statement of the convention and Random123's known answers; its statistics; the
probability rounding; and the seed streams."""
import os
import random
import shutil

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import seqpar
from seqpar.random import (dropout_keep_mask, dropout_scale, dropout_threshold, effective_dropout_p, mask_bytes,
                           next_layer_seed, philox4x32, stream_seed)
from seqpar.triton_kernels.philox import keep_mask

# Global rows around the 32-bit boundaries: the row's high word is the third Philox counter word.
ROW_OFFSETS = [0, 2**31 - 3, 2**32 - 2, 2**40 + 5]
ROW_IDS = ["r0", "r2^31", "r2^32", "r2^40"]
SEEDS = [0, 12345, 2**40 + 17, 2**62 - 9]  # the key's high word matters past 2**32

# Random123's known-answer vectors for Philox-4x32-10: (key, counter) -> output words.
KNOWN_ANSWERS = [
    (0, (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (2**64 - 1, (2**32 - 1,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x299F31D0 << 32) | 0xA4093822, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _cuda_ext():
    from seqpar import _ext

    if _ext.cuda_extension_error():
        if shutil.which("nvcc"):
            pytest.fail(f"nvcc is present but seqpar._C is not built: {_ext.cuda_extension_error()}")
        pytest.skip(f"seqpar._C not built: {_ext.cuda_extension_error()}")
    return _ext.cuda_extension()


def elementwise_bytes(stream, rows, n_cols):
    """The convention stated per element, independently of mask_bytes' group expansion:
    byte (c % 4) of word (c % 16) // 4 of Philox-4x32-7(stream, (c // 16, r & 0xffffffff, r >> 32, 0))."""
    r = torch.as_tensor(rows, dtype=torch.int64).view(-1, 1)
    c = torch.arange(n_cols).view(1, -1)
    words = philox4x32(stream, c // 16, r & 0xFFFFFFFF, r >> 32, torch.zeros(1, dtype=torch.int64))
    word = torch.stack(words).gather(0, ((c % 16) // 4).expand(r.shape[0], -1).unsqueeze(0))[0]
    return ((word >> (8 * (c % 4))) & 0xFF).to(torch.uint8)


def test_philox_known_answers():
    for key, counter, expected in KNOWN_ANSWERS:
        got = philox4x32(key, *(torch.tensor([w]) for w in counter), rounds=10)
        assert tuple(w.item() for w in got) == expected


def test_philox_leaves_its_counters_unchanged():
    """The rounds run in place on copies: full-size int64 counters (returned as they are by .to(int64))
    must not be the buffers the rounds overwrite."""
    counters = [torch.arange(6, dtype=torch.int64) * (i + 3) for i in range(4)]
    before = [c.clone() for c in counters]
    words = philox4x32(0x1234_5678_9ABC, *counters)
    assert all(torch.equal(c, b) for c, b in zip(counters, before))
    assert not any(torch.equal(w, c) for w, c in zip(words, counters))


@pytest.mark.parametrize("row_offset", ROW_OFFSETS, ids=ROW_IDS)
def test_mask_bytes_match_the_elementwise_convention(row_offset):
    rows = torch.arange(5) + row_offset
    for seed in SEEDS:
        assert torch.equal(mask_bytes(seed, rows, 53), elementwise_bytes(seed, rows, 53)), seed
    keep = dropout_keep_mask(SEEDS[1], rows.view(5, 1, 1), 53, 77)    # any leading shape
    assert keep.shape == (5, 1, 1, 53) and torch.equal(keep.view(5, 53), mask_bytes(SEEDS[1], rows, 53) >= 77)


def test_mask_bytes_under_inductor_and_fake_tensors():
    """Under graph capture the mask is one opaque custom op, run eagerly: inductor's C++ code computed the
    Philox products with signed int64 overflow (undefined in C++), and its masks differed from eager ones
    for seeds whose low key word is >= 2**31 (4e9 here; 2**32 - 1 too), failing the every-backend-agrees
    convention. Fake tensors get the shape and dtype from the op's fake implementation."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rows = torch.arange(16).view(8, 2) + 2**32 - 6
    for seed in (4_000_000_000, 2**32 - 1, SEEDS[3]):
        def masked(x, seed=seed):
            return seqpar.ops.dropout(x, seqpar.ops.DropoutSpec(0.1, seed, 3))

        x = torch.randn(8, 2, 40)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(masked)(x), masked(x)), seed
        torch._dynamo.reset()
        assert torch.equal(torch.compile(mask_bytes)(seed, rows, 40), mask_bytes(seed, rows, 40)), seed
    with FakeTensorMode():
        fake = mask_bytes(SEEDS[1], torch.arange(6).view(3, 2), 21)
    assert fake.shape == (3, 2, 21) and fake.dtype == torch.uint8


def test_host_build_matches_reference():
    """csrc/philox.cuh compiled for the host: the Philox known answers, and the kernels' mask path (one call
    per run of 4, 8 or 16 columns) against the reference, rows past 2**31 and 2**40."""
    ext = _cuda_ext()
    for key, counter, expected in KNOWN_ANSWERS:
        assert tuple(ext.philox4x32_host(key, *counter, rounds=10)) == expected
    rng = random.Random(0)
    cases = [(rng.choice(SEEDS + [rng.randrange(2**62)]), rng.choice(ROW_OFFSETS) + rng.randrange(64),
              rng.choice([4, 8, 16]), rng.randrange(256)) for _ in range(200)]
    for seed, row, n, threshold in cases:
        col0 = n * rng.randrange(64)
        ref = mask_bytes(seed, torch.tensor([row]), col0 + n)[0, col0:] >= threshold
        bits = ext.keep_run_host(seed, row, col0, n, threshold)
        assert [bool(bits >> i & 1) for i in range(n)] == ref.tolist(), (seed, row, col0, n, threshold)
        c0, c1, c2 = col0 // 16, row & 0xFFFFFFFF, row >> 32
        ref_words = philox4x32(seed, *(torch.tensor([w]) for w in (c0, c1, c2, 0)))
        assert tuple(ext.philox4x32_host(seed, c0, c1, c2, 0)) == tuple(w.item() for w in ref_words)


@triton.jit
def _keep_mask_tiles(out, seed, row_offset, threshold, n_rows, n_cols, BLOCK_R: tl.constexpr,
                     BLOCK_C: tl.constexpr, TRANSPOSED: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    keep = keep_mask(seed, rows.to(tl.int64) + row_offset, tl.program_id(1) * BLOCK_C, threshold,
                     BLOCK_R, BLOCK_C, TRANSPOSED)
    if TRANSPOSED:  # [cols, rows]
        mask = (cols[:, None] < n_cols) & (rows[None, :] < n_rows)
        tl.store(out + rows[None, :] * n_cols + cols[:, None], keep.to(tl.int8), mask=mask)
    else:
        mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        tl.store(out + rows[:, None] * n_cols + cols[None, :], keep.to(tl.int8), mask=mask)


@pytest.mark.parametrize("transposed", [False, True], ids=["tile", "transposed"])
def test_triton_keep_mask_matches_reference(transposed):
    """triton_kernels/philox.py's keep_mask (what the attention and LayerNorm kernels call) over tiles of a
    ragged [rows, 53] mask, as is and transposed (the dk/dv tile), rows past 2**31, 2**32 and 2**40."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n_rows, n_cols = 19, 53
    for seed, row_offset, threshold in zip(SEEDS, ROW_OFFSETS, (1, 26, 128, 255)):
        out = torch.full((n_rows, n_cols), -1, dtype=torch.int8, device=device)
        _keep_mask_tiles[(triton.cdiv(n_rows, 16), triton.cdiv(n_cols, 32))](
            out, seed, row_offset, threshold, n_rows, n_cols, BLOCK_R=16, BLOCK_C=32, TRANSPOSED=transposed)
        ref = dropout_keep_mask(seed, torch.arange(n_rows) + row_offset, n_cols, threshold)
        assert torch.equal(out.cpu(), ref.to(torch.int8)), (seed, row_offset, threshold)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_mask_statistics(p):
    """Keep rate within 4 sigma of 1 - P/256; no correlation between adjacent columns, adjacent rows,
    columns 16 apart (the next Philox call) or the bytes of one word."""
    threshold = dropout_threshold(p)
    keep = dropout_keep_mask(99, torch.arange(1024) + 2**31 - 512, 4099, threshold).double()
    q = 1 - threshold / 256
    sigma = (q * (1 - q) / keep.numel()) ** 0.5
    assert abs(keep.mean().item() - q) < 4 * sigma

    def corr(a, b):
        a, b = a.flatten() - a.mean(), b.flatten() - b.mean()
        return ((a * b).mean() / (a.std() * b.std())).item()

    for name, a, b in (("adjacent columns", keep[:, :-1], keep[:, 1:]), ("adjacent rows", keep[:-1], keep[1:]),
                       ("columns 16 apart", keep[:, :-16], keep[:, 16:]),
                       ("bytes 4 apart", keep[:, :-4], keep[:, 4:])):
        assert abs(corr(a, b)) < 0.01, name


def test_effective_dropout_p_and_threshold():
    assert dropout_threshold(0.1) == 26 and effective_dropout_p(0.1) == 26 / 256
    assert effective_dropout_p(0.5) == 0.5 and effective_dropout_p(0) == 0.0
    assert dropout_threshold(np.float32(0.1)) == 26 and dropout_threshold(np.float64(0.5)) == 128
    for tiny in (1e-4, 1 / 512):   # round half to even: P = 0, which drops nothing (it was silent)
        with pytest.warns(UserWarning, match=r"drops nothing: .* pass 0, or a p above 1/512"):
            assert effective_dropout_p(tiny) == 0.0
    assert dropout_threshold(1 / 512 + 1e-9) == 1
    assert effective_dropout_p(0.998) == 255 / 256
    assert dropout_scale(26) == float(torch.tensor(256 / 230, dtype=torch.float32))
    for bad in (0.999, 1.0, -0.1, 1.5, np.float32(1.0)):
        with pytest.raises(ValueError, match="round"):
            dropout_threshold(bad)
    for bad in ("0.1", True, None, torch.tensor(0.1)):
        with pytest.raises(ValueError, match=r"must be in \[0, 1\) \(a real number, not a"):
            dropout_threshold(bad)
    with pytest.raises(ValueError, match="0.999"):
        effective_dropout_p(0.999)


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


def test_seed_draw_under_torch_compile():
    """Drawing a seed (seed=None, dropout on) is a graph break: without fullgraph the op runs and draws a
    fresh seed per call, as in eager mode; fullgraph=True stops with seqpar's reason, naming the fix."""
    x = torch.randn(4, 16)

    def f(x):
        return seqpar.ops.dropout(x, seqpar.ops.DropoutSpec(0.5, seqpar.random.next_op_seed()))

    compiled = torch.compile(f, backend="eager")
    seqpar.manual_seed(3)
    eager = [f(x), f(x)]
    seqpar.manual_seed(3)
    traced = [compiled(x), compiled(x)]
    torch.testing.assert_close(traced, eager, rtol=0, atol=0)
    assert not torch.equal(traced[0], traced[1])
    torch._dynamo.reset()
    with pytest.raises(Exception, match="pass seed= to the functional ops"):
        torch.compile(f, backend="eager", fullgraph=True)(x)


def test_mask_bytes_of_a_row_past_2_63_follow_its_unsigned_bits():
    """A row index is 64 unsigned bits: row 2**63 + 3, held in int64 as a negative number, takes the counter
    words (row & 0xffffffff, row >> 32) of the unsigned value, as the kernels read it (uint32 words). The
    torch reference shifted the int64 arithmetically, so its high word was sign-extended: another mask."""
    row, seed = 2**63 + 3, SEEDS[1]
    words = philox4x32(seed, torch.tensor([0]), torch.tensor([row & 0xFFFFFFFF]), torch.tensor([row >> 32]),
                       torch.tensor([0]))                                      # Python ints: no sign
    expected = [(int(word) >> (8 * byte)) & 0xFF for word in words for byte in range(4)]
    assert mask_bytes(seed, torch.tensor([row - 2**64]), 16)[0].tolist() == expected


def test_mask_bytes_of_a_stream_past_2_63_under_graph_capture():
    """A stream in [2**63, 2**64) is a valid Philox key (eager ran it); captured, the op's int64 argument
    refused it ("Expected a value of type 'int' ... found type 'int'"). The same bytes either way."""
    from torch.fx.experimental.proxy_tensor import make_fx

    rows = torch.arange(5, dtype=torch.int64) + 2**40
    for stream in (2**63 + 5, 2**64 - 1):
        eager = mask_bytes(stream, rows, 20)
        traced = make_fx(lambda r: mask_bytes(stream, r, 20))(rows)
        compiled = torch.compile(lambda r: mask_bytes(stream, r, 20), backend="aot_eager", fullgraph=True)(rows)
        assert torch.equal(traced(rows), eager) and torch.equal(compiled, eager), stream
        assert not torch.equal(eager, mask_bytes(stream - 2**63, rows, 20))   # the key's high bit counts
    torch._dynamo.reset()


def test_seeds_are_drawn_on_the_cpu_whatever_the_default_device():
    """The draw followed torch's default device: under torch.device("meta") it failed (no value), under
    torch.set_default_device("cuda") it took the CUDA generator, which manual_seed does not seed."""
    seqpar.manual_seed(5)
    expected = next_layer_seed(3)
    seqpar.manual_seed(5)
    with torch.device("meta"):
        assert next_layer_seed(3) == expected


def test_shape_inference_under_fake_tensors_with_dropout_on():
    """A layer with dropout under FakeTensorMode (shape inference) failed at the seed draw
    (DataDependentOutputException: a fake draw has no value); it leaves torch's generator as it was."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2,
                                                             hidden_dropout=0.1, attention_dropout=0.1,
                                                             backend="torch"))
    seqpar.manual_seed(5)
    state = torch.get_rng_state()
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = layer(torch.empty(4, 2, 16))
    assert y.shape == (4, 2, 16) and torch.equal(torch.get_rng_state(), state)


def test_export_with_dropout_on_says_why_it_cannot():
    """Under torch.export (non-strict: make_fx over fake tensors) a seed of 0 would be baked into the
    program and every call would apply the same masks: a RuntimeError saying why; eval mode exports."""
    layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2,
                                                             hidden_dropout=0.5, backend="torch"))
    x = torch.randn(4, 2, 16)
    with pytest.raises(RuntimeError, match="would bake one seed in"):
        torch.export.export(layer, (x,), strict=False)
    program = torch.export.export(layer.eval(), (x,), strict=False)
    torch.testing.assert_close(program.module()(x), layer(x))


@pytest.mark.parametrize("call, match", [
    (lambda: dropout_scale(-1), "threshold is an int in \\[0, 256\\).*-1"),    # read the table from its end
    (lambda: dropout_scale(256), "got 256"),                                    # an IndexError
    (lambda: dropout_scale(26.0), "got 26.0"),
    (lambda: dropout_keep_mask(7, torch.arange(2), 4, 300), "got 300"),        # compared as 300 % 256 = 44
    (lambda: mask_bytes(-1, torch.arange(2), 4), "stream must be an int in \\[0, 2\\*\\*64\\)"),  # was 2**64 - 1
    (lambda: mask_bytes(2**64 + 5, torch.arange(2), 4), "got 18446744073709551621"),             # was 5
    (lambda: mask_bytes(7, torch.arange(2.0), 4), "rows must be an integer tensor"),              # truncated
    (lambda: mask_bytes(7, torch.arange(2), True), "n_cols must be a non-negative int"),
    (lambda: next_layer_seed(2**64), "layer_number must be an int in \\[0, 2\\*\\*63\\)"),       # was layer 0
    (lambda: next_layer_seed(-1), "got -1"),                                                    # next_op_seed's
], ids=["scale-1", "scale256", "scale-float", "keep300", "stream-1", "stream2^64", "rows-float", "ncols-bool",
        "layer2^64", "layer-1"])
def test_out_of_range_inputs_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_rng_state_restores_the_dropout_seeds_without_manual_seed():
    """A checkpoint of torch's CPU generator state alone resumed with other dropout masks unless the same
    seqpar.manual_seed ran first (every seed mixes in the seqpar seed); get_rng_state holds both, and
    set_rng_state restores both: a layer's dropout after the restore is the uninterrupted run's."""
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, hidden_dropout=0.3, attention_dropout=0.3)
    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(0))
    seqpar.manual_seed(7)
    layer = seqpar.TransformerLayer(cfg, layer_number=1)
    layer(x)
    state = seqpar.random.get_rng_state()
    uninterrupted = layer(x)
    seqpar.manual_seed(99)                      # a new process would start from seed 0 and its own state
    torch.rand(5)
    seqpar.random.set_rng_state(state)
    assert seqpar.random.initial_seed() == 7
    assert torch.equal(layer(x), uninterrupted)
    seqpar.manual_seed(2**64 - 1)               # the largest seed survives the round trip
    largest = seqpar.random.get_rng_state()
    seqpar.manual_seed(0)
    seqpar.random.set_rng_state(largest)
    assert seqpar.random.initial_seed() == 2**64 - 1
    for bad in (torch.get_rng_state(), state.float(), state[:-1], state.tolist()):
        with pytest.raises(ValueError, match="state must be seqpar.random.get_rng_state"):
            seqpar.random.set_rng_state(bad)


def test_fork_rng_restores_the_seqpar_seed_too():
    """torch.random.fork_rng restores torch's generator only: a seqpar.manual_seed inside it changed every
    later training forward's masks. seqpar.random.fork_rng restores both, on an exception too."""
    seqpar.manual_seed(3)
    torch.rand(5)
    before = seqpar.random.get_rng_state()
    with torch.random.fork_rng():
        seqpar.manual_seed(0)
    assert seqpar.random.initial_seed() == 0            # the trap
    seqpar.random.set_rng_state(before)
    with pytest.raises(KeyError):
        with seqpar.random.fork_rng():
            seqpar.manual_seed(0)
            torch.rand(3)
            raise KeyError("evaluation failed")
    assert torch.equal(seqpar.random.get_rng_state(), before)


def test_the_tiny_dropout_warning_points_at_the_user_s_line():
    """The warning named a seqpar line (stacklevel=2: config.py, model.py, ops/dropout.py) whichever call
    of the user's asked, so the default filter showed it at every forward's seqpar line and a filter on
    the user's module could not reach it. It is attributed to the first frame outside seqpar: a config,
    a model built from it and its forward, and an op each point here, once per line."""
    import warnings

    import seqpar

    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Subclass(seqpar.TransformerConfig):
        note: str = ""

    this_file = __file__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2, hidden_dropout=0.001)
        model = seqpar.GPTModel(cfg, num_layers=1, vocab_size=20, max_seq_len=8)
        model(torch.zeros(1, 8, dtype=torch.int64))
        seqpar.ops.dropout(torch.ones(4), seqpar.ops.DropoutSpec(0.001, 1))
        Subclass(hidden_size=16, num_attention_heads=2, attention_dropout=0.001)   # its generated __init__ too
    assert caught and all(w.filename == this_file for w in caught), [(w.filename, w.lineno) for w in caught]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            model(torch.zeros(1, 8, dtype=torch.int64))
    assert len(caught) == 1, [(w.filename, w.lineno) for w in caught]


def test_gpt_embedding_dropout_is_the_embedding_site_of_its_layer_number():
    """Every dropout mask's stream is ``stream_seed(layer seed, layer number, site)``: GPTModel's embedding
    dropout took its layer seed itself as the stream (Site.EMBEDDING was defined, and unused); it is the
    site Site.EMBEDDING of the embedding's layer number now."""
    from seqpar.nn.model import EMBEDDING_RNG_LAYER
    from seqpar.ops import DropoutSpec, dropout

    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2, backend="torch")
    model = seqpar.GPTModel(cfg, 1, 50, 8, embedding_dropout=0.5)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    state = torch.get_rng_state()
    got = model._embed(tokens)
    torch.set_rng_state(state)
    layer_seed = next_layer_seed(EMBEDDING_RNG_LAYER)
    stream = stream_seed(layer_seed, EMBEDDING_RNG_LAYER, seqpar.random.Site.EMBEDDING)
    with torch.no_grad():
        expected = dropout(model.embedding(tokens), DropoutSpec(0.5, stream, 0))
    assert torch.equal(got, expected)
