"""PackedLoader: packed batches and cu_seqlens, deterministic order, exact resume, stage switches,
validation batches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from k3.data.loader import Batch, PackedLoader, collate_rows, iter_val_batches
from k3.data.packing import IGNORE_INDEX, PackedRows, TokenStream

EOS = 0


def _stream(seed: int = 0, num_docs: int = 60, max_len: int = 40) -> TokenStream:
    """Random documents of awkward lengths (0 to max_len tokens before eos) over vocab 50."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 50, size=int(rng.integers(0, max_len))).tolist() for _ in range(num_docs)]
    return TokenStream.from_token_lists(docs, eos_id=EOS, vocab_size=50)


def _doc_index(stream: TokenStream) -> np.ndarray:
    ids = np.zeros(stream.num_tokens, dtype=np.int64)
    ids[stream.doc_starts[1:]] = 1
    return np.cumsum(ids)


def _reference_batch(stream: TokenStream, T: int, rows: list[int]):
    """Per-position reference: inputs, targets (masked across documents) and the segment
    boundaries (row starts and document starts) of the flattened batch."""
    toks = np.asarray(stream.tokens, dtype=np.int64)
    doc = _doc_index(stream)
    x, y, cu = [], [], []
    for b, r in enumerate(rows):
        for i in range(T):
            p = r * T + i
            x.append(toks[p])
            y.append(IGNORE_INDEX if doc[p + 1] != doc[p] else toks[p + 1])
            if i == 0 or doc[p] != doc[p - 1]:
                cu.append(b * T + i)
    cu.append(len(rows) * T)
    return x, y, cu


def _same(a: Batch, b: Batch) -> bool:
    return (torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
            and torch.equal(a.cu_seqlens, b.cu_seqlens) and a.num_tokens == b.num_tokens)


def _take(loader: PackedLoader, n: int) -> list[Batch]:
    return [next(loader) for _ in range(n)]


# ------------------------------------------------------------------------------ batch layout


@pytest.mark.parametrize("T, B", [(1, 3), (4, 2), (7, 3), (16, 1), (32, 4)])
def test_batches_match_reference(T, B):
    stream = _stream()
    loader = PackedLoader(stream, T, B, seed=1)
    for _ in range(4):
        rows = loader.peek_rows().tolist()
        batch = next(loader)
        x, y, cu = _reference_batch(stream, T, rows)
        assert batch.input_ids.shape == batch.labels.shape == (1, B * T)
        assert batch.input_ids.dtype == batch.labels.dtype == torch.int64
        assert batch.cu_seqlens.dtype == torch.int32
        assert batch.input_ids[0].tolist() == x and batch.labels[0].tolist() == y
        assert batch.cu_seqlens.tolist() == cu
        assert batch.num_tokens == B * T and batch.num_targets == sum(v != IGNORE_INDEX for v in y)
        assert batch.max_seqlen == max(np.diff(cu)) and (batch.seq_len, batch.batch_size) == (T, B)


def test_masked_labels_are_exactly_the_ends_of_documents_inside_segments():
    stream = _stream(seed=3)
    T, B = 16, 4
    batch = next(PackedLoader(stream, T, B, seed=0))
    cu = batch.cu_seqlens.tolist()
    labels, ids = batch.labels[0], batch.input_ids[0]
    masked = set(torch.nonzero(labels == IGNORE_INDEX).flatten().tolist())
    # a segment that ends at a document start (not at a row end) ends with eos, target masked
    doc_ends = {c - 1 for c in cu[1:] if c % T != 0}
    assert doc_ends <= masked
    # everything else masked is a row-final eos whose next document starts on the next row
    for p in masked - doc_ends:
        assert p % T == T - 1
    assert all(ids[p] == EOS for p in masked)


def test_document_spanning_rows_gets_row_boundaries():
    stream = TokenStream.from_token_lists([list(range(1, 26)), [3, 4, 5, 6, 7, 8, 9]], eos_id=EOS, vocab_size=32)
    batch = collate_rows(PackedRows(stream, 8), [0, 1, 2, 3])
    # doc 0 = 26 tokens: positions 0..25; doc 1 starts at 26 = row 3 offset 2
    assert batch.cu_seqlens.tolist() == [0, 8, 16, 24, 26, 32]
    assert batch.labels[0, 25].item() == IGNORE_INDEX
    assert (batch.labels[0] == IGNORE_INDEX).sum().item() == 1


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_split_rows_gives_the_batches_of_those_rows(rows):
    rp = PackedRows(_stream(), 7)
    order = [4, 0, 9, 2, 7]
    batch = collate_rows(rp, order)
    parts = batch.split_rows(rows)
    assert len(parts) == -(-len(order) // rows)
    for i, part in enumerate(parts):  # each part is exactly the batch collated from its rows
        want = collate_rows(rp, order[i * rows:(i + 1) * rows])
        assert _same(part, want) and part.num_targets == want.num_targets
        assert (part.max_seqlen, part.batch_size, part.seq_len) == (want.max_seqlen, want.batch_size, 7)
    assert sum(p.num_targets for p in parts) == batch.num_targets
    with pytest.raises(ValueError, match="rows"):
        batch.split_rows(0)


def test_batch_to_device_keeps_values():
    batch = next(PackedLoader(_stream(), 8, 2))
    moved = batch.to("cpu")
    assert _same(batch, moved) and moved.num_targets == batch.num_targets


# ------------------------------------------------------------------------------ order


def test_order_is_deterministic_and_seeded():
    stream = _stream()
    a = _take(PackedLoader(stream, 8, 4, seed=5), 6)
    b = _take(PackedLoader(stream, 8, 4, seed=5), 6)
    c = _take(PackedLoader(stream, 8, 4, seed=6), 6)
    assert all(_same(x, y) for x, y in zip(a, b))
    assert not all(_same(x, y) for x, y in zip(a, c))


def test_epochs_visit_each_row_once_and_reshuffle():
    stream = _stream()
    T, B = 8, 5
    loader = PackedLoader(stream, T, B, seed=2)
    n = len(PackedRows(stream, T))
    per_epoch = n // B
    seen = []
    for _ in range(per_epoch):
        seen.extend(loader.peek_rows().tolist())
        next(loader)
    assert loader.epoch == 0 and len(set(seen)) == len(seen) == per_epoch * B
    second = loader.peek_rows().tolist()
    next(loader)
    assert loader.epoch == 1 and loader.cursor == B
    assert second != seen[:B]


def test_no_shuffle_is_stream_order():
    stream = _stream()
    loader = PackedLoader(stream, 8, 3, shuffle=False)
    rows = []
    for _ in range(3):
        rows.append(loader.peek_rows().tolist())
        next(loader)
    assert rows == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


# ------------------------------------------------------------------------------ resume


@pytest.mark.parametrize("k", [0, 1, 7, 29])
def test_resume_is_exact(k):
    stream = _stream()
    T, B = 8, 4  # ~27 batches per epoch: k=29 resumes inside the second epoch
    full = _take(PackedLoader(stream, T, B, seed=9), k + 5)
    first = PackedLoader(stream, T, B, seed=9)
    _take(first, k)
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON checkpoint
    resumed = PackedLoader(stream, T, B, seed=9)
    resumed.load_state_dict(state)
    assert all(_same(x, y) for x, y in zip(_take(resumed, 5), full[k:]))


def test_load_state_rejects_a_different_setup():
    stream = _stream()
    state = PackedLoader(stream, 8, 4, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed"):
        PackedLoader(stream, 8, 4, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle"):
        PackedLoader(stream, 8, 4, seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(ValueError, match="num_tokens"):
        PackedLoader(_stream(seed=1), 8, 4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        PackedLoader(stream, 8, 4, seed=1).load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="missing keys"):
        PackedLoader(stream, 8, 4, seed=1).load_state_dict({"version": state["version"], "seed": 1})


# ------------------------------------------------------------------------------ stage switch


def test_stage_switch_keeps_token_offset_and_resumes_exactly():
    stream = _stream(num_docs=120)
    loader = PackedLoader(stream, 8, 8, seed=4)  # 64 tokens per step throughout
    _take(loader, 3)
    loader.set_shape(16, 4)
    assert (loader.seq_len, loader.batch_size, loader.epoch, loader.cursor) == (16, 4, 0, 12)
    assert loader.tokens_into_epoch == 3 * 64
    order16 = np.random.default_rng([4, 0, 16]).permutation(len(PackedRows(stream, 16)))
    assert loader.peek_rows().tolist() == order16[12:16].tolist()
    after = _take(loader, 2)
    assert all(b.input_ids.shape == (1, 64) and b.seq_len == 16 for b in after)
    assert loader.cursor == 20

    # checkpoint after the switch: a loader built at the first stage's shape resumes exactly
    state = loader.state_dict()
    expected = _take(loader, 3)
    resumed = PackedLoader(stream, 8, 8, seed=4)
    resumed.load_state_dict(state)
    assert (resumed.seq_len, resumed.batch_size) == (16, 4)
    assert all(_same(x, y) for x, y in zip(_take(resumed, 3), expected))

    # checkpoint before the switch, replayed switch: the same batches
    replay = PackedLoader(stream, 8, 8, seed=4)
    _take(replay, 3)
    pre = replay.state_dict()
    replay2 = PackedLoader(stream, 8, 8, seed=4)
    replay2.load_state_dict(pre)
    replay2.set_shape(16, 4)
    assert all(_same(x, y) for x, y in zip(_take(replay2, 2), after))


def test_switch_rounds_up_when_tokens_per_step_change():
    loader = PackedLoader(_stream(num_docs=120), 8, 3, seed=0)
    _take(loader, 1)  # 24 tokens into the epoch
    loader.set_shape(16, 2)
    assert loader.cursor == 2  # ceil(24 / 16)
    loader.set_shape(16, 2)
    assert loader.cursor == 2  # same shape: no-op


def test_shape_errors():
    stream = _stream(num_docs=3, max_len=5)
    with pytest.raises(ValueError, match="batch_size"):
        PackedLoader(stream, 2, 10_000)
    with pytest.raises(ValueError, match="seq_len"):
        PackedLoader(stream, 10_000, 1)
    with pytest.raises(ValueError, match="seed"):
        PackedLoader(stream, 2, 1, seed=-1)
    loader = PackedLoader(stream, 2, 1)
    with pytest.raises(ValueError, match="batch_size"):
        loader.set_shape(1, 10_000)


# ------------------------------------------------------------------------------ validation


def test_val_batches_are_deterministic_and_spread():
    val = _stream(seed=7)
    T, B = 8, 3
    n = len(PackedRows(val, T))
    a = list(iter_val_batches(val, T, B, max_tokens=10 * T))
    b = list(PackedLoader(_stream(), T, B, val_stream=val).val_batches(max_tokens=10 * T))
    assert [x.batch_size for x in a] == [3, 3, 3, 1]
    assert all(_same(x, y) for x, y in zip(a, b))
    idx = np.round(np.linspace(0, n - 1, 10)).astype(int)
    want = collate_rows(PackedRows(val, T), idx[:3])
    assert _same(a[0], want)
    every = list(iter_val_batches(val, T, B))
    assert sum(x.batch_size for x in every) == n
    one = list(iter_val_batches(val, T, B, max_tokens=1))
    assert len(one) == 1 and one[0].batch_size == 1
    with pytest.raises(ValueError, match="val_stream"):
        PackedLoader(val, T, B).val_batches(100)
    with pytest.raises(ValueError, match="max_tokens"):
        list(iter_val_batches(val, T, B, max_tokens=0))
