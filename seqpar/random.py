"""Counter-based dropout randomness shared by every backend.

Every dropout mask element is a pure function of ``(stream_seed, row, col)``: one Philox-4x32-7 call
(Salmon et al., SC'11) gives the 16 mask bytes of a row's 16-column group::

    (w0, w1, w2, w3) = Philox-4x32-7(key = stream_seed, counter = (col // 16, row & 0xffffffff, row >> 32, 0))
    byte = (w[(col % 16) // 4] >> (8 * (col % 4))) & 0xff          # Triton: tl.philox(seed, col // 16,
    P    = round(p * 256);  keep = byte >= P                         #   row_lo, row_hi, 0, n_rounds=7)
    kept values are scaled by float32(256 / (256 - P))

so the effective dropout probability is ``P / 256`` (:func:`effective_dropout_p`; p = 0.1 drops 26/256),
``P = 0`` means no dropout and ``P >= 256`` is rejected. The key is the 64-bit stream seed (low word
first), the counter's 32-bit words are (group, row low, row high, 0). The torch reference here
(:func:`mask_bytes`, :func:`dropout_keep_mask`), the Triton kernels (``triton_kernels/philox.py``) and
the CUDA kernels (``csrc/philox.cuh``) agree bit for bit; kernels draw whole 16-column groups, one
Philox call per 16 decisions.

``row`` and ``col`` are *global* coordinates, never shard-local ones:

=====================  ==========================================================  =============
dropout site           row                                                         col
=====================  ==========================================================  =============
hidden (bias-dropout)  token index ``seq_global * b + batch``                       feature
attention probs        ``(head_global * b + batch) * s + query_pos``                key position
=====================  ==========================================================  =============

``stream_seed`` is derived from ``(seed, layer_number, site, draw)`` by :func:`stream_seed`, where
``seed`` is :func:`manual_seed`'s and ``draw`` is a 63-bit number drawn from torch's default CPU
generator once per training forward of a layer (:func:`next_layer_seed`; functional ops called with
``seed=None`` draw the same way, :func:`next_op_seed`). Drawing from torch's generator is what makes the
masks checkpoint-safe: seqpar's own ``recompute`` draws before the recomputed region and passes the seed
in, and every external re-run of a forward - ``torch.utils.checkpoint`` (reentrant or not), FSDP's
``checkpoint_wrapper``, HF gradient checkpointing - restores that generator's state first, so the re-run
draws the same number and replays the same masks, while each new step draws fresh ones. Because
nothing depends on the tensor-parallel rank or the sequence shard, the same seed gives the same masks for
any TP size, with or without sequence parallelism; TP ranks must hold the same generator state, which
layers and models check when they are built (:func:`seqpar.parallel.state.check_ranks_agree`).

Under torch.compile the draws and their hashing run outside the graph (a graph break each), and the
masks are one opaque custom op (:func:`mask_bytes`): compiled code reads the same masks as eager code.
"""
from __future__ import annotations

import contextlib
import numbers
import sys
import warnings
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from ._custom_op import kernel_op, outside_compile, outside_dispatch_modes

__all__ = [
    "manual_seed", "initial_seed", "get_rng_state", "set_rng_state", "fork_rng", "stream_seed",
    "next_layer_seed", "next_layer_streams", "next_op_seed", "generator_fingerprint", "Site", "philox4x32",
    "mask_bytes", "dropout_keep_mask", "dropout_threshold", "dropout_scale", "effective_dropout_p", "MASK_GROUP",
    "graph_ints", "draw_for_graph", "LAYER_SITES",
]

_MASK32 = 0xFFFFFFFF
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_ROUNDS = 7
#: Mask columns drawn by one Philox call (4 words x 4 bytes).
MASK_GROUP = 16
# Stream seeds (Philox keys) are kept below 2**62.
_STREAM_SEED_BITS = 62


class Site:
    """Dropout sites of a transformer layer; part of the RNG stream identity."""

    ATTENTION = 1        # softmax dropout inside the attention core
    ATTENTION_OUT = 2    # hidden dropout after the attention projection
    MLP_OUT = 3          # hidden dropout after the MLP
    EMBEDDING = 4        # embedding dropout (GPTModel)


#: The dropout sites of a TransformerLayer, in the order :func:`next_layer_streams` hashes them by default.
LAYER_SITES = (Site.ATTENTION, Site.ATTENTION_OUT, Site.MLP_OUT)


class _SeedState:
    """The seqpar seed: one per process (not per thread), like torch's default generator."""

    seed = 0


_state = _SeedState()
_SEED_LIMIT = 2**64


def manual_seed(seed: int) -> None:
    """Seed every seqpar dropout mask and parameter init. Call with the same seed on every rank.

    Side effect: also seeds torch's default CPU generator (``torch.default_generator.manual_seed(seed)``,
    what ``torch.manual_seed(seed)`` does on the CPU; CUDA generators are left alone), because each
    training forward draws its dropout seed from that generator (module doc). So building and running
    the same model after ``manual_seed(s)`` reproduces its results exactly, and random numbers the
    program draws from torch's CPU generator afterwards depend on ``s`` too.

    Args:
        seed: int in [0, 2**64) (a numpy integer too).
    """
    seed = as_int(seed)
    if not is_int(seed) or not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    _state.seed = int(seed)
    torch.default_generator.manual_seed(int(seed))


def initial_seed() -> int:
    """The seed last passed to :func:`manual_seed` (0 by default)."""
    return _state.seed


def get_rng_state() -> torch.Tensor:
    """Everything that decides the dropout seeds of later forwards, for a checkpoint: a uint8 CPU tensor
    of :func:`initial_seed` (8 bytes, little-endian) followed by torch's default CPU generator state
    (``torch.get_rng_state()``). Saving torch's state alone is not enough: every seed mixes in the
    seqpar seed, so a resume that does not repeat :func:`manual_seed` drew other masks."""
    # device="cpu": torch's state is a CPU tensor whatever the default device (torch.set_default_device)
    return torch.cat([torch.tensor(list(_state.seed.to_bytes(8, "little")), dtype=torch.uint8, device="cpu"),
                      torch.get_rng_state()])


def set_rng_state(state: torch.Tensor) -> None:
    """Restore :func:`get_rng_state`'s ``state``: the seqpar seed and torch's default CPU generator (the
    same on every rank, as after :func:`manual_seed`). ValueError for anything but such a tensor."""
    torch_state_bytes = torch.get_rng_state().numel()
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.shape != (8 + torch_state_bytes,):
        got = f"{state.dtype} {tuple(state.shape)}" if isinstance(state, torch.Tensor) else type(state).__name__
        raise ValueError(f"state must be seqpar.random.get_rng_state()'s uint8 [{8 + torch_state_bytes}] tensor, "
                         f"got {got}")
    state = state.cpu()
    torch.set_rng_state(state[8:].clone())
    _state.seed = int.from_bytes(bytes(state[:8].tolist()), "little")


@contextlib.contextmanager
def fork_rng() -> Iterator[None]:
    """Restore :func:`get_rng_state` (the seqpar seed and torch's CPU generator) when the block ends, even
    by an exception: e.g. an evaluation with its own :func:`manual_seed` inside a training run. CUDA
    generators are not restored (seqpar draws nothing from them): nest ``torch.random.fork_rng`` for them.
    ``torch.random.fork_rng`` restores torch's generators only, so a ``manual_seed`` inside it changed
    the masks of every later training forward. For the same reason the seqpar seed must not change
    between a forward and its backward under ``torch.utils.checkpoint``: the re-run mixes in the seed of
    that moment, which checkpoint does not restore (seqpar's own recompute passes the drawn seeds in)."""
    state = get_rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def generator_fingerprint(with_torch_state: bool = True) -> Dict[str, object]:
    """What decides this process's dropout seeds and parameter init: the seqpar seed and the bytes of
    torch's default CPU generator state (a placeholder when ``with_torch_state`` is False: the same
    keys either way). Tensor-parallel ranks must agree on them (checked when layers and models are
    built)."""
    if with_torch_state:
        with outside_dispatch_modes():   # a real tensor under FakeTensorMode too
            state = torch.get_rng_state().numpy().tobytes()
    else:
        state = "not compared (no dropout)"
    return {"seqpar seed (seqpar.manual_seed)": _state.seed, "torch default CPU generator state": state}


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def stream_seed(seed: int, layer_number: int, site: int, call: int = 0) -> int:
    """Hash ``(seed, layer_number, site, call)`` into a 62-bit Philox stream seed (each part an int, taken
    modulo 2**64: pass values in [0, 2**64) to keep them distinct)."""
    h = _splitmix64(seed)
    for part in (layer_number, site, call):
        h = _splitmix64(h ^ (part & 0xFFFFFFFFFFFFFFFF))
    return h >> (64 - _STREAM_SEED_BITS)


def _draw_bits() -> int:
    """63 random bits from torch's default CPU generator (the state torch's checkpoint restores). On the
    CPU whatever torch's default device is: under ``torch.set_default_device("cuda")`` the draw took the
    CUDA generator (which :func:`seqpar.manual_seed` does not seed) and synced the host on every forward.
    0 under a FakeTensorMode (shape inference: a fake draw has no value, and the generator is left as it
    was, so a later real run draws what it would have). A RuntimeError while a graph is traced for
    keeps (make_fx, torch.export) or a CUDA graph is captured: a seed baked into it would give every call
    (every replay) the same masks."""
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(DRAW_NOT_CAPTURABLE)
    drawn = torch.empty((), dtype=torch.int64, device="cpu").random_(generator=None)
    if not is_fake(drawn):
        return int(drawn)
    if get_proxy_mode() is not None:
        raise RuntimeError(DRAW_NOT_EXPORTABLE)
    return 0


#: The error of a seed draw while torch.export or make_fx traces.
DRAW_NOT_EXPORTABLE = (
    "seqpar draws a dropout seed per training forward from torch's default CPU generator, which a traced "
    "graph (torch.export, make_fx) cannot hold: it would bake one seed in and apply the same masks on "
    "every call. Export in eval mode or with dropout 0, or call the functional ops with seed= inputs")


#: The error of a seed draw while a CUDA graph is captured.
DRAW_NOT_CAPTURABLE = (
    "seqpar draws a dropout seed per training forward on the host, and a CUDA graph captured now would "
    "replay that one seed, so the same masks, on every replay. Capture in eval mode or with dropout 0, or "
    "call the functional ops with seed= (new seeds need a new capture)")


# A Python int drawn from a tensor cannot be traced, so each draw runs outside torch.compile (a graph
# break; fullgraph=True stops with this reason instead of Dynamo's bare "Tensor.random_ op"). The draw and
# every hash of it run together out there: splitmix64 over a SymInt builds sympy expressions that take
# minutes to trace. Only the finished stream seeds enter the resumed graph, as inputs that it passes to
# the ops untouched. seqpar's own draws hand them over as DynamicInts (draw_for_graph): a plain int input
# is a constant of the graph on the first call, so the second step recompiled, and under dynamic=False
# every step did (past Dynamo's recompile limit, 8, the layers ran eagerly). The reason is shared with
# seqpar.nn.layer, whose draw reads the layer number outside the graph too.
#: The reason given for a seed draw's graph break under torch.compile.
DRAW_NOT_TRACEABLE = (
    "seqpar draws a dropout seed per forward from torch's default CPU generator (so checkpointing replays "
    "it), which torch.compile cannot trace. Under fullgraph=True pass seed= to the functional ops (e.g. "
    "seqpar.random.next_op_seed() outside the compiled function), or compile the modules without "
    "fullgraph when their dropout is on")


_outside_compile = outside_compile(DRAW_NOT_TRACEABLE)

try:  # torch 2.13 has it (a prototype: torch.compile's way to mark an int dynamic)
    from torch.fx.experimental.sym_node import DynamicInt as _DynamicInt
except ImportError:  # older torch: a plain int (the graph recompiles once with it dynamic)
    _DynamicInt = int


def graph_ints(seeds):
    """``seeds`` (an int or a tuple of ints) as ints that torch.compile takes as dynamic inputs of a graph,
    whatever ``dynamic=`` says (torch's ``DynamicInt``, an int subclass: eager code sees the ints they
    are): each step's new seeds then reuse the graph compiled on the first step. Only seeds entering a
    graph are wrapped: arithmetic on a DynamicInt runs through torch.fx's symbolic nodes (a hash took
    100 us instead of 2), and the public draws return plain ints (a DynamicInt prints as
    ``DynamicInt(...)``, and torch.export can't take one as an input)."""
    return tuple(_DynamicInt(s) for s in seeds) if isinstance(seeds, tuple) else _DynamicInt(seeds)


@_outside_compile
def draw_for_graph(draw, *args):
    """``graph_ints(draw(*args))`` outside torch.compile: a seed draw (:func:`next_layer_seed`,
    :func:`next_op_seed`, ...) whose seeds go into the compiled code that called it."""
    return graph_ints(draw(*args))


@_outside_compile
def next_layer_seed(layer_number: int) -> int:
    """Draw the seed of one training forward of layer ``layer_number``.

    ``stream_seed(manual seed, layer_number, 0, draw)`` with ``draw`` taken from torch's default CPU
    generator. The per-site stream seeds are ``stream_seed(returned, layer_number, site)``
    (:func:`next_layer_streams` draws both at once). Draw once per forward, outside any region seqpar
    recomputes; an external checkpoint that re-runs the whole forward restores the generator first, so
    the re-run gets the same seed. Runs outside torch.compile (a graph break). ``layer_number`` is an int
    in [0, 2**63) (ValueError otherwise: stream_seed reads it modulo 2**64, so 2**64 was layer 0).
    """
    if not is_int(layer_number) or not 0 <= layer_number < 2**63:
        raise ValueError(f"layer_number must be an int in [0, 2**63), got {layer_number!r}")
    return stream_seed(_state.seed, layer_number, 0, _draw_bits())


def is_int(value) -> bool:
    """An int, not a bool (the argument checks' test)."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_int(value):
    """A numpy (or other ``numbers.Integral``) integer as a Python int, anything else as it is: sizes from
    a sweep over a numpy array pass the int checks and are held as the ints they are."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (int, bool)):
        return int(value)
    return value


@_outside_compile
def next_layer_streams(layer_number: int, sites: Tuple[int, ...] = LAYER_SITES) -> Tuple[int, ...]:
    """One training forward's seeds of layer ``layer_number``, drawn and hashed in one call.

    Element 0 is :func:`next_layer_seed` (one draw); element ``i + 1`` is the stream seed of dropout site
    ``sites[i]``, ``stream_seed(element 0, layer_number, sites[i])`` (with the default
    :data:`LAYER_SITES`, element ``site`` is that :class:`Site`'s). A layer takes its seeds from here so
    that under torch.compile no hashing is traced: the ints enter the compiled graph as inputs
    (:func:`graph_ints`) and go to the ops untouched. GPTModel's embedding dropout is site
    ``Site.EMBEDDING`` of its own layer number.
    """
    seed = next_layer_seed(layer_number)
    return (seed,) + tuple(stream_seed(seed, layer_number, site) for site in sites)


@_outside_compile
def next_op_seed() -> int:
    """A fresh stream seed for a functional op called with ``seed=None`` (drawn like
    :func:`next_layer_seed`, so a checkpointed re-run of the op replays its mask)."""
    return stream_seed(_state.seed, -1, 0, _draw_bits())


def philox4x32(key: int, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
               rounds: int = _PHILOX_ROUNDS) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox-4x32-``rounds`` of counters ``(c0, c1, c2, c3)`` under the 64-bit ``key``, as ``tl.philox``.

    The counters are int64 tensors holding uint32 values (broadcast together); so are the four output
    words. The key is ``(key & 0xffffffff, key >> 32)``; each round is the standard Philox round with
    the multipliers 0xD2511F53, 0xCD9E8D57 and the Weyl key increments 0x9E3779B9, 0xBB67AE85.
    """
    # Full-size int64 copies (never the caller's tensors), updated in place: on CPU a fresh tensor per
    # operation (page faults on new memory) tripled the time of the rounds.
    c0, c1, c2, c3 = (c.to(torch.int64).clone() for c in torch.broadcast_tensors(c0, c1, c2, c3))
    prod_a, prod_b = torch.empty_like(c0), torch.empty_like(c0)
    key = int(key)   # a seed handed to a graph may be a DynamicInt, whose arithmetic is symbolic (slow)
    k0, k1 = key & _MASK32, (key >> 32) & _MASK32
    for _ in range(rounds):
        # 32 x 32-bit products in int64 wrap modulo 2**64 (two's complement), so their high and low
        # words are exactly the unsigned product's. The round is
        # (c0, c1, c2, c3) <- (hi(b) ^ c1 ^ k0, lo(b), hi(a) ^ c3 ^ k1, lo(a)), a = c0 * A, b = c2 * B.
        torch.mul(c0, _PHILOX_ROUND_A, out=prod_a)
        torch.mul(c2, _PHILOX_ROUND_B, out=prod_b)
        torch.bitwise_right_shift(prod_b, 32, out=c0).bitwise_and_(_MASK32).bitwise_xor_(c1).bitwise_xor_(k0)
        torch.bitwise_and(prod_b, _MASK32, out=c1)
        torch.bitwise_right_shift(prod_a, 32, out=c2).bitwise_and_(_MASK32).bitwise_xor_(c3).bitwise_xor_(k1)
        torch.bitwise_and(prod_a, _MASK32, out=c3)
        k0 = (k0 + _PHILOX_KEY_A) & _MASK32
        k1 = (k1 + _PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


def mask_bytes(stream: int, rows: torch.Tensor, n_cols: int) -> torch.Tensor:
    """The mask bytes [*rows.shape, n_cols] (uint8) of global rows ``rows`` and columns 0 .. n_cols - 1.

    One Philox call per (row, 16-column group), counter ``(group, row & 0xffffffff, row >> 32, 0)``;
    column ``c`` gets byte ``c % 4`` (little-endian) of word ``(c % 16) // 4``.

    Under graph capture (torch.compile, FakeTensorMode) this is one opaque custom op,
    ``seqpar::dropout_mask_bytes``, run eagerly inside the compiled program. Traced, the Philox rounds
    were wrong and slow to compile: inductor's C++ code does not wrap the int64 products as eager torch
    does (signed overflow: compiled masks differed), a dynamic stream seed became symbolic arithmetic
    (a C++ compile error), and the fused rounds took minutes to build.
    """
    if not is_int(n_cols) or n_cols < 0:
        raise ValueError(f"n_cols must be a non-negative int, got {n_cols!r}")
    if not is_int(stream) or not 0 <= stream < 2**64:
        raise ValueError(f"stream must be an int in [0, 2**64) (a stream seed), got {stream!r}")
    if not isinstance(rows, torch.Tensor) or rows.dtype.is_floating_point or rows.dtype.is_complex \
            or rows.dtype == torch.bool:
        raise ValueError(f"rows must be an integer tensor of row indices, got "
                         f"{rows.dtype if isinstance(rows, torch.Tensor) else type(rows).__name__}")
    # The op's int arguments are int64: a stream past 2**63 travels as its two's-complement value, whose low
    # and high words (philox4x32's key) are the same (a captured call failed on it, an eager one ran).
    return _mask_bytes_op(stream - 2**64 if stream >= 2**63 else stream, rows, n_cols)


@kernel_op("seqpar::dropout_mask_bytes")
def _mask_bytes_op(stream: int, rows: torch.Tensor, n_cols: int) -> torch.Tensor:
    rows = rows.to(torch.int64).unsqueeze(-1)                                 # [..., 1]
    groups = torch.arange(-(-n_cols // MASK_GROUP), device=rows.device)       # [G]
    # rows are the 64 bits of an unsigned row index: the high word of one past 2**63 (a negative int64) is
    # its bits, not the sign-extended shift (the kernels read it as uint32)
    words = torch.stack(philox4x32(stream, groups, rows & _MASK32, (rows >> 32) & _MASK32, torch.zeros_like(groups)),
                        -1)
    # A word's 4 bytes, least significant first, are its int32 bit pattern's bytes on a little-endian
    # device (every GPU, x86, Arm): one reinterpretation, not 4 shifts of an int64 per byte (3x faster on
    # CPU). uint32 values >= 2**31 map to their two's-complement int32 first, so the cast never wraps.
    words_int32 = (words - ((words >> 31) << 32)).to(torch.int32)             # [..., G, word]
    group_bytes = words_int32.view(torch.uint8).unflatten(-1, (4, 4))         # [..., G, word, byte]
    if words.device.type == "cpu" and sys.byteorder == "big":
        group_bytes = group_bytes.flip(-1)
    return group_bytes.flatten(-3)[..., :n_cols].contiguous()


@_mask_bytes_op.register_fake
def _(stream, rows, n_cols):
    return rows.new_empty((*rows.shape, n_cols), dtype=torch.uint8)


def dropout_keep_mask(stream: int, rows: torch.Tensor, n_cols: int, threshold: int) -> torch.Tensor:
    """Bool keep-mask [*rows.shape, n_cols]: ``mask_bytes(stream, rows, n_cols) >= threshold`` (P, an int
    in [0, 256): :func:`dropout_threshold`)."""
    _check_threshold(threshold)
    return mask_bytes(stream, rows, n_cols) >= threshold


def _check_threshold(threshold) -> None:
    if not is_int(threshold) or not 0 <= threshold < 256:
        raise ValueError(f"a dropout byte threshold is an int in [0, 256) (dropout_threshold(p)), got {threshold!r}")


def dropout_threshold(p, name: str = "dropout probability p") -> int:
    """``P = round(p * 256)``, the byte threshold of dropout probability ``p`` (kept iff byte >= P).

    Raises ValueError, naming ``name``, unless p is a real number (Python or numpy, not a bool) in [0, 1)
    with ``P < 256`` (p < 255.5 / 256). A p in (0, 1/512] rounds to P = 0 and drops nothing: a
    UserWarning says so (once per place it is asked from), and it is still accepted, so a checkpoint whose
    config carries such a p loads.
    """
    if type(p) is not float and (not isinstance(p, numbers.Real) or isinstance(p, bool)):   # float: per call
        raise ValueError(f"{name} must be in [0, 1) (a real number, not a {type(p).__name__}), got {p!r}")
    value = float(p)
    if not 0.0 <= value < 1.0 or round(value * 256) >= 256:
        raise ValueError(f"{name} must be in [0, 1) with round(p * 256) < 256 (p < 0.998046875), got {p!r}")
    threshold = round(value * 256)
    if threshold == 0 and value > 0:
        _warn_at_caller(f"{name} = {p!r} drops nothing: the masks drop in steps of 1/256 (p is rounded to "
                        f"round(p * 256) / 256), and it rounds to 0; pass 0, or a p above 1/512")
    return threshold


# Modules whose frames stand between the user's line and the check: seqpar's, torch's module calls and
# autograd, and the stdlib helpers seqpar calls through (dataclasses.replace re-validates a config).
_NOT_THE_CALLER = ("seqpar", "torch", "dataclasses", "contextlib", "functools")


def _generated_init(code) -> bool:
    """A dataclass's generated ``__init__`` (a config subclass's runs in the user's module)."""
    return code.co_name == "__init__" and code.co_filename.startswith("<")


def _warn_at_caller(message: str) -> None:
    """A UserWarning attributed to the user's line (the first frame outside :data:`_NOT_THE_CALLER`),
    whichever of seqpar's functions asked (a config, a model's forward, an op), so the default filter shows
    it once per line of theirs and ``filterwarnings(module=...)`` can name their module. (Frames are told
    by their module's name: a dataclass's generated ``__init__`` runs in its class's module.)"""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_globals.get("__name__", "").partition(".")[0] in _NOT_THE_CALLER
                                 or _generated_init(frame.f_code)):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level + 1)


# float32(256 / (256 - P)) for every byte threshold P: quotients in double, rounded to fp32 once. A table
# built at import, so an op traced by torch.compile reads a constant instead of a tensor's value.
_DROPOUT_SCALES = tuple(torch.tensor([256.0 / (256 - p) for p in range(256)], dtype=torch.float32).tolist())


def dropout_scale(threshold: int) -> float:
    """``float32(256 / (256 - P))``: the factor of kept values, as a Python float (exactly an fp32).

    The quotient is computed in double and rounded to fp32 once; every backend uses this value. P is
    ``threshold``, the byte threshold of :func:`dropout_threshold`: an int in [0, 256) (ValueError
    otherwise: -1 read the table from its end).
    """
    _check_threshold(threshold)
    return _DROPOUT_SCALES[threshold]


def effective_dropout_p(p: float) -> float:
    """The probability dropout ``p`` really drops with: ``round(p * 256) / 256`` (p = 0.1 -> 0.1015625)."""
    return dropout_threshold(p) / 256


def resolve_seed(seed: Optional[int]) -> int:
    """Validate a user-given op seed, or draw one from the seqpar generator when ``None``."""
    if seed is None:
        return draw_for_graph(next_op_seed)
    return check_stream_seed(seed)


def check_stream_seed(seed, name: str = "seed") -> int:
    """``seed`` if it is a Philox stream seed (an int in [0, 2**62)), else a ValueError naming ``name``."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**_STREAM_SEED_BITS:
        raise ValueError(f"{name} must be an int in [0, 2**62), got {seed!r}")
    return seed
