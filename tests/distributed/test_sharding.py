"""Single-process units: batch sharding over data/cp ranks and the MoonEP plan."""

import pytest
import torch

from k3.distributed.ep import plan_balanced
from k3.distributed.mesh import clip_cu_seqlens, shard_batch


def test_clip_cu_seqlens():
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    assert clip_cu_seqlens(cu, 4, 12).tolist() == [0, 1, 8]
    assert clip_cu_seqlens(cu, 12, 20).tolist() == [0, 8]


def test_shard_batch_pads_rows_and_splits_segments():
    T, B = 8, 3
    ids = torch.arange(B * T)[None]
    labels = ids + 100
    cu = torch.tensor([0, 3, 8, 16, 19, 24], dtype=torch.int32)
    parts = [shard_batch(ids, labels, cu, T, r, 2) for r in range(2)]
    assert parts[0].input_ids.tolist() == [list(range(16))]
    assert parts[0].cu_seqlens.tolist() == [0, 3, 8, 16]
    # rank 1: the last real row, then a padding row (token 0, ignored labels, its own document)
    assert parts[1].input_ids[0, :8].tolist() == list(range(16, 24)) and parts[1].input_ids[0, 8:].eq(0).all()
    assert parts[1].labels[0, 8:].eq(-100).all() and parts[1].cu_seqlens.tolist() == [0, 3, 8, 16]
    seg = [shard_batch(ids, labels, cu, T, 0, 1, c, 2) for c in range(2)]
    assert [s.seg_start for s in seg] == [0, 12]
    assert seg[0].cu_seqlens.tolist() == [0, 3, 8, 12] and seg[1].cu_seqlens.tolist() == [0, 4, 7, 12]
    assert torch.cat([s.input_ids for s in seg], 1).equal(ids)
    with pytest.raises(ValueError, match="cp=5"):
        shard_batch(ids, labels, cu, T, 0, 1, 0, 5)


@pytest.mark.parametrize("counts", [[40, 30, 2, 0, 1, 3, 0, 4], [10] * 8, [0, 0, 0, 0, 80, 0, 0, 0]])
def test_plan_balanced_gives_every_rank_exactly_its_share(counts):
    R = 4
    slots = plan_balanced(torch.tensor(counts), R)
    assert [sum(n for _, n in s) for s in slots] == [sum(counts) // R] * R
    per_expert = {}
    for s in slots:
        for e, n in s:
            per_expert[e] = per_expert.get(e, 0) + n
    assert all(per_expert.get(e, 0) == c for e, c in enumerate(counts))
    for r, s in enumerate(slots):  # a home keeps its own experts before taking others' overflow
        own = [n for e, n in s if e // 2 == r]
        assert sum(own) == min(sum(counts[2 * r: 2 * r + 2]), sum(counts) // R)


def test_plan_balanced_rejects_indivisible_counts():
    with pytest.raises(ValueError, match="counts"):
        plan_balanced(torch.tensor([1, 2, 3, 5]), 2)
