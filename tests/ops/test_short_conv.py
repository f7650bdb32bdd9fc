"""Short convolution (depthwise causal conv + SiLU) Triton kernels against the float64 loops.

Without CUDA the kernels run under TRITON_INTERPRET=1 on tiny shapes (CI); on a GPU the same tests
plus a larger bf16 case marked `gpu`.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from k3.ops.short_conv import document_starts, short_conv_silu  # noqa: E402
from k3.ops.short_conv import triton_conv  # noqa: E402
from k3.ops.short_conv.reference import short_conv_silu_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


# Test-only overrides of the kernels' choices (module functions and tile constants, restored by monkeypatch):
# the kernel family for W <= 4, the tiled backward's dz scratch dtype, the passthrough copies, program tiles.
_TILE_FIELDS = {"FWDW": ("R", "BC", "WARPS"), "BWDW": ("R", "BC", "WARPS"),
                "FWD": ("BT", "BC", "WARPS"), "BWD": ("BT", "BC", "WARPS")}
_PASS_MODE = triton_conv._pass_mode


def _use_mode(monkeypatch, mode):
    """"window" (the default for W <= 4) or "tiles" (the tiled kernels for every W)."""
    monkeypatch.setattr(triton_conv, "_mode", lambda W: mode if W <= triton_conv.MAX_WINDOW else "tiles")


def _use_dz(monkeypatch, dz):
    """The tiled backward's dz scratch: "fp32", or "half" (x's dtype; the default for bf16 / fp16 x)."""
    monkeypatch.setattr(triton_conv, "_dz_dtype", lambda x: torch.float32 if dz == "fp32" else x.dtype)


def _use_pass(monkeypatch, mode):
    """Passthrough gradients by the backward's own programs ("kernel", the default) or torch copies."""
    monkeypatch.setattr(triton_conv, "_pass_mode", _PASS_MODE if mode == "kernel" else lambda groups: "torch")


def _use_tile(monkeypatch, direction, **fields):
    """Replace fields (R / BT, BC, WARPS) of one direction's program tile."""
    table = triton_conv.WINDOW if direction in ("FWDW", "BWDW") else triton_conv.TILES
    tile = dict(zip(_TILE_FIELDS[direction], table[direction]))
    tile.update(fields)
    monkeypatch.setitem(table, direction, tuple(tile[k] for k in _TILE_FIELDS[direction]))


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(B, T, S, C, W, dtype, cu=None, sliced=False, pad=5, at=3, unused=()):
    """sliced: x is columns [at, at + S*C) of a wider tensor (S*C + pad columns), like a fused projection.
    unused: streams whose outputs take no part in the loss (gradient None; the reference's is zero)."""
    torch.manual_seed(0)
    full = torch.randn(B, T, S * C + (pad if sliced else 0), device=DEV, dtype=dtype)
    x = (full[..., at:at + S * C] if sliced else full).detach().requires_grad_()
    w = (torch.randn(S * C, 1, W, device=DEV) * 0.5).requires_grad_()
    cu_t = torch.tensor(cu, device=DEV, dtype=torch.int32) if cu is not None else None
    outs = short_conv_silu(x, w, streams=S, cu_seqlens=cu_t)
    # S separate contiguous [B, T, C] tensors, none a view of another
    assert isinstance(outs, tuple) and len(outs) == S
    assert all(o.shape == (B, T, C) and o.dtype == dtype and o.is_contiguous() for o in outs)
    assert len({o.untyped_storage().data_ptr() for o in outs}) == S
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    ref = short_conv_silu_reference(xr, wr, cu_t)  # [B, T, S*C]
    ref_s = ref.reshape(B, T, S, C).permute(2, 0, 1, 3)
    do = torch.randn_like(ref_s)
    do[list(unused)] = 0
    used = [s for s in range(S) if s not in unused]
    torch.autograd.backward([outs[s] for s in used], [do[s].to(dtype) for s in used])
    ref_s.backward(do)
    tol = TOL[dtype]
    assert _rel(torch.stack(outs), ref_s) < tol
    assert _rel(x.grad, xr.grad) < tol
    assert _rel(w.grad, wr.grad) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows(dtype):
    _check(2, 37, 3, 16, 4, dtype)


def _kernels(param: str, monkeypatch) -> str:
    mode, dz = (param.split("-") + ["fp32"])[:2]
    _use_mode(monkeypatch, mode)
    if dz == "small":
        for d in ("FWDW", "BWDW"):
            _use_tile(monkeypatch, d, R=8)
    else:
        _use_dz(monkeypatch, dz)
    return param


@pytest.fixture(params=["window", "window-small", "tiles-fp32", "tiles-half"])
def bwd_strips(request, monkeypatch):
    """The kernels (`_use_mode`): the sliding-window ones (default tiles, and 8-row strips, so the test
    crosses many strips) and the tiled ones, whose split backward keeps dz in fp32 or in x's
    dtype (`_use_dz`; the default is one of the two, see test_dz_dtype). For the tests about
    documents and block edges; the others take `bwd` (no 8-row strips: CPU interpreter time in CI)."""
    return _kernels(request.param, monkeypatch)


@pytest.fixture(params=["window", "tiles-fp32", "tiles-half"])
def bwd(request, monkeypatch):
    """`bwd_strips` without the 8-row strips."""
    return _kernels(request.param, monkeypatch)


def test_bf16_packed_documents(bwd_strips):
    """bf16 inputs through every backward (the dz scratch's dtype only matters here): within
    bf16 tolerance of float64, across 64-row block edges."""
    _check(1, 150, 3, 48, 4, torch.bfloat16, cu=[0, 1, 3, 63, 66, 128, 129, 150], sliced=True)


def test_packed_documents_with_short_ones(bwd_strips):
    # documents of length 1 and 2 (< W-1) and one crossing the 32-row block edge
    _check(1, 45, 3, 16, 4, torch.float32, cu=[0, 1, 3, 20, 38, 45])


@pytest.mark.parametrize("W", [2, 3, 4, 5])
def test_backward_block_edges(W, bwd_strips):
    # several 32-row blocks (the backward reads output rows across block edges), documents starting just
    # before / after a block edge, two channel blocks (S*C = 144 > 128), B = 2 without documents; the
    # window kernels take W <= 4 (W 2, 3 zero-padded), W 5 runs the tiled ones whatever the mode
    _check(1, 150, 3, 48, W, torch.float32, cu=[0, 1, 3, 63, 66, 128, 129, 150])
    _check(2, 131, 3, 48, W, torch.float32)


@pytest.mark.parametrize("S", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bc", [128, 16])
def test_streams_straddle_channel_blocks(S, dtype, bc, bwd, monkeypatch):
    """C = 12: a channel block of 128 holds all streams, blocks of 16 straddle two; the kernels pick each
    column's stream tensor (outputs, stream gradients), with packed documents and a sliced x."""
    for d in ("FWD", "BWD", "FWDW", "BWDW"):
        _use_tile(monkeypatch, d, BC=bc)
    _check(1, 70, S, 12, 4, dtype, cu=[0, 5, 6, 40, 70], sliced=True)


@pytest.mark.parametrize("unused", [(1,), (0, 2)])
def test_unused_stream_output(unused, bwd, monkeypatch):
    """A stream's output left out of the loss (its gradient reaches the backward as None) counts as a
    zero gradient; across channel blocks that straddle streams."""
    _use_tile(monkeypatch, "BWD", BC=16)
    _use_tile(monkeypatch, "BWDW", BC=16)
    _check(1, 45, 3, 12, 4, torch.float32, cu=[0, 1, 3, 20, 45], unused=unused)
    _check(1, 45, 3, 12, 4, torch.bfloat16, cu=[0, 1, 3, 20, 45], unused=unused, sliced=True)


def test_none_gradient_is_not_materialised(monkeypatch):
    """The backward gets None for an unused stream (no zero tensor is made for it), and a broadcast
    gradient (of a sum: stride 0) reads correctly."""
    from k3.ops.short_conv import triton_conv

    seen, orig = [], triton_conv._stream_args

    def spy(ts, fill):
        seen.append(list(ts))
        return orig(ts, fill)

    monkeypatch.setattr(triton_conv, "_stream_args", spy)
    x = torch.randn(1, 20, 36, device=DEV, requires_grad=True)
    w = torch.randn(36, 1, 4, device=DEV, requires_grad=True)
    q, _, v = short_conv_silu(x, w, streams=3)
    (q.sum() + 2 * v.sum()).backward()
    assert seen[-1][1] is None and seen[-1][0] is not None and seen[-1][2] is not None
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = short_conv_silu_reference(xr, wr)
    (ref[..., :12].sum() + 2 * ref[..., 24:].sum()).backward()
    assert _rel(x.grad, xr.grad) < TOL[torch.float32] and _rel(w.grad, wr.grad) < TOL[torch.float32]


def test_dz_dtype():
    """The split backward's dz scratch: x's dtype for bf16/fp16 x and fp32 for fp32 x."""
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        assert triton_conv._dz_dtype(torch.empty(1, dtype=dt)) == dt


def test_tile_knobs(monkeypatch):
    # other program tiles (bench/short_conv.py --sweep) give the same results
    for d, k, v in (("FWD", "BT", 64), ("FWD", "BC", 16), ("BWD", "BT", 16), ("BWD", "BC", 32), ("BWD", "WARPS", 2),
                    ("FWDW", "R", 16), ("FWDW", "BC", 16), ("BWDW", "R", 4), ("BWDW", "BC", 32), ("BWDW", "WARPS", 2)):
        _use_tile(monkeypatch, d, **{k: v})
    for mode in ("window", "tiles"):
        _use_mode(monkeypatch, mode)
        _check(1, 70, 3, 16, 4, torch.float32, cu=[0, 17, 70])


def test_sliced_input_and_one_stream():
    _check(1, 40, 1, 48, 3, torch.float32, cu=[0, 13, 40], sliced=True)


@pytest.mark.parametrize("pad", [8, 16, 4])
def test_row_stride_alignment(pad, bwd):
    """Rows a multiple of 8 / 16 / 4 elements apart (k3-small's fused projection: 4,232 = 8 x 529): the
    kernels get the stride as quotient x power-of-two factor; B = 2 so the batch stride is used too."""
    from k3.ops.short_conv.triton_conv import _strides

    full = torch.zeros(2, 5, 3 * 16 + pad)
    st = _strides(full[..., :48])
    assert st["VT"] * st["sxt_v"] == 48 + pad and (48 + pad) % st["VT"] == 0 and st["VT"] in (4, 8, 16)
    assert st["VB"] * st["sxb_v"] == 5 * (48 + pad)
    _check(2, 70, 3, 16, 4, torch.bfloat16, sliced=True, pad=pad, at=0)
    _check(1, 70, 3, 16, 4, torch.float32, cu=[0, 17, 70], sliced=True, pad=pad, at=0)


def test_document_starts():
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    assert document_starts(cu, 5).tolist() == [0, 0, 2, 2, 2]


def test_matches_the_model_conv():
    from k3.model.cache import SeqLayout
    from k3.model.kda import conv_silu_streams

    torch.manual_seed(1)
    cu = torch.tensor([0, 7, 30, 41], dtype=torch.int32)
    x = torch.randn(1, 41, 3 * 32)
    w = torch.randn(3 * 32, 1, 4)
    ref = conv_silu_streams(x, w, SeqLayout.build(1, 41, cu, None, x.device), 3)
    out = short_conv_silu(x.to(DEV), w.to(DEV), streams=3, cu_seqlens=cu.to(DEV))
    assert isinstance(ref, tuple) and len(ref) == 3
    assert _rel(torch.stack(out).cpu(), torch.stack(ref)) < 1e-6


def test_bad_input():
    x = torch.randn(1, 8, 12)
    with pytest.raises(ValueError, match="streams"):
        short_conv_silu(x, torch.randn(12, 1, 4), streams=5)
    with pytest.raises(ValueError, match="1 to 4"):
        short_conv_silu(x, torch.randn(12, 1, 4), streams=6)
    with pytest.raises(ValueError, match="channels"):
        short_conv_silu(x, torch.randn(10, 1, 4))
    with pytest.raises(ValueError, match="B = 1"):
        short_conv_silu(torch.randn(2, 8, 12), torch.randn(12, 1, 4), cu_seqlens=torch.tensor([0, 8]))


@pytest.mark.gpu
def test_gpu_large_bf16(bwd):
    _check(1, 4096, 3, 1024, 4, torch.bfloat16, cu=[0, 1000, 1001, 3000, 4096], sliced=True)
    # k3-small's layout: q|k|v leading a 4,232-wide fused projection (rows 16-byte aligned, VT = 8)
    _check(1, 4096, 3, 1024, 4, torch.bfloat16, cu=[0, 1000, 1001, 3000, 4096], sliced=True, pad=1160, at=0)


def test_window_keeps_dz_in_fp32(monkeypatch):
    """The window backward never stores dz, so with bf16 inputs its dx and dw are at least as close to float64
    as the tiled backward's with the bf16 dz scratch (its default for bf16); the forwards agree to a bf16 ulp.
    Packed documents, a sliced x, a stream whose output is unused, strips and blocks crossing documents."""
    torch.manual_seed(1)
    B, T, S, C, W = 1, 150, 3, 40, 4
    full = torch.randn(B, T, S * C + 7, device=DEV, dtype=torch.bfloat16)
    x = full[..., 2:2 + S * C]
    w = torch.randn(S * C, 1, W, device=DEV) * 0.5
    cu = torch.tensor([0, 2, 63, 66, 129, 150], device=DEV, dtype=torch.int32)
    dos = [torch.randn(B, T, C, device=DEV, dtype=torch.bfloat16) for _ in range(S)]
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = short_conv_silu_reference(xr, wr, cu).reshape(B, T, S, C)
    torch.autograd.backward([ref[:, :, 0], ref[:, :, 2]], [dos[0].double(), dos[2].double()])
    _use_dz(monkeypatch, "half")
    _use_tile(monkeypatch, "FWDW", R=16)
    _use_tile(monkeypatch, "BWDW", R=32)
    res = {}
    for mode in ("tiles", "window"):
        _use_mode(monkeypatch, mode)
        xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
        outs = short_conv_silu(xl, wl, streams=S, cu_seqlens=cu)
        torch.autograd.backward([outs[0], outs[2]], [dos[0], dos[2]])  # stream 1 unused
        res[mode] = (torch.stack(outs).float(), _rel(xl.grad, xr.grad), _rel(wl.grad, wr.grad))
    ulp = res["tiles"][0].abs().clamp_min(2.0 ** -126) * 2.0 ** -7
    assert ((res["window"][0] - res["tiles"][0]).abs() <= ulp).all()
    assert res["window"][1] <= res["tiles"][1] and res["window"][2] <= res["tiles"][2] * 1.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_passthrough_columns(dtype, bwd):
    """x = [conv channels | two passthrough groups] (KDA's fused projection): the groups come back as views
    of x, and x's gradient is one tensor holding the conv's gradient and theirs (an unused group: zeros)."""
    torch.manual_seed(2)
    S, C, P = 3, 16, (5, 3)
    cu = torch.tensor([0, 2, 30, 70], device=DEV, dtype=torch.int32)
    x = torch.randn(1, 70, S * C + sum(P), device=DEV, dtype=dtype, requires_grad=True)
    w = (torch.randn(S * C, 1, 4, device=DEV) * 0.5).requires_grad_()
    *outs, p0, p1 = short_conv_silu(x, w, streams=S, cu_seqlens=cu, passthrough=P)
    assert torch.equal(p0, x[..., S * C:S * C + 5]) and torch.equal(p1, x[..., S * C + 5:])
    assert p0.data_ptr() == x[..., S * C:].data_ptr()  # a view, no copy
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = short_conv_silu_reference(xr[..., :S * C], wr, cu).reshape(1, 70, S, C).permute(2, 0, 1, 3)
    do = torch.randn_like(ref)
    dp0 = torch.randn(1, 70, 5, device=DEV, dtype=dtype)
    torch.autograd.backward(list(outs) + [p0], [d.to(dtype) for d in do.unbind(0)] + [dp0])  # p1 unused
    ref.backward(do)
    assert _rel(torch.stack(outs), ref) < TOL[dtype]
    assert _rel(x.grad[..., :S * C], xr.grad[..., :S * C]) < TOL[dtype] and _rel(w.grad, wr.grad) < TOL[dtype]
    assert torch.equal(x.grad[..., S * C:S * C + 5], dp0) and not x.grad[..., S * C + 5:].any()
    with pytest.raises(ValueError, match="passthrough"):
        short_conv_silu(x, w, streams=S, passthrough=(0,))


def _check_passthrough(B, T, S, C, P, dtype, cu=None, none=(), gdtype=None):
    """x = [S*C conv channels | passthrough groups of widths P] through short_conv_silu and backward, the
    groups in `none` left out of the loss (gradient None), the others' gradients made in `gdtype` (autograd
    casts them to x's dtype before the backward sees them). x's gradient against autograd through the
    float64 loops and plain views of x: the passthrough columns exactly, the conv channels within TOL.
    Returns (x.grad, w.grad)."""
    torch.manual_seed(3)
    SC = S * C
    x = torch.randn(B, T, SC + sum(P), device=DEV, dtype=dtype, requires_grad=True)
    w = (torch.randn(SC, 1, 4, device=DEV) * 0.5).requires_grad_()
    cu_t = torch.tensor(cu, device=DEV, dtype=torch.int32) if cu is not None else None
    outs = list(short_conv_silu(x, w, streams=S, cu_seqlens=cu_t, passthrough=P))
    do = [torch.randn(B, T, C, device=DEV, dtype=dtype) for _ in range(S)]
    dp = [torch.randn(B, T, n, device=DEV, dtype=gdtype or dtype) for n in P]
    used = [j for j in range(len(P)) if j not in none]
    torch.autograd.backward(outs[:S] + [outs[S + j] for j in used], do + [dp[j] for j in used])
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = short_conv_silu_reference(xr[..., :SC], wr, cu_t).reshape(B, T, S, C)
    offs = [SC + sum(P[:j]) for j in range(len(P))]
    pieces = [xr.narrow(-1, offs[j], P[j]) for j in used]  # plain views: autograd copies their gradients
    torch.autograd.backward([ref[:, :, s] for s in range(S)] + pieces,
                            [d.double() for d in do] + [dp[j].to(dtype).double() for j in used])
    assert _rel(x.grad[..., :SC], xr.grad[..., :SC]) < TOL[dtype] and _rel(w.grad, wr.grad) < TOL[dtype]
    assert torch.equal(x.grad[..., SC:], xr.grad[..., SC:].to(dtype))
    return x.grad, w.grad


_PASS_CASES = [
    ((5, 3, 1), (1,), torch.bfloat16, torch.float32, 16),  # 3 conv channel blocks, then the passthrough programs
    ((8,), (), torch.float32, torch.float32, None),
    ((5, 3, 1), (0, 2), torch.bfloat16, torch.bfloat16, None),
    ((4, 1, 2), (0, 1, 2), torch.float32, torch.float32, None),  # no passthrough gradient at all: zeros
]


@pytest.mark.parametrize("P, none, dtype, gdtype, bc, mode", [
    case + (mode,) for mode in ("window", "tiles") for case in _PASS_CASES] + [_PASS_CASES[0] + ("window-small",)])
def test_passthrough_gradients_in_the_launch(P, none, dtype, gdtype, bc, mode, monkeypatch):
    """The passthrough programs of the conv backward's launch (the default) fill x's
    gradient's passthrough columns exactly (None: zeros; gradients made in another dtype, cast), with
    documents and T not a multiple of any strip or block (one case with T < the default strips), and B = 2;
    the torch copies give the same bits for all of x's and w's gradients."""
    # the kernels (the `bwd` fixture's without its dz-dtype variant, which the copy programs do not see)
    _use_mode(monkeypatch, mode.split("-")[0])
    if mode == "window-small":  # 8-row strips: the copy programs cross many strips
        _use_tile(monkeypatch, "BWDW", R=8)
    if bc:
        for d in ("BWD", "BWDW"):
            _use_tile(monkeypatch, d, BC=bc)
    for B, T, S, C, cu in [(1, 45, 3, 16, [0, 1, 3, 20, 38, 45]), (2, 37, 1, 40, None)]:
        got = _check_passthrough(B, T, S, C, P, dtype, cu=cu, none=none, gdtype=gdtype)
        _use_pass(monkeypatch, "torch")
        ref = _check_passthrough(B, T, S, C, P, dtype, cu=cu, none=none, gdtype=gdtype)
        _use_pass(monkeypatch, "kernel")
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("xdtype, gdtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                            (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("mode", ["window", "tiles"])
def test_passthrough_gradient_layouts(xdtype, gdtype, mode, monkeypatch):
    """The backward called directly (autograd would cast the gradients to x's dtype first) with passthrough
    gradients of another dtype (cast on store, rounding to nearest even as torch's copy does) and odd
    layouts: a slice of a wider tensor (rows 7 elements apart), a broadcast (stride 0), a transposed one (last
    dim not contiguous: copied first), batch rows not evenly spaced (copied first), and None (zeros). The
    passthrough columns equal the gradients cast to x's dtype, and the torch copies give the same bits."""
    _use_mode(monkeypatch, mode)
    _use_tile(monkeypatch, "BWDW", R=8)
    torch.manual_seed(4)
    B, T, S, C = 2, 37, 3, 8
    P = (3, 1, 6)

    def rnd(*shape):
        return torch.randn(*shape, device=DEV).to(gdtype)

    cases = {  # (g0 [B, T, 3], g1 [B, T, 1], g2 [B, T, 6])
        "slice, broadcast, transposed": (rnd(B, T, 7)[..., 2:5], rnd(1, 1, 1).expand(B, T, 1),
                                         rnd(B, 6, T).transpose(1, 2)),
        "uneven batch rows, None": (rnd(B, T + 3, 3)[:, :T], None, rnd(B, T, 6)),
    }
    assert cases["slice, broadcast, transposed"][0].stride() == (T * 7, 7, 1)
    x = torch.randn(B, T, S * C + sum(P), device=DEV, dtype=xdtype, requires_grad=True)
    w = torch.randn(S * C, 1, 4, device=DEV, requires_grad=True)
    do = [torch.randn(B, T, C, device=DEV, dtype=xdtype) for _ in range(S)]
    for name, gs in cases.items():
        res = {}
        for pm in ("kernel", "torch"):
            _use_pass(monkeypatch, pm)
            outs = short_conv_silu(x, w, streams=S, passthrough=P)
            res[pm] = outs[0].grad_fn.apply(*do, *gs)[:2]  # ShortConvSiLU.backward as it is
        dx = res["kernel"][0]
        assert torch.equal(dx, res["torch"][0]) and torch.equal(res["kernel"][1], res["torch"][1]), name
        for j, g in enumerate(gs):
            off = S * C + sum(P[:j])
            want = g.to(xdtype) if g is not None else torch.zeros(B, T, P[j], device=DEV, dtype=xdtype)
            assert torch.equal(dx[..., off:off + P[j]], want), (name, j)


def test_passthrough_many_groups(monkeypatch):
    """More passthrough groups than the kernels' 3 pointers take the torch copies (same result)."""
    _use_tile(monkeypatch, "BWDW", R=8)
    _check_passthrough(1, 30, 3, 8, (2, 1, 3, 2), torch.float32, cu=[0, 11, 30], none=(2,))
