"""Counter-based dropout randomness shared by every backend.

Every dropout mask element is a pure function of ``(stream_seed, row, col)``::

    u = philox_uniform(stream_seed + row, col)      # Triton: tl.rand(stream_seed + row, col)
    keep = u >= p                                   # kept elements are scaled by 1 / (1 - p)

``philox_uniform`` is Philox-4x32-10 with key ``(seed & 0xffffffff, seed >> 32)`` and counter
``(col, 0, 0, 0)``, mapped to ``[0, 1)`` exactly as ``triton.language.rand`` does for 32-bit offsets,
so the torch reference, the Triton kernels and the CUDA kernels (``csrc/philox.cuh``) agree bit for
bit.

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
draws the same number and replays the same masks, while each new step draws fresh ones. Because nothing depends on the
tensor-parallel rank or the sequence shard, the same seed gives the same masks for any TP size, with or
without sequence parallelism; TP ranks must hold the same generator state, which layers and models check
when they are built (:func:`seqpar.parallel.state.check_ranks_agree`).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

__all__ = [
    "manual_seed", "initial_seed", "stream_seed", "next_layer_seed", "next_op_seed", "generator_fingerprint",
    "philox_uniform", "dropout_keep_mask", "Site",
]

_MASK32 = 0xFFFFFFFF
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_ROUNDS = 10
# Largest int32 times this scale stays below 1.0 in fp32 (the constant tl.rand uses).
_UNIFORM_SCALE = 4.6566127342e-10
# Stream seeds are kept below 2**62 so that ``stream_seed + row`` never overflows int64.
_STREAM_SEED_BITS = 62


class Site:
    """Dropout sites of a transformer layer; part of the RNG stream identity."""

    ATTENTION = 1        # softmax dropout inside the attention core
    ATTENTION_OUT = 2    # hidden dropout after the attention projection
    MLP_OUT = 3          # hidden dropout after the MLP
    EMBEDDING = 4        # embedding dropout (GPTModel)


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
        seed: int in [0, 2**64).
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < _SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    _state.seed = int(seed)
    torch.default_generator.manual_seed(int(seed))


def initial_seed() -> int:
    """The seed last passed to :func:`manual_seed` (0 by default)."""
    return _state.seed


def generator_fingerprint(with_torch_state: bool = True) -> Dict[str, object]:
    """What decides this process's dropout seeds and parameter init: the seqpar seed and the bytes of
    torch's default CPU generator state (a placeholder when ``with_torch_state`` is False: the same
    keys either way). Tensor-parallel ranks must agree on them (checked when layers and models are
    built)."""
    state = torch.get_rng_state().numpy().tobytes() if with_torch_state else "not compared (no dropout)"
    return {"seqpar seed (seqpar.manual_seed)": _state.seed, "torch default CPU generator state": state}


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def stream_seed(seed: int, layer_number: int, site: int, call: int = 0) -> int:
    """Hash ``(seed, layer_number, site, call)`` into a 62-bit Philox stream seed."""
    h = _splitmix64(seed)
    for part in (layer_number, site, call):
        h = _splitmix64(h ^ (part & 0xFFFFFFFFFFFFFFFF))
    return h >> (64 - _STREAM_SEED_BITS)


def _draw() -> int:
    """63 random bits from torch's default CPU generator (the state torch's checkpoint restores)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=None))


def next_layer_seed(layer_number: int) -> int:
    """Draw the seed of one training forward of layer ``layer_number``.

    ``stream_seed(manual seed, layer_number, 0, draw)`` with ``draw`` taken from torch's default CPU
    generator. The per-site stream seeds are ``stream_seed(returned, layer_number, site)``. Draw once
    per forward, outside any region seqpar recomputes; an external checkpoint that re-runs the whole
    forward restores the generator first, so the re-run gets the same seed.
    """
    return stream_seed(_state.seed, layer_number, 0, _draw())


def next_op_seed() -> int:
    """A fresh stream seed for a functional op called with ``seed=None`` (drawn like
    :func:`next_layer_seed`, so a checkpointed re-run of the op replays its mask)."""
    return stream_seed(_state.seed, -1, 0, _draw())


def _philox_c0(k0: torch.Tensor, k1: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
    c1 = c2 = c3 = torch.zeros_like(c0)
    for _ in range(_PHILOX_ROUNDS):
        # 32 x 32-bit products in int64: the 64-bit result wraps modulo 2**64 (two's complement), so
        # its high and low words are exactly the unsigned product's.
        prod_b = c2 * _PHILOX_ROUND_B
        prod_a = c0 * _PHILOX_ROUND_A
        c0 = ((prod_b >> 32) & _MASK32).bitwise_xor_(c1).bitwise_xor_(k0)
        c2 = ((prod_a >> 32) & _MASK32).bitwise_xor_(c3).bitwise_xor_(k1)
        c1 = prod_b.bitwise_and_(_MASK32)
        c3 = prod_a.bitwise_and_(_MASK32)
        k0 = (k0 + _PHILOX_KEY_A) & _MASK32
        k1 = (k1 + _PHILOX_KEY_B) & _MASK32
    return c0


def philox_uniform(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``tl.rand(seed, offset)`` in torch, bit for bit: float32 uniforms in [0, 1).

    Philox-4x32-10, key ``(seed & 0xffffffff, seed >> 32)``, counter ``(offset, 0, 0, 0)``; the first
    output word is mapped to [0, 1) like ``uint_to_uniform_float``.

    Args:
        seed: int64 tensor of non-negative seeds (broadcast against ``offset``).
        offset: int64 tensor of offsets in [0, 2**31) (Triton's int32 offsets).
    """
    seed, offset = torch.broadcast_tensors(seed.to(torch.int64), offset.to(torch.int64))
    words = _philox_c0(seed & _MASK32, (seed >> 32) & _MASK32, offset & _MASK32)
    # Reinterpret as int32, fold negatives (~x), scale: uint_to_uniform_float in triton.language.random.
    x = torch.where(words >= 2**31, words - 2**32, words)
    x = torch.where(x < 0, -x - 1, x)
    return x.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def dropout_keep_mask(stream: int, rows: torch.Tensor, cols: torch.Tensor, p: float) -> torch.Tensor:
    """Boolean keep-mask ``philox_uniform(stream + rows, cols) >= p`` (broadcast of rows and cols)."""
    return philox_uniform(rows.to(torch.int64) + stream, cols) >= p


def resolve_seed(seed: Optional[int]) -> int:
    """Validate a user-given op seed, or draw one from the seqpar generator when ``None``."""
    if seed is None:
        return next_op_seed()
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**_STREAM_SEED_BITS:
        raise ValueError(f"seed must be an int in [0, 2**62), got {seed!r}")
    return seed
