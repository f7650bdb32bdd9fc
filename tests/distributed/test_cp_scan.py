"""Single-process check of the context-parallel prefix scan with many segments (2-process tests
only exercise one predecessor): segment-wise KDA with folded initial states == the whole row."""

import pytest
import torch

from k3.distributed.cp import fold_predecessors, segment_flags
from k3.ops.kda import kda, l2norm
from k3.ops.kda.cp import kda_segment_transform


@pytest.mark.parametrize("starts", [[0, 3, 40], [0, 16, 17, 50], [0, 32], [0]])
def test_segments_with_folded_states_equal_the_whole_row(starts):
    R, L, H, K = 4, 16, 2, 16
    T = R * L
    g = torch.Generator().manual_seed(0)
    q, k = (l2norm(torch.randn(1, T, H, K, generator=g, dtype=torch.float64)) for _ in range(2))
    v = torch.randn(1, T, H, K, generator=g, dtype=torch.float64)
    gate = -torch.rand(1, T, H, K, generator=g, dtype=torch.float64) * 0.5
    beta = torch.rand(1, T, H, generator=g, dtype=torch.float64)
    cu = torch.tensor(starts + [T])
    full, _ = kda(q, k, v, gate, beta, cu_seqlens=cu, backend="reference")
    cont, first = segment_flags(starts + [T], L, R)
    pieces, trans = [], []
    for r in range(R):
        lo, hi = r * L, (r + 1) * L
        inner = [b - lo for b in starts if lo < b < hi]
        local = torch.tensor([0] + inner + [L])
        s = int(local[-2])
        trans.append(kda_segment_transform(k[:, lo + s:hi], v[:, lo + s:hi], gate[:, lo + s:hi], beta[:, lo + s:hi]))
        pieces.append((lo, hi, local))
    S_ext = torch.stack([t[0][0] for t in trans])
    M = torch.stack([t[1][0] for t in trans])
    out = []
    for r, (lo, hi, local) in enumerate(pieces):
        init = fold_predecessors(S_ext, M, r, cont, first)
        initial = torch.cat([init[None], init.new_zeros(len(local) - 2, *init.shape)])
        o, _ = kda(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], gate[:, lo:hi], beta[:, lo:hi], initial_state=initial,
                   cu_seqlens=local, backend="reference")
        out.append(o)
    torch.testing.assert_close(torch.cat(out, 1), full, rtol=1e-10, atol=1e-10)
