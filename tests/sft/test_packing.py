"""Packing keeps conversations whole with a segment each; the loader is deterministic and resumes exactly."""

import numpy as np
import pytest

from k3.sft.packing import SFTLoader, collate, pack, targets_from_mask, val_batches


def _docs(lengths):
    return [targets_from_mask(list(range(1, n + 1)), [0] + [1] * (n - 1)) for n in lengths]


def test_pack_keeps_documents_whole_with_boundaries():
    lengths = [7, 3, 5, 9, 2, 12]
    data = pack(_docs(lengths), 10, pad_id=0)
    assert data.truncated == 1 and data.num_conversations == 6 and data.dropped == 0
    seen = []
    for r in range(data.num_rows):
        s = list(data.starts[r]) + [10]
        for a, b in zip(s, s[1:]):
            x, y = data.x[r, a:b], data.y[r, a:b]
            if (x == 0).all():  # padding: no targets
                assert (y == -100).all()
                continue
            seen.append(b - a)
            assert x.tolist() == list(range(1, b - a + 1))  # a whole document, in order
            if b - a < 10:
                assert y[-1] == -100  # never a target across a document end
    assert sorted(seen) == sorted(min(n, 10) for n in lengths)
    b = collate(data, [1, 0])
    assert b.input_ids.shape == (1, 20) and b.cu_seqlens[0] == 0 and b.cu_seqlens[-1] == 20
    assert b.num_targets == int((b.labels != -100).sum()) and 10 in b.cu_seqlens.tolist()


def test_documents_without_targets_in_the_row_are_dropped():
    late = targets_from_mask(list(range(1, 13)), [0] * 10 + [1, 1])  # its targets lie past seq_len
    data = pack([late] + _docs([4]), 8, pad_id=0)
    assert (data.num_conversations, data.truncated, data.dropped, data.num_rows) == (1, 1, 1, 1)
    assert pack([late], 8, pad_id=0).num_rows == 0


def test_loader_order_resume_and_errors():
    data = pack(_docs([4] * 40), 8, pad_id=0)  # 20 rows
    a = SFTLoader(data, 3, seed=1)
    first = [next(a).input_ids for _ in range(8)]  # crosses an epoch (6 batches per epoch)
    b = SFTLoader(data, 3, seed=1)
    for _ in range(5):
        next(b)
    state = b.state_dict()
    c = SFTLoader(data, 3, seed=1)
    c.load_state_dict(state)
    assert all(np.array_equal(next(c).input_ids, first[k]) for k in range(5, 8))
    with pytest.raises(ValueError, match="cannot resume"):
        SFTLoader(pack(_docs([5] * 40), 8, 0), 3, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="packed at seq_len 8"):
        a.set_shape(16, 1)
    with pytest.raises(ValueError, match="has 20 rows"):
        SFTLoader(data, 21)
    vb = val_batches(data, 6)
    assert [v.batch_size for v in vb] == [6, 6, 6, 2]
