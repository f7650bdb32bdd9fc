"""MXFP4 (OCP Microscaling, E2M1 elements + E8M0 block scales) codec for the routed experts.

Storage layout (compressed-tensors `mxfp4-pack-quantized`, spec §4), for a logical weight
W [..., out, in] (nn.Linear orientation, `in` a multiple of 32):

* `packed` uint8 [..., out, in/2]: byte j holds column 2j in its LOW nibble and column 2j+1 in
  its HIGH nibble.
* nibble n (E2M1): bit 3 is the sign, the magnitude is E2M1_GRID[n & 7] with
  E2M1_GRID = (0, 0.5, 1, 1.5, 2, 3, 4, 6).
* `scale` uint8 [..., out, in/32]: E8M0 exponent byte s for each block of 32 consecutive input
  columns; multiplier 2^(s - 127); s = 255 means NaN (OCP MX).

W[r, c] = (-1)^sign * E2M1_GRID[n & 7] * 2^(s[r, c // 32] - 127).

Decoding is exact in float32 and bfloat16 (at most 2 significant bits times a power of two;
every value from 2^-128 up to 1.5 * 2^127 is representable). Only the extreme scale bytes can
overflow: |value| >= 2^128 (e.g. nibble magnitude >= 2 with byte 254) decodes to +-inf, as
float32 itself would. Everything is vectorised: no Python loop over elements or blocks.

Encoding (`encode_mxfp4`):
* Scale rule when none is given (OCP MX v1.0): shared exponent = floor(log2(amax)) - 2, where
  amax is the largest |w| of the 32-block and 2 = emax of E2M1 (6 = 1.5 * 2^2), i.e. the FLOOR
  rule; clamped to the E8M0 range [-127, 127] (bytes 0..254). An all-zero block gets byte 0.
  With this rule every block whose values already lie on an MXFP4 grid is re-encoded exactly.
* Element rounding: round-to-nearest, ties-to-even (on the E2M1 mantissa bit) onto the grid,
  saturating at +-6 (values beyond 6 * 2^e become +-6 * 2^e, never inf/NaN). The sign is taken
  from the sign bit, so -0.0 encodes as nibble 8 and tiny negative values round to -0.0 (IEEE
  semantics) -- this keeps decode -> encode byte-identical for both zero codes.
* A caller-given scale is used as is (needed for byte-identical re-saves, spec §4.3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "E2M1_GRID",
    "decode_mxfp4",
    "encode_mxfp4",
    "encode_mxfp4_reuse",
    "mxfp4_scales_ocp",
    "quantize_dequantize_mxfp4",
    "fake_quant_mxfp4",
    "straight_through",
    "BLOCK",
]

BLOCK = 32
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Rounding thresholds between consecutive grid magnitudes (codes k -> k+1). A tie goes to the
# even code: for thresholds whose lower code is even the tie stays below (x > t), for the others
# it moves up (x >= t, written as x > nextafter(t, 0) so that one bucketize does all of them).
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)
_BOUNDARIES = torch.tensor(_THRESHOLDS, dtype=torch.float32)
_BOUNDARIES = torch.where(torch.tensor(_TIE_UP), torch.nextafter(_BOUNDARIES, torch.zeros(7)), _BOUNDARIES)


def _pow2_table(negate: bool) -> torch.Tensor:
    """float32 [256]: 2^(s-127) (or 2^(127-s) when negate) built from bit patterns, so every
    entry is exact (no pow() rounding, subnormal 2^-127 included). Byte 255 -> NaN."""
    s = torch.arange(256, dtype=torch.int64)
    e = (127 - s) if negate else (s - 127)  # unbiased exponent, in [-128, 127] for s < 255
    biased = e + 127
    bits = torch.where(biased >= 1, biased << 23, torch.zeros_like(biased))
    # 2^-127 and 2^-128 are float32 subnormals: mantissa bit 22 resp. 21.
    bits = torch.where(biased == 0, torch.full_like(bits, 1 << 22), bits)
    bits = torch.where(biased == -1, torch.full_like(bits, 1 << 21), bits)
    bits[255] = 0x7FC00000
    return bits.to(torch.int32).view(torch.float32)


_SCALE = _pow2_table(negate=False)  # byte -> 2^(s-127)
_INV_SCALE = _pow2_table(negate=True)  # byte -> 2^(127-s)
# nibble -> signed value (index 8 is -0.0).
_NIBBLE = torch.tensor([v for v in E2M1_GRID] + [-v for v in E2M1_GRID], dtype=torch.float32)


def _check_uint8(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected a torch.uint8 tensor, got {got}")
    if t.dim() < 2:
        raise ValueError(f"{name}: expected at least 2 dims [..., out, cols], got shape {tuple(t.shape)}")


def _check_scale_shape(scale: torch.Tensor, lead_out: tuple[int, ...], n_in: int, name: str = "scale") -> None:
    want = (*lead_out, n_in // BLOCK)
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}: expected shape {want} (one E8M0 byte per {BLOCK} inputs), "
                         f"got {tuple(scale.shape)}")


def decode_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode MXFP4 weights exactly.

    Args:
        packed: uint8 [..., out, in/2], low nibble = even column.
        scale: uint8 [..., out, in/32], E8M0 exponent bytes.
        dtype: output dtype (exact for float32 / bfloat16; float16 may overflow/underflow).
    Returns:
        [..., out, in] tensor of `dtype` on packed's device.
    """
    _check_uint8(packed, "packed")
    _check_uint8(scale, "scale")
    n_in = packed.shape[-1] * 2
    if n_in % BLOCK:
        raise ValueError(f"packed: input dim {n_in} (= 2 * {packed.shape[-1]}) must be a multiple of {BLOCK}")
    _check_scale_shape(scale, tuple(packed.shape[:-1]), n_in)
    dev = packed.device
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    nib = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], n_in)
    vals = _NIBBLE.to(dev)[nib]
    mult = _SCALE.to(dev)[scale.long()]
    out = vals.view(*packed.shape[:-1], n_in // BLOCK, BLOCK) * mult.unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], n_in).to(dtype)


def _blocks_f32(w: torch.Tensor, name: str = "w") -> torch.Tensor:
    """w [..., out, in] float -> float32 [..., out, in/32, 32] (a view when already float32)."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor")
    if w.dim() < 2:
        raise ValueError(f"{name}: expected at least 2 dims [..., out, in], got shape {tuple(w.shape)}")
    if w.shape[-1] % BLOCK:
        raise ValueError(f"{name}: input dim {w.shape[-1]} must be a multiple of {BLOCK}")
    wf = w.detach().float()
    return wf.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)


def mxfp4_scales_ocp(w: torch.Tensor) -> torch.Tensor:
    """OCP shared-exponent rule: byte = clamp(floor(log2(amax)) - 2 + 127, 0, 254).

    Args:
        w: float [..., out, in], finite, `in` a multiple of 32.
    Returns:
        uint8 [..., out, in/32].
    """
    blocks = _blocks_f32(w)
    if not torch.isfinite(blocks).all():
        raise ValueError("w: contains inf/NaN; MXFP4 cannot encode non-finite weights")
    amax = blocks.abs().amax(dim=-1)
    # frexp: amax = m * 2^e with m in [0.5, 1)  =>  floor(log2(amax)) = e - 1 (exact, subnormals too).
    _, e = torch.frexp(amax)
    byte = (e.long() - 1 - 2 + 127).clamp(0, 254)
    byte = torch.where(amax == 0, torch.zeros_like(byte), byte)
    return byte.to(torch.uint8)


def _round_to_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 scaled values -> E2M1 nibbles (int64), RNE with saturation at 6."""
    # bucketize(right=False) counts the boundaries strictly below |x| = the magnitude code.
    code = torch.bucketize(x.abs(), _BOUNDARIES.to(x.device))
    return torch.where(torch.signbit(x), code | 8, code)


def encode_mxfp4(w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode weights to MXFP4 (see the module docstring for the scale and rounding rules).

    Args:
        w: float [..., out, in] (any float dtype; converted to float32 exactly for bf16/fp32),
           finite, `in` a multiple of 32.
        scale: optional uint8 [..., out, in/32] E8M0 bytes to reuse (bytes 0..254).
    Returns:
        (packed uint8 [..., out, in/2], scale uint8 [..., out, in/32]) on w's device.
    """
    blocks = _blocks_f32(w)
    if scale is None:
        scale = mxfp4_scales_ocp(w)
    else:
        _check_uint8(scale, "scale")
        _check_scale_shape(scale, tuple(w.shape[:-1]), w.shape[-1])
        if (scale == 255).any():
            raise ValueError("scale: byte 255 is the E8M0 NaN code and cannot be used to encode")
        if torch.isnan(blocks).any():
            raise ValueError("w: contains NaN; MXFP4 cannot encode it")
        scale = scale.to(w.device)
    inv = _INV_SCALE.to(blocks.device)[scale.long()].unsqueeze(-1)
    codes = _round_to_codes(blocks * inv).reshape(*w.shape)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, scale


def encode_mxfp4_reuse(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode w, keeping each block's given scale byte wherever it reproduces the block
    bit-exactly (sign of zero included) and using the OCP rule for the other blocks.

    This is what makes re-saving a loaded MXFP4 checkpoint byte-identical (the encoding is not
    unique, spec §4.3) while still encoding modified blocks sensibly.
    Args:
        w: float [..., out, in], finite, `in` a multiple of 32.
        scale: uint8 [..., out, in/32] candidate bytes (e.g. those of the loaded file).
    Returns:
        (packed uint8 [..., out, in/2], scale uint8 [..., out, in/32]).
    """
    packed, scale = encode_mxfp4(w, scale)
    dec = decode_mxfp4(packed, scale, dtype=torch.float32)
    same = dec.view(torch.int32) == w.detach().float().view(torch.int32)
    exact = same.view(*w.shape[:-1], -1, BLOCK).all(dim=-1)
    if bool(exact.all()):
        return packed, scale
    return encode_mxfp4(w, torch.where(exact, scale, mxfp4_scales_ocp(w)))


def quantize_dequantize_mxfp4(w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """decode(encode(w)) in w's dtype, without materialising the packed bytes.

    Args:
        w: float [..., out, in], `in` a multiple of 32.
        scale: optional uint8 [..., out, in/32] (default: the OCP rule).
    Returns:
        [..., out, in] of w.dtype.
    """
    blocks = _blocks_f32(w)
    if scale is None:
        scale = mxfp4_scales_ocp(w)
    else:
        _check_uint8(scale, "scale")
        _check_scale_shape(scale, tuple(w.shape[:-1]), w.shape[-1])
    idx = scale.long().to(blocks.device)
    codes = _round_to_codes(blocks * _INV_SCALE.to(blocks.device)[idx].unsqueeze(-1))
    out = _NIBBLE.to(blocks.device)[codes] * _SCALE.to(blocks.device)[idx].unsqueeze(-1)
    return out.reshape(w.shape).to(w.dtype)


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, quantize: Callable) -> torch.Tensor:  # type: ignore[override]
        return quantize(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        # Straight-through: the rounding is treated as identity for the gradient (spec §4.4).
        return grad, None


def straight_through(quantize: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """quantize(x) in the forward, identity in the backward (the straight-through estimator of QAT)."""
    return _StraightThrough.apply(x, quantize)


def fake_quant_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 fake quantisation for QAT: forward = decode(encode(w)) with the OCP scale rule
    (blocks of 32 along the last = input dim), backward = identity (straight-through estimator).

    Args:
        w: float [..., out, in], `in` a multiple of 32.
    Returns:
        [..., out, in] of w.dtype, on the MXFP4 grid.
    """
    return straight_through(quantize_dequantize_mxfp4, w)
