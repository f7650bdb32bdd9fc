"""MXFP4 codec: exact decoding against hand-computed values, encoding rules, STE."""

import pytest
import torch

from k3.quant.mxfp4 import (
    E2M1_GRID,
    decode_mxfp4,
    encode_mxfp4,
    encode_mxfp4_reuse,
    fake_quant_mxfp4,
    mxfp4_scales_ocp,
    quantize_dequantize_mxfp4,
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)


def _random_grid(shape_out: int, n_in: int, gen: torch.Generator, lead: tuple[int, ...] = ()):
    packed = torch.randint(0, 256, (*lead, shape_out, n_in // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(100, 150, (*lead, shape_out, n_in // 32), dtype=torch.uint8, generator=gen)
    return packed, scale


def test_hand_computed_values():
    # Row 0, block 0 (scale 127 -> x1): bytes 0x21 -> [0.5, 1.0]; 0xF7 -> [6.0, -6.0]; 0x98 -> [-0.0, -0.5].
    # Row 0, block 1 (scale 130 -> x8): byte 0x3A -> [-1.0*8, 1.5*8] = [-8, 12].
    packed = torch.zeros(2, 32, dtype=torch.uint8)
    packed[0, 0], packed[0, 1], packed[0, 2] = 0x21, 0xF7, 0x98
    packed[0, 16] = 0x3A
    packed[1, 0] = 0x5C  # low nibble 0xC = -2.0, high nibble 5 = 3.0; scale 120 -> x 2^-7
    scale = torch.tensor([[127, 130], [120, 0]], dtype=torch.uint8)
    w = decode_mxfp4(packed, scale, dtype=torch.float32)
    assert w.shape == (2, 64)
    assert w[0, :6].tolist() == [0.5, 1.0, 6.0, -6.0, -0.0, -0.5]
    assert torch.signbit(w[0, 4])  # nibble 8 is -0.0
    assert w[0, 32:34].tolist() == [-8.0, 12.0]
    assert w[1, :2].tolist() == [-2.0 / 128, 3.0 / 128]
    assert (w[0, 6:32] == 0).all() and (w[0, 34:] == 0).all()
    assert torch.equal(decode_mxfp4(packed, scale), w.bfloat16())


@pytest.mark.parametrize("s", [0, 1, 100, 127, 128, 200, 254])
def test_all_nibbles_times_scales(s):
    # byte b = lo | hi << 4 over all 256 bytes covers every (even, odd) nibble pair.
    packed = torch.arange(256, dtype=torch.uint8).view(16, 16)  # 16 rows x 32 columns
    scale = torch.full((16, 1), s, dtype=torch.uint8)
    w = decode_mxfp4(packed, scale, dtype=torch.float32)
    table = torch.tensor(list(E2M1_GRID) + [-v for v in E2M1_GRID], dtype=torch.float64)
    b = torch.arange(256)
    lo, hi = b & 15, b >> 4
    mult = 2.0 ** (s - 127)  # python float: exact power of two
    # Expected values computed in float64 then rounded to float32 (only overflow can change them).
    want = torch.stack((table[lo] * mult, table[hi] * mult), dim=-1).reshape(16, 32).float()
    assert torch.equal(_bits(w), _bits(want)), s
    assert torch.equal(torch.signbit(w[:, 0::2]).flatten(), lo >= 8)
    if s < 254:  # 6 * 2^127 overflows bf16 like fp32; below that bf16 is exact
        assert torch.equal(_bits(decode_mxfp4(packed, scale)), _bits(w))


def test_scale_255_is_nan_and_shape_checks():
    packed = torch.full((1, 16), 0x21, dtype=torch.uint8)
    assert torch.isnan(decode_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8))).all()
    with pytest.raises(ValueError, match="scale"):
        decode_mxfp4(packed, torch.zeros(1, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="packed"):
        decode_mxfp4(packed.int(), torch.zeros(1, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        decode_mxfp4(torch.zeros(1, 8, dtype=torch.uint8), torch.zeros(1, 0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        encode_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="non-finite|inf"):
        encode_mxfp4(torch.full((1, 32), float("inf")))
    with pytest.raises(ValueError, match="255"):
        encode_mxfp4(torch.zeros(1, 32), torch.full((1, 1), 255, dtype=torch.uint8))


def test_ocp_scale_rule():
    w = torch.zeros(4, 32)
    w[0, 3] = 6.0  # floor(log2 6) = 2 -> e = 0 -> byte 127
    w[1, 0] = -5.9  # floor(log2 5.9) = 2 -> 127
    w[2, 7] = 8.0  # 3 - 2 = 1 -> 128
    w[3, 1] = 0.3  # floor(log2 0.3) = -2 -> -4 -> 123
    assert mxfp4_scales_ocp(w).flatten().tolist() == [127, 127, 128, 123]
    assert mxfp4_scales_ocp(torch.zeros(1, 32)).item() == 0  # all-zero block


def test_rounding_ties_to_even_and_saturation():
    # Scale byte 127 (x1): midpoints go to the even code, > 6 saturates.
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 5.01, 7.0, 1e30, -0.1, -2.5, 0.0] + [0.0] * 18)
    packed, scale = encode_mxfp4(x[None], torch.full((1, 1), 127, dtype=torch.uint8))
    got = decode_mxfp4(packed, scale, dtype=torch.float32)[0, :14]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 6.0, 6.0, 6.0, -0.0, -2.0, 0.0]
    assert got.tolist() == want
    assert torch.signbit(got[11]) and not torch.signbit(got[13])


def test_encode_decode_idempotent_on_grid():
    gen = torch.Generator().manual_seed(0)
    packed, scale = _random_grid(24, 96, gen, lead=(3,))
    w = decode_mxfp4(packed, scale)
    # The OCP rule re-encodes grid values exactly (possibly with other bytes) ...
    p2, s2 = encode_mxfp4(w)
    assert torch.equal(_bits(decode_mxfp4(p2, s2)), _bits(w))
    # ... and encode(decode(.)) is a fixed point.
    p3, s3 = encode_mxfp4(decode_mxfp4(p2, s2))
    assert torch.equal(p3, p2) and torch.equal(s3, s2)
    assert torch.equal(_bits(quantize_dequantize_mxfp4(w)), _bits(w))


def test_reencode_with_original_scales_is_byte_identical():
    gen = torch.Generator().manual_seed(1)
    packed, scale = _random_grid(16, 64, gen, lead=(2,))
    for dt in (torch.bfloat16, torch.float32):
        p2, s2 = encode_mxfp4(decode_mxfp4(packed, scale, dtype=dt), scale)
        assert torch.equal(p2, packed) and torch.equal(s2, scale)


def test_reuse_keeps_exact_blocks_and_fixes_others():
    gen = torch.Generator().manual_seed(5)
    packed, scale = _random_grid(4, 96, gen)
    packed[:, :48] &= 0xBB  # magnitudes <= 1.5: the OCP rule would pick other bytes here
    w = decode_mxfp4(packed, scale, dtype=torch.float32)
    p2, s2 = encode_mxfp4_reuse(w, scale)
    assert torch.equal(p2, packed) and torch.equal(s2, scale)
    assert not torch.equal(mxfp4_scales_ocp(w), scale)
    w[2, 40] = 1000.0  # block (2, 1) no longer fits its byte: OCP rule there only
    p3, s3 = encode_mxfp4_reuse(w, scale)
    want = scale.clone()
    want[2, 1] = mxfp4_scales_ocp(w)[2, 1]
    assert torch.equal(s3, want)
    # OCP byte for amax 1000: 2^(9 - 2); 1000 / 128 = 7.8 saturates to 6 -> 768
    assert decode_mxfp4(p3, s3, dtype=torch.float32)[2, 40].item() == 768.0


def test_quantize_matches_encode_and_error_bound():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(8, 128, generator=gen) * 3
    p, s = encode_mxfp4(w)
    dq = decode_mxfp4(p, s, dtype=torch.float32)
    assert torch.equal(dq, quantize_dequantize_mxfp4(w))
    # FLOOR rule: amax / 2^e < 8, so grid rounding errs by <= 1 * 2^e (half the 4 -> 6 step) and
    # saturation of (6, 8) to 6 by < 2 * 2^e.
    e = 2.0 ** (s.float() - 127)
    err = (dq - w).abs().view(8, 4, 32).amax(-1)
    assert (err <= e * 2).all()


def test_fake_quant_ste():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4, 64, generator=gen, dtype=torch.float32, requires_grad=True)
    y = fake_quant_mxfp4(w)
    assert torch.equal(y.detach(), quantize_dequantize_mxfp4(w.detach()))
    g = torch.randn(4, 64, generator=gen)
    y.backward(g)
    assert torch.equal(w.grad, g)
    wb = w.detach().bfloat16()
    assert fake_quant_mxfp4(wb).dtype == torch.bfloat16


def test_vectorised_large_tensor_fast():
    # 3 x 256 x 1024 weights: a Python loop over elements would take far longer than this bound.
    import time

    gen = torch.Generator().manual_seed(4)
    packed, scale = _random_grid(256, 1024, gen, lead=(3,))
    t0 = time.perf_counter()
    w = decode_mxfp4(packed, scale)
    p2, s2 = encode_mxfp4(w, scale)
    assert time.perf_counter() - t0 < 5.0
    assert torch.equal(p2, packed)


def _encode_reference(w: torch.Tensor) -> torch.Tensor:
    """Plain per-element reference of encode (OCP floor scale, RNE to the grid, saturation):
    returns the decoded float64 values [out, in]."""
    import math

    out = torch.zeros(w.shape, dtype=torch.float64)
    for r in range(w.shape[0]):
        for b in range(0, w.shape[1], 32):
            blk = [float(v) for v in w[r, b:b + 32]]
            amax = max(abs(v) for v in blk)
            e = max(-127, math.frexp(amax)[1] - 1 - 2) if amax > 0 else -127
            for c, v in enumerate(blk):
                x = abs(v) / 2.0 ** e
                # nearest grid magnitude; on a tie the even code (index) wins; beyond 6 -> 6
                best = min(range(8), key=lambda k: (abs(x - E2M1_GRID[k]), k % 2))
                out[r, b + c] = math.copysign(E2M1_GRID[best] * 2.0 ** e, v)
    return out


def test_encode_matches_scalar_reference():
    gen = torch.Generator().manual_seed(6)
    # quarter-steps times powers of two hit every tie; plus plain random values
    ties = torch.randint(-28, 29, (3, 64), generator=gen).float() * 0.25
    ties = ties * 2.0 ** torch.randint(-3, 4, (3, 2, 1), generator=gen).float().repeat_interleave(32, 1)[..., 0]
    w = torch.cat([ties, torch.randn(3, 64, generator=gen) * 5])
    p, s = encode_mxfp4(w)
    got = decode_mxfp4(p, s, dtype=torch.float32).double()
    want = _encode_reference(w)
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
