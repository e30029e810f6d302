"""Rotary position embeddings (RoPE) on q and k, HF Llama's default "rotate half" form.

Math, for each head ``x = [x1 | x2]`` (the two halves of d) of sequence row i::

    inv_freq_j = 1 / theta**(2j / d)                      j < d / 2   (fp32, computed as HF does;
                                                          scaled: LinearScaling, Llama 3.1's
                                                          RopeScaling, YaRN's YarnScaling)
    angle_ij   = float(position_offset + i) * inv_freq_j  (fp32)
    out[..., :d/2] = x1 * cos(angle) - x2 * sin(angle)
    out[..., d/2:] = x2 * cos(angle) + x1 * sin(angle)

evaluated in fp32 and rounded once. This is ``apply_rotary_pos_emb(q, k, cos, sin)`` of HF Llama with
``LlamaRotaryEmbedding``'s cos / sin (default rope type, "linear", "llama3" or "yarn"; without
HF's attention scaling, 1 but with "yarn", whose factor is the attention's): in fp32 the two agree to
within an ulp or so of cos / sin (bit for bit where both evaluate cos / sin alike); in fp16 / bf16 the
result here is the fp32 rotation rounded once, where HF rounds cos / sin and each product to the input
dtype. Positions are global: a sequence shard passes the global position of its first row as
``position_offset`` and gets exactly the unsharded result's rows.

==============  ================  ================================================================
tensor          shape             layout
==============  ================  ================================================================
q               [s, b, Hq, d]     fp32 / fp16 / bf16; any strides (e.g. views of a fused QKV output)
k               [s, b, Hk, d]     like q; Hk may differ from Hq (grouped-query attention)
q_rot, k_rot    like q, k         new contiguous tensors, or q and k themselves with ``inplace=True``
==============  ================  ================================================================

float64 inputs (for gradcheck) run on the torch backend (the rotation in float64, the angles as above).
Nothing is saved for backward but the sizes: the gradient is the rotation of the incoming gradients by
-angle (``inverse=True``).

The autograd function rotates one tensor (q and k are two calls): autograd can't take a function that
modifies two views of one tensor (a fused QKV output) in place. Backend interface (registered with
:func:`seqpar.ops.registry.register`), on one ``[s, b, H, d]`` tensor::

    forward(x, position_offset, freqs, inplace) -> x_rot      # inplace: x itself, rotated in place
    backward(grad_x_rot, position_offset, freqs) -> grad_x

``freqs`` is the tuple of floats that determines the frequencies: ``(theta,)``, or theta and the numbers of
a scaling (:func:`rope_frequencies`); every backend and custom op carries it and computes ``inv_freq`` from
it alone.

========  ===============================================================  ==============
backend   what runs                                                        d
========  ===============================================================  ==============
torch     fp32 reference (the test oracle, CPU fallback)                   any even
triton    ``triton_kernels/rotary.py``: a program per (sequence row, block  even, <= 8192
          of heads), cos / sin once per program
cuda      ``csrc/rotary.cu``: a block per (sequence row, group of heads),   any even
          16-byte vectors, cos / sin once per thread for its heads
========  ===============================================================  ==============

The kernels compute cos / sin themselves (the accurate ``cosf`` / ``sinf`` on CUDA, as torch's cos / sin
are) from ``inv_freq`` computed by torch on the CPU exactly as HF does; they take q and k with unit stride
along d (another stride is copied first, or refused with ``inplace=True``). Custom ops:
``seqpar::rotary_embedding_{triton,cuda}`` (out of place) and ``..._inplace`` (mutating x); eager calls run
their launchers directly (:func:`seqpar.ops.registry.kernel_op`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import List, Optional, Sequence, Tuple

import torch

from . import registry
from .rows import vectorized
from .. import _ext
from .._custom_op import capturing_graph

#: The op's name in :mod:`seqpar.ops.registry`.
OP = "rotary_embedding"
#: The largest head dim d the Triton kernel takes: it holds half a head per program row.
MAX_TRITON_HEAD_DIM = 8192
# theta's range: fp32's normal numbers. The frequencies are fp32 (as HF's): past 3.4e38 theta is inf there
# (frequencies 1, 0, 0, ...), and below 1.2e-38 its powers underflow (frequencies inf).
#: The thetas the op takes, [min, max] inclusive: fp32's normal numbers.
THETA_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


def check_theta(theta, name: str = "theta") -> None:
    """ValueError naming ``name`` unless theta is a positive finite number within :data:`THETA_RANGE`."""
    if not registry.is_positive_finite(theta):
        raise ValueError(f"{name} must be a finite positive float, got {theta!r}")
    if not THETA_RANGE[0] <= theta <= THETA_RANGE[1]:
        raise ValueError(f"{name} must be within fp32's range [{THETA_RANGE[0]:.4g}, {THETA_RANGE[1]:.4g}] (the "
                         f"frequencies 1 / theta**(2j / d) are fp32: inf or 0 beyond it), got {theta!r}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's scaling of the RoPE frequencies (HF ``rope_type="llama3"``; Llama 3.1 / 3.2 / 3.3): with
    L = ``original_max_position_embeddings``, the wavelength ``w_j = 2 pi / inv_freq_j`` of each default
    frequency decides::

        w_j > L / low_freq_factor                 inv_freq_j / factor              (long waves: stretched)
        w_j < L / high_freq_factor                inv_freq_j                       (short waves: kept)
        otherwise                                 (1 - c_j) inv_freq_j / factor + c_j inv_freq_j,
                                                  c_j = (L / w_j - low_freq_factor) / (high_freq_factor - low_freq_factor)

    in fp32 by HF's ops, so the frequencies are HF's bit for bit. The defaults are Llama 3.1's (Llama 3.2's
    1B / 3B use factor 32). The attention is not rescaled (HF's attention factor is 1 for this type).
    ValueError naming the field for factors that are not finite, positive and within fp32's normal range
    (:data:`THETA_RANGE`), low_freq_factor not below high_freq_factor, or an original_max_position_embeddings
    that is not a positive int.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not registry.is_positive_finite(value):
                raise ValueError(f"RopeScaling.{name} must be a finite positive float, got {value!r}")
            if not THETA_RANGE[0] <= value <= THETA_RANGE[1]:   # a factor of 1e-39: frequencies inf, NaN rotations
                raise ValueError(f"RopeScaling.{name} must be within fp32's range [{THETA_RANGE[0]:.4g}, "
                                 f"{THETA_RANGE[1]:.4g}] (the frequencies are fp32), got {value!r}")
            object.__setattr__(self, name, float(value))
        if not self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"RopeScaling.low_freq_factor ({self.low_freq_factor!r}) must be below high_freq_factor "
                             f"({self.high_freq_factor!r}): the two wavelength bounds L / factor would cross")
        length = self.original_max_position_embeddings
        if not (isinstance(length, int) and not isinstance(length, bool) and length > 0):
            raise ValueError(f"RopeScaling.original_max_position_embeddings must be a positive int, got {length!r}")


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN's scaling of the RoPE frequencies (HF ``rope_type="yarn"``; Peng et al. 2023: Qwen2.5's long
    context, and long-context fine-tuning of the Llama family). With d the head dim, L =
    ``original_max_position_embeddings`` and the correction range of dimension indices (fp64 scalars)::

        dim(r) = d ln(L / (2 pi r)) / (2 ln theta)
        low    = max(floor(dim(beta_fast)), 0),  high = min(ceil(dim(beta_slow)), d - 1)   (no floor / ceil
                                                                                   with truncate=False)
        ramp_j = clamp((j - low) / (high - low), 0, 1)      j < d / 2  (high + 0.001 where low = high)
        inv_freq_j = (1 / (factor theta**(2j / d))) ramp_j + (1 / theta**(2j / d)) (1 - ramp_j)

    in fp32 by HF's ops, so the frequencies are HF's bit for bit: the fast-turning dimensions keep their
    frequency, the slow ones are divided by ``factor``, those between blend. HF also multiplies cos and sin
    by :attr:`attention_scaling` (``attention_factor``, by default ``0.1 ln(factor) + 1``), which scales
    q . k by its square: :func:`rotary_embedding` rotates without it, and :class:`seqpar.TransformerLayer`
    applies it as the attention's softmax scale (``attention_scaling**2 / sqrt(d)``: the same scores, one
    rounding fewer). ValueError naming the field for a factor below 1 or beyond fp32's range, betas that are
    not positive and finite, an attention factor that is not positive and finite, an
    original_max_position_embeddings that is not a positive int, a truncate that is not a bool.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None
    truncate: bool = True

    def __post_init__(self):
        if not (registry.is_positive_finite(self.factor) and 1 <= self.factor <= THETA_RANGE[1]):
            raise ValueError(f"YarnScaling.factor must be a finite float >= 1 within fp32's range, got {self.factor!r}")
        for name in ("beta_fast", "beta_slow") + (("attention_factor",) if self.attention_factor is not None else ()):
            value = getattr(self, name)
            if not (registry.is_positive_finite(value) and value <= THETA_RANGE[1]):
                raise ValueError(f"YarnScaling.{name} must be a finite positive float, got {value!r}")
        for name in ("factor", "beta_fast", "beta_slow") + (("attention_factor",) if self.attention_factor is not None
                                                             else ()):
            object.__setattr__(self, name, float(getattr(self, name)))
        length = self.original_max_position_embeddings
        if not (isinstance(length, int) and not isinstance(length, bool) and length > 0):
            raise ValueError(f"YarnScaling.original_max_position_embeddings must be a positive int, got {length!r}")
        if not isinstance(self.truncate, bool):
            raise ValueError(f"YarnScaling.truncate must be a bool, got {self.truncate!r}")

    @property
    def attention_scaling(self) -> float:
        """The factor HF multiplies cos and sin by: ``attention_factor``, or ``0.1 ln(factor) + 1`` (1 for
        factor 1), as HF computes it."""
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def correction_range(self, d: int, theta: float) -> Tuple[float, float]:
        """(low, high): the dimension indices between which the frequencies blend (class docstring), for head
        dim ``d`` and RoPE base ``theta`` (ValueError for theta 1: every dimension turns alike)."""
        if theta == 1:
            raise ValueError("YaRN's scaling needs a rope_theta other than 1 (its correction range divides by "
                             "ln theta)")

        def dim(rotations: float) -> float:
            length = self.original_max_position_embeddings
            return (d * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = dim(self.beta_fast), dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        return float(low), float(high + 0.001 if low == high else high)


@dataclasses.dataclass(frozen=True)
class LinearScaling:
    """Linear scaling of the RoPE frequencies, position interpolation (HF ``rope_type="linear"``: DeepSeek
    Coder, Llama 2 long-context fine-tunes): ``inv_freq_j = (1 / theta**(2j / d)) / factor`` in fp32, HF's
    bit for bit; the attention is not rescaled. ValueError for a factor that is not finite, positive and
    within fp32's normal range."""

    factor: float

    def __post_init__(self):
        if not (registry.is_positive_finite(self.factor) and THETA_RANGE[0] <= self.factor <= THETA_RANGE[1]):
            raise ValueError(f"LinearScaling.factor must be a finite positive float within fp32's range, got "
                             f"{self.factor!r}")
        object.__setattr__(self, "factor", float(self.factor))


#: The scalings of the RoPE frequencies (``rope_scaling=``): linear, Llama 3.1's, YaRN's.
ROPE_SCALINGS = (LinearScaling, RopeScaling, YarnScaling)


def check_rope_scaling(rope_scaling, name: str = "rope_scaling") -> None:
    """ValueError unless ``rope_scaling`` is None or one of :data:`ROPE_SCALINGS`."""
    if rope_scaling is not None and not isinstance(rope_scaling, ROPE_SCALINGS):
        raise ValueError(f"{name} must be a seqpar.ops.LinearScaling, RopeScaling, YarnScaling or None, got "
                         f"{rope_scaling!r}")


def _linear_scaled(powers: torch.Tensor, factor: float) -> torch.Tensor:
    """:class:`LinearScaling` of the default frequencies ``1 / powers`` (``powers``: theta**(2j / d), fp32)."""
    return 1.0 / powers / factor


def _llama3_scaled(powers: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                   length: float) -> torch.Tensor:
    """:class:`RopeScaling` of the default frequencies ``1 / powers`` (fp32 [d / 2]), on its fields as plain
    floats (what a traced graph computes: no dataclass built there)."""
    inv_freq = 1.0 / powers
    # 2 pi written out (the double 2 * math.pi): under torch.compile(dynamic=True) Dynamo makes a global
    # float such as math.pi a symbol, which it can't lift into the autograd Function's subgraph
    wavelength = 6.283185307179586 / inv_freq
    long_waves = wavelength > length / low_freq_factor
    stretched = torch.where(long_waves, inv_freq / factor, inv_freq)
    blend = (length / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * stretched / factor + blend * stretched
    between = ~(wavelength < length / high_freq_factor) * ~long_waves
    return torch.where(between, blended, stretched)


def _yarn_scaled(powers: torch.Tensor, factor: float, low: float, high: float) -> torch.Tensor:
    """:class:`YarnScaling` of the default frequencies ``1 / powers`` (``powers``: theta**(2j / d), fp32
    [d / 2]), from its factor and correction range as plain floats, by HF's ops."""
    extrapolation, interpolation = 1.0 / powers, 1.0 / (factor * powers)
    ramp = torch.clamp((torch.arange(powers.shape[0], dtype=torch.float32, device=powers.device) - low) / (high - low),
                       0, 1)
    kept = 1 - ramp
    return interpolation * (1 - kept) + extrapolation * kept


# How the frequencies of a ``freqs`` tuple are scaled, by the count of its numbers after theta (a code number
# in the tuple would be a float compared inside the autograd Function's subgraph, a symbol Dynamo can't lift
# there under torch.compile(dynamic=True)): (theta, factor) linear, (theta, factor, low, high) YaRN with its
# correction range, (theta, factor, low_freq_factor, high_freq_factor, original context) Llama 3.1's.
_SCALED = {1: _linear_scaled, 3: _yarn_scaled, 4: _llama3_scaled}


def rope_frequencies(theta: float, scaling=None, d: Optional[int] = None) -> Tuple[float, ...]:
    """The ``freqs`` tuple the backends carry: ``(theta,)``; with a :class:`LinearScaling` ``(theta,
    factor)``; with a :class:`RopeScaling` ``(theta, factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings)``; with a :class:`YarnScaling` (which needs the head dim ``d``)
    ``(theta, factor, low, high)``, its correction range resolved here."""
    # float() of each, here in the caller's frame: torch.compile creates the symbol of a float it makes dynamic
    # (dynamic=True, or a recompile for another scaling) where the float is first used, and one first used
    # inside the autograd Function's subgraph can't be lifted (an AssertionError, not a graph break); and
    # the correction range's math.log / floor here too, on plain floats
    if scaling is None:
        fields = ()
    elif isinstance(scaling, YarnScaling):
        fields = (scaling.factor, *scaling.correction_range(d, float(theta)))
    elif isinstance(scaling, LinearScaling):
        fields = (scaling.factor,)
    else:
        fields = (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor,
                  scaling.original_max_position_embeddings)
    return tuple(float(value) for value in (theta, *fields))


def rope_inv_freq(d: int, theta: float, scaling=None) -> torch.Tensor:
    """``1 / theta**(2j / d)``, j < d / 2, scaled by ``scaling`` (one of :data:`ROPE_SCALINGS`) if given: fp32
    on the CPU, by the same ops as HF's default ("linear", "llama3", "yarn") RoPE."""
    return _inv_freq(d, rope_frequencies(theta, scaling, d))


def _inv_freq(d: int, freqs: Sequence[float]) -> torch.Tensor:
    """:func:`rope_inv_freq` of a ``freqs`` tuple (:func:`rope_frequencies`)."""
    theta, *scaling = freqs
    # device="cpu" whatever the default device (a meta one made the copy to the layer's device fail)
    powers = float(theta) ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / d)
    return _SCALED[len(scaling)](powers, *scaling) if scaling else 1.0 / powers


@functools.lru_cache(maxsize=64)
def _inv_freq_on(device: torch.device, d: int, freqs: Tuple[float, ...]) -> torch.Tensor:
    """The frequencies of ``freqs`` on ``device``, copied there once (a copy per call would synchronise the
    stream)."""
    return _inv_freq(d, freqs).to(device)


# ----------------------------------------------------------------------------- torch reference
def _cos_sin(s: int, d: int, position_offset: int, freqs: Tuple[float, ...], device: torch.device):
    """fp32 ``[s, d/2]`` cos and sin of the angles of rows position_offset .. position_offset + s - 1."""
    positions = torch.arange(position_offset, position_offset + s, device=device)
    # While tracing (torch.compile, a fake or proxy mode) the frequencies are built in the graph: Dynamo
    # would trace past the cache, and a fake tensor cached there would be every later real call's.
    inv_freq = _inv_freq(d, freqs).to(device) if capturing_graph() else _inv_freq_on(device, d, tuple(freqs))
    angle = positions[:, None].float() * inv_freq[None, :]
    return angle.cos(), angle.sin()


def _torch_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half, acc = x.shape[-1] // 2, registry.acc_dtype(x.dtype)
    x1, x2 = x[..., :half].to(acc), x[..., half:].to(acc)
    c, s = cos[:, None, None, :].to(acc), sin[:, None, None, :].to(acc)
    return registry.cast(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1), x.dtype)


def _torch_forward(x, position_offset: int, freqs: Tuple[float, ...], inplace: bool):
    cos, sin = _cos_sin(x.shape[0], x.shape[-1], position_offset, freqs, x.device)
    x_rot = _torch_rotate(x, cos, sin)
    if not inplace:
        return x_rot
    # x itself, not copy_'s result: Dynamo does not see copy_'s return value as the input the autograd
    # Function marks dirty, and broke the graph there (a RoPE layer compiled to 6 graphs, under full
    # recompute to none).
    x.copy_(x_rot)
    return x


def _torch_backward(grad, position_offset: int, freqs: Tuple[float, ...]):
    cos, sin = _cos_sin(grad.shape[0], grad.shape[-1], position_offset, freqs, grad.device)
    return _torch_rotate(grad, cos, -sin)


registry.register(registry.Backend(OP, "torch", _torch_forward, _torch_backward))


def _kernel_backend(name: str, rotate, check) -> registry.Backend:
    """A registry backend over one kernel launcher ``rotate(x, out, position_offset, freqs, inverse)``
    (``out`` may be ``x``), exposed as two ``torch.library`` custom ops ``seqpar::rotary_embedding_<name>``
    (out of place, with a fake implementation for torch.compile) and ``..._inplace`` (mutates x)."""

    def out_of_place(x: torch.Tensor, position_offset: int, freqs: List[float], inverse: bool) -> torch.Tensor:
        out = _new_like(x)
        rotate(x, out, position_offset, tuple(freqs), inverse)
        return out

    def in_place(x: torch.Tensor, position_offset: int, freqs: List[float], inverse: bool) -> None:
        rotate(x, x, position_offset, tuple(freqs), inverse)

    out_of_place_op = registry.kernel_op(f"seqpar::rotary_embedding_{name}", out_of_place)
    out_of_place_op.register_fake(lambda x, position_offset, freqs, inverse: _new_like(x))
    inplace_op = registry.kernel_op(f"seqpar::rotary_embedding_{name}_inplace", in_place, mutates_args=("x",))

    def forward(x, position_offset: int, freqs: Tuple[float, ...], inplace: bool):
        if inplace:
            inplace_op(x, position_offset, list(freqs), False)
            return x
        return out_of_place_op(_unit_d(x), position_offset, list(freqs), False)

    def backward(grad, position_offset: int, freqs: Tuple[float, ...]):
        return out_of_place_op(_unit_d(grad), position_offset, list(freqs), True)

    return registry.Backend(OP, name, forward, backward, check)


def _unit_d(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.numel() == 0 else t.contiguous()


def _new_like(x: torch.Tensor) -> torch.Tensor:
    """The out-of-place output: contiguous, x's shape (every buffer the custom ops allocate; tests poison it)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# ----------------------------------------------------------------------------- triton backend
def _triton_rotate(x, out, position_offset: int, freqs: Tuple[float, ...], inverse: bool) -> None:
    from ..triton_kernels import rotary as kernels

    with _ext.on_device(x):
        kernels.rotate(x, out, _inv_freq_on(x.device, x.shape[-1], freqs), position_offset, inverse)


def _triton_check(d=None, dtype=None, **_):
    if d is not None and d > MAX_TRITON_HEAD_DIM:
        return f"head dim d={d} exceeds the Triton kernel's {MAX_TRITON_HEAD_DIM}"
    return registry.kernel_dtype_check(dtype)


# what `seqpar info` shows as the Triton backend's limits (the first line of its check's docstring)
_triton_check.__doc__ = f"head dim d <= {MAX_TRITON_HEAD_DIM}; {registry.kernel_dtype_check.__doc__.splitlines()[0]}"


registry.register(_kernel_backend("triton", _triton_rotate, _triton_check))


# ----------------------------------------------------------------------------- cuda backend
def _cuda_rotate(x, out, position_offset: int, freqs: Tuple[float, ...], inverse: bool) -> None:
    ext = _ext.cuda_extension()
    s, b, heads, d = x.shape
    strides = x.stride()[:3] + out.stride()[:3]
    with _ext.on_device(x):
        ext.rotary_embedding(x.data_ptr(), out.data_ptr(), _inv_freq_on(x.device, d, freqs).data_ptr(), s, b, heads,
                             d, *strides, int(position_offset), bool(inverse), _ext.DTYPE_CODES[x.dtype],
                             vectorized(x.dtype, d // 2, (x, out), strides), _ext.cuda_stream(x.device))


registry.register(_kernel_backend("cuda", _cuda_rotate, registry.kernel_dtype_check))


# ----------------------------------------------------------------------------- autograd
class _RotaryEmbedding(torch.autograd.Function):
    """One tensor (q or k): saves nothing, backward rotates the gradient by -angle."""

    @staticmethod
    def forward(ctx, x, position_offset, freqs, inplace, impl):
        x_rot = impl.forward(x, position_offset, freqs, inplace)
        if inplace:
            ctx.mark_dirty(x)
        ctx.position_offset, ctx.freqs, ctx.impl = position_offset, freqs, impl
        return x_rot

    @staticmethod
    @registry.once_differentiable
    def backward(ctx, grad_x_rot):
        return ctx.impl.backward(grad_x_rot, ctx.position_offset, ctx.freqs), None, None, None, None


def _check_inputs(q, k, position_offset, theta, rope_scaling, inplace) -> int:
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4 or t.dtype not in registry.DTYPES:
            raise ValueError(f"{name} must be a [s, b, heads, d] tensor of {registry.DTYPES}, got {t.dtype} "
                             f"{tuple(t.shape)}")
    registry.check_dense(q=q, k=k)
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} != q dtype {q.dtype}")
    if (k.shape[0], k.shape[1], k.shape[3]) != (q.shape[0], q.shape[1], q.shape[3]):
        raise ValueError(f"k shape {tuple(k.shape)} must match q shape {tuple(q.shape)} in s, b and d")
    d = q.shape[3]
    if d == 0 or d % 2:
        raise ValueError(f"head dim d must be even and positive, got d={d}")
    if k.device != q.device:
        raise ValueError(f"q and k must be on one device, got {q.device} and {k.device}")
    registry.check_offset("position_offset", position_offset)
    check_theta(theta)
    check_rope_scaling(rope_scaling)
    if not isinstance(inplace, bool):
        raise ValueError(f"inplace must be a bool, got {inplace!r}")
    if inplace:
        for name, t in (("q", q), ("k", k)):
            if t.numel() and t.stride(-1) != 1:
                raise ValueError(f"inplace=True needs {name} with unit stride along d, got strides {t.stride()}")
            if not capturing_graph() and torch._debug_has_internal_overlap(t) == 1:   # 1: certainly overlaps
                raise ValueError(f"inplace=True needs {name} without repeated elements (an expanded view), got "
                                 f"{tuple(t.shape)} strides {t.stride()}")
        # A graph capture has no addresses (fake tensors): there, only the same tensor object is caught.
        overlap = q is k if capturing_graph() else _shares_elements(q, k)
        if overlap:
            raise ValueError("inplace=True needs q and k not to share elements (they overlap in memory), "
                             f"got q {tuple(q.shape)} strides {q.stride()} at element {q.storage_offset()} and "
                             f"k {tuple(k.shape)} strides {k.stride()} at element {k.storage_offset()} of one "
                             "storage")
    return d


def _shares_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b (views of any strides, no element repeated within one) share an element; exact.

    Views of other storages, or of disjoint address ranges, share none. Views with one set of strides
    that nest (each a multiple of the next smaller one, the digits of both views' offsets and extents
    within each radix) are boxes in that mixed radix, sharing an element iff their index intervals meet
    in every dim: so the q and k heads of a fused QKV output, whose address ranges interleave, are told
    apart without touching an element. Any other pair (differently strided views of one buffer) compares
    its element offsets.
    """
    if not (a.numel() and b.numel()) or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if a.element_size() != b.element_size():
        return True   # reinterpreted bytes: no element grid in common; assume the worst
    spans = [(t.storage_offset(), t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))
             for t in (a, b)]
    if spans[0][1] < spans[1][0] or spans[1][1] < spans[0][0]:
        return False
    meet = _nested_boxes_meet(a, b)
    if meet is not None:
        return meet
    offsets = []
    for t in (a, b):
        grid = torch.zeros((), dtype=torch.int64)
        for dim, (n, st) in enumerate(zip(t.shape, t.stride())):
            grid = grid.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st
        offsets.append(grid.flatten() + t.storage_offset())
    return bool(torch.isin(offsets[0], offsets[1]).any())


def _nested_boxes_meet(a: torch.Tensor, b: torch.Tensor) -> Optional[bool]:
    """Whether the boxes of a and b meet: each view's [start, end) index interval per dim of the mixed
    radix of their common strides (dims of size 1 dropped). None when they have no common nesting
    strides or an offset's digits carry past a radix (the boxes would not be exact)."""
    dims = [sorted(((st, n) for n, st in zip(t.shape, t.stride()) if n > 1), reverse=True) for t in (a, b)]
    strides = [st for st, _ in dims[0]]
    if strides != [st for st, _ in dims[1]] or not strides or strides[-1] == 0:
        return None
    if any(outer % inner for outer, inner in zip(strides, strides[1:])):
        return None
    boxes = []
    for t, t_dims in zip((a, b), dims):
        rest, box = t.storage_offset(), []
        for j, (st, n) in enumerate(t_dims):
            digit, rest = divmod(rest, st)
            if j and digit + n > strides[j - 1] // st:   # past the radix: the digit carries, no exact box
                return None
            box.append((digit, digit + n))
        boxes.append((box, rest))
    (box_a, rest_a), (box_b, rest_b) = boxes
    if rest_a != rest_b:   # offsets differ modulo the smallest stride: interleaved grids, nothing shared
        return False
    return all(lo_a < hi_b and lo_b < hi_a for (lo_a, hi_a), (lo_b, hi_b) in zip(box_a, box_b))


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, *, position_offset: int = 0, theta: float = 10000.0,
                     rope_scaling: Optional[LinearScaling | RopeScaling | YarnScaling] = None, inplace: bool = False,
                     backend: str = "auto"
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[s, b, Hq, d]`` and k ``[s, b, Hk, d]`` by their positions (HF Llama's RoPE).

    Returns ``(q_rot, k_rot)``. Row i of the sequence has position ``position_offset + i`` (global: a
    sequence shard passes the position of its first row). ``inplace=True`` writes into q and k (unit
    stride along d) and returns them; autograd sees them modified in place. Gradients flow to q and k.
    ValueError (naming the value) for q / k that are not floating 4-D tensors of one dtype and device
    with equal s, b and d, an odd d, a position_offset outside [0, 2**62), a theta that is not positive
    and finite or is beyond fp32's normal range [1.2e-38, 3.4e38], and with ``inplace=True`` for q / k
    that are strided along d, expanded, or overlap.

    Args:
        position_offset: global position of sequence row 0 (an int in [0, 2**62)).
        theta: RoPE base (HF ``rope_theta``), positive.
        rope_scaling: None (the default RoPE), or the frequencies' linear scaling (:class:`LinearScaling`, HF
            ``rope_type="linear"``), or Llama 3.1's (:class:`RopeScaling`, HF ``"llama3"``), or YaRN's
            (:class:`YarnScaling`, HF ``"yarn"``; its attention factor is not applied here: it is the
            attention's, see :class:`YarnScaling`).
        inplace: write into q and k instead of new tensors.
        backend: "auto" | "torch" | "triton" | "cuda" (see :mod:`seqpar.ops.registry`).
    """
    d = _check_inputs(q, k, position_offset, theta, rope_scaling, inplace)
    impl = registry.select(OP, backend, q.device, dtype=q.dtype, d=d)
    # position_offset as given, not int(): a SymInt offset stays symbolic
    args = (position_offset, rope_frequencies(theta, rope_scaling, d), inplace, impl)
    return _RotaryEmbedding.apply(q, *args), _RotaryEmbedding.apply(k, *args)
