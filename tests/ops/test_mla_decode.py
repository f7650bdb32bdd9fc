"""The paged MLA decode kernel (k3/ops/mla_decode) against its float32 reference and against the
attention core of `GatedMLA._absorbed`: CPU cases run under the Triton interpreter (small shapes),
`gpu` cases at serving sizes, in a CUDA graph and without host syncs."""

from __future__ import annotations

import pytest
import torch

from k3.ops.mla_decode import default_num_splits, mla_decode_reference, paged_mla_decode

# the kernel's dots round q and p to bf16 / fp16 (fp32 accumulation); fp32 caches use exact fp32 dots
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def make_case(lens: list[int], *, heads: int = 4, r: int = 48, rope: int = 16, page: int = 8, extra_pages: int = 2,
              dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0, layers: int = 2):
    """Random latent pages in a pool [blocks, layers, page, r + rope] (layer 1 is attended: block and
    row strides differ from a dense tensor), shuffled block ids, and poison (NaN) wherever a row has
    no valid token: rows past its length in its last page, its table entries past its pages, block 0."""
    g = torch.Generator().manual_seed(seed)
    n = len(lens)
    pages_per_row = max(-(-max(lens) // page), 1) + extra_pages
    nblocks = 1 + n * pages_per_row
    pool = torch.randn(nblocks, layers, page, r + rope, generator=g)
    order = (1 + torch.randperm(nblocks - 1, generator=g)).reshape(n, pages_per_row)
    pool[0] = float("nan")
    for b, length in enumerate(lens):
        used = -(-length // page)
        flat = pool[order[b]].transpose(0, 1).reshape(layers, -1, r + rope)
        flat[:, length:] = float("nan")
        pool[order[b]] = flat.reshape(layers, pages_per_row, page, r + rope).transpose(0, 1)
        order[b, used:] = torch.where(torch.rand(pages_per_row - used, generator=g) < 0.5, 0, order[b, used:])
    q_lat = torch.randn(n, heads, r, generator=g) * 0.5
    q_pe = torch.randn(n, heads, rope, generator=g)
    dev = torch.device(device)
    return (q_lat.to(dev), q_pe.to(dtype).to(dev), pool.to(dtype).to(dev)[:, 1], order.to(dev),
            torch.tensor(lens, device=dev))


def check(case, *, scale: float = 0.11, num_splits: int | None = None, tol: float | None = None) -> torch.Tensor:
    q_lat, q_pe, cache, tables, lens = case
    got = paged_mla_decode(q_lat, q_pe, cache, tables, lens, scale, num_splits)
    ref = mla_decode_reference(q_lat, q_pe, cache, tables, lens, scale)
    assert got.dtype == torch.float32 and got.shape == ref.shape and torch.isfinite(got).all()
    tol = TOL[cache.dtype] if tol is None else tol
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("splits", [1, 3])
def test_awkward_lengths_padding_rows_and_splits(dtype, splits):
    # lengths 1, 0 (padding row), off the page edge, a page edge, several 32-token blocks
    got = check(make_case([1, 0, 13, 16, 71], dtype=dtype), num_splits=splits)
    assert not got[1].any()


def test_reference_is_the_absorbed_attention_of_the_model():
    """The reference equals GatedMLA._absorbed's core (mask over a dense gathered tensor)."""
    q_lat, q_pe, cache, tables, lens = make_case([5, 12, 1], heads=3, r=16, rope=8, page=4, extra_pages=0)
    ref = mla_decode_reference(q_lat, q_pe, cache, tables, lens, 0.3)
    lat = cache[tables].flatten(1, 2).nan_to_num()  # [N, S, D]: the gather path's dense rows
    mask = torch.arange(lat.shape[1])[None, :] < lens[:, None]
    scores = (torch.einsum("nhr,nsr->nhs", q_lat, lat[..., :16]) + torch.einsum("nhd,nsd->nhs", q_pe, lat[..., 16:]))
    p = torch.softmax((scores * 0.3).masked_fill(~mask[:, None], float("-inf")), -1)
    torch.testing.assert_close(ref, torch.einsum("nhs,nsr->nhr", p, lat[..., :16]), rtol=1e-6, atol=1e-6)


def test_more_splits_than_tokens_and_all_padding_rows():
    check(make_case([1, 2, 9], page=4), num_splits=8)  # most spans are empty
    check(make_case([70, 3], page=4), num_splits=65)  # 128 split slots: the merge tiles r in slices
    q_lat, q_pe, cache, tables, lens = make_case([3, 3])
    out = paged_mla_decode(q_lat, q_pe, cache, tables, torch.zeros_like(lens), 0.1, 4)
    assert torch.equal(out, torch.zeros_like(out))


def test_many_heads_fp16_int32_indices_and_long_page():
    q_lat, q_pe, cache, tables, lens = make_case([40, 7], heads=40, r=32, rope=16, page=32, dtype=torch.float16)
    check((q_lat, q_pe, cache, tables.int(), lens.int()), num_splits=2)  # 40 heads: two blocks of 32
    # a length past the table's capacity is clamped (never reads beyond the table)
    q_lat, q_pe, cache, tables, lens = make_case([8, 8], page=4, extra_pages=0)
    got = paged_mla_decode(q_lat, q_pe, cache, tables, torch.tensor([8, 100]), 0.1, 2)
    torch.testing.assert_close(got, mla_decode_reference(q_lat, q_pe, cache, tables, lens, 0.1),
                               rtol=TOL[torch.float32], atol=TOL[torch.float32])


def test_page_size_not_a_power_of_two_and_no_rope_part():
    check(make_case([5, 30, 0], r=20, rope=8, page=12, dtype=torch.bfloat16), num_splits=3)
    check(make_case([5, 30], rope=0, page=12), num_splits=2)  # qk_rope_head_dim may be 0


def test_bf16_query_and_large_scores():
    q_lat, q_pe, cache, tables, lens = make_case([30, 17], dtype=torch.bfloat16, seed=3)
    check((q_lat.bfloat16() * 4, q_pe * 4, cache, tables, lens), scale=0.5, num_splits=2, tol=5e-2)


def test_default_num_splits_depends_on_shapes_only():
    assert default_num_splits(1, 8, 32768, "cpu") == 16  # 2 * 8 programs wanted
    assert default_num_splits(64, 8, 32768, "cpu") == 1
    assert default_num_splits(1, 8, 100, "cpu") == 1  # spans of at least 256 tokens
    assert default_num_splits(2, 96, 1 << 20, "cpu") == 3  # 96 heads: 3 head blocks of 32


def test_bad_arguments_are_refused():
    q_lat, q_pe, cache, tables, lens = make_case([3, 5])
    good = dict(q_lat=q_lat, q_pe=q_pe, cache=cache, page_tables=tables, lens=lens, scale=0.1)
    bad = [
        (dict(q_lat=q_lat[0]), "q_lat must be"),
        (dict(q_pe=q_pe[:1]), "q_pe must be"),
        (dict(cache=cache[..., :-1]), "cache must be"),
        (dict(cache=cache.int()), "cache must be float32"),
        (dict(q_lat=q_lat.double()), "q_lat must be float32"),
        (dict(cache=cache.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous in its last"),
        (dict(page_tables=tables[:1]), "page_tables must be"),
        (dict(page_tables=tables.float()), "page_tables must be int32"),
        (dict(lens=lens[None]), "lens must be"),
        (dict(lens=lens.float()), "lens must be int32"),
        (dict(scale=0.0), "scale must be"),
        (dict(scale=float("nan")), "scale must be"),
    ]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            paged_mla_decode(**{**good, **change})
    with pytest.raises(ValueError, match="num_splits"):
        paged_mla_decode(**good, num_splits=0)
    assert paged_mla_decode(q_lat[:0], q_pe[:0], cache, tables[:0], lens[:0], 0.1).shape == (0, 4, 48)


# --------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(8, 256, 64), (96, 512, 64)], ids=["k3-small", "k3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_serving_shapes(dims, dtype):
    heads, r, rope = dims
    lens = [1, 0, 255, 256, 4097, 20000] if heads == 8 else [1, 0, 3000, 9000]
    case = make_case(lens, heads=heads, r=r, rope=rope, page=256, dtype=dtype, device="cuda", seed=1)
    for splits in (None, 1, 7):
        check(case, scale=(128 + 64) ** -0.5, num_splits=splits)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_device_lengths_without_host_sync():
    q_lat, q_pe, cache, tables, lens = make_case([300, 2000, 5, 0], heads=8, r=256, rope=64, page=64,
                                                 dtype=torch.bfloat16, device="cuda", extra_pages=0)
    full = lens.clone()
    lens.copy_(torch.tensor([1, 2000, 5, 0]))
    paged_mla_decode(q_lat, q_pe, cache, tables, lens, 0.07)  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_mla_decode(q_lat, q_pe, cache, tables, lens, 0.07)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_mla_decode(q_lat, q_pe, cache, tables, lens, 0.07)
    for new in ([1, 2000, 5, 0], [300, 17, 0, 0], full.tolist()):
        lens.copy_(torch.tensor(new))
        graph.replay()
        ref = mla_decode_reference(q_lat, q_pe, cache, tables, lens, 0.07)
        torch.testing.assert_close(out, ref, rtol=TOL[torch.bfloat16], atol=TOL[torch.bfloat16])
