"""The EAGLE-3 draft (k3.model.draft) on a random k3-tiny target: the capture hook leaves the target's
output alone, the cached draft forward equals the full one, the training-time-test unroll sees what
serving sees, checkpoints round-trip, and a draft of another target is refused with a clear error."""

from __future__ import annotations

import json
import os

import pytest
import torch

from k3.config import k3_tiny
from k3.draft.ttt import target_pass, ttt_forward
from k3.model.causal_lm import K3ForCausalLM
from k3.model.draft import DraftConfig, EagleDraft, default_target_layers, load_draft, save_draft
from k3.model.safetensors_io import CheckpointError


@pytest.fixture(scope="module")
def target() -> K3ForCausalLM:
    torch.manual_seed(0)
    return K3ForCausalLM(k3_tiny()).init_weights(seed=0).eval()


@pytest.fixture(scope="module")
def draft(target) -> EagleDraft:
    torch.manual_seed(1)
    return EagleDraft(DraftConfig.for_target(target.config)).attach(target).eval()


def test_default_layers_and_config_checks(target):
    assert default_target_layers(6) == (1, 3, 5)
    assert default_target_layers(1) == (0, 0, 0)
    c = DraftConfig.for_target(target.config)
    assert (c.hidden_size, c.vocab_size, c.target_num_layers) == (256, 4096, 6)
    with pytest.raises(ValueError, match="target_layers"):
        DraftConfig.for_target(target.config, target_layers=(1, 3, 7))
    with pytest.raises(RuntimeError, match="attach"):
        EagleDraft(c).logits(torch.zeros(1, 256))


def test_capture_hook_leaves_the_target_output_unchanged(target):
    ids = torch.randint(0, 4096, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain, none = target.model(ids)
        captured, hidden = target.model(ids, hidden_state_layers=[1, 3, 6])
    assert none == {} and sorted(hidden) == [1, 3, 6]
    assert all(h.shape == (2, 11, 256) for h in hidden.values())
    torch.testing.assert_close(captured, plain, rtol=0, atol=0)


def test_cached_forward_equals_full_forward(target, draft):
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, 4096, (2, 9), generator=g)
    feats = torch.randn(2, 9, 256, generator=g)
    with torch.no_grad():
        full, k, v = draft(tok, feats)
        head, k1, v1 = draft(tok[:, :6], feats[:, :6])
        # row 1 has only 4 valid cached entries: its padding must be invisible
        valid = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
        tail, _, _ = draft(tok[:, 6:], feats[:, 6:], k1, v1, valid)
        row1, _, _ = draft(tok[1:, 6:], feats[1:, 6:], k1[1:, :4], v1[1:, :4], valid[1:, :4])
    torch.testing.assert_close(head, full[:, :6], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail[0], full[0, 6:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail[1], row1[0], rtol=1e-5, atol=1e-5)


def test_ttt_unroll_matches_the_serving_computation(target, draft):
    """Step s of the unroll at entry j == serving after position j: the real entries 0..j in the draft's
    cache, then s speculative entries (the draft's own hidden, the next token) appended one by one."""
    ids = torch.randint(0, 4096, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        aux, logp = target_pass(target, ids, draft.config.target_layers)
        out = ttt_forward(draft, aux, logp, ids, torch.tensor([12]), torch.tensor([0]), 3, keep_logits=True)
        h0, k0, v0 = draft(ids[:, 1:], draft.fuse(aux[:, :11]))  # step 0 over all 11 entries
        torch.testing.assert_close(out.step_logits[0][0], draft.logits(h0[0]).float(), rtol=1e-4, atol=1e-4)
        for j in range(0, 9):
            keys, values, h = k0[:, : j + 1], v0[:, : j + 1], h0[:, j: j + 1]
            for s in (1, 2):
                h, k, v = draft(ids[:, j + 1 + s: j + 2 + s], h, keys, values,
                                torch.ones(1, keys.shape[1], dtype=torch.bool))
                keys, values = torch.cat([keys, k], 1), torch.cat([values, v], 1)
                torch.testing.assert_close(out.step_logits[s][0, j], draft.logits(h[0, 0]).float(),
                                           rtol=1e-4, atol=1e-4)
    assert len(out.step_loss) == 3 and out.positions > 0 and 1.0 <= out.tau <= 4.0


def test_save_load_roundtrip(tmp_path, target, draft):
    save_draft(draft, tmp_path / "d")
    save_draft(draft, tmp_path / "d")  # overwrite in place (atomic rename over the old one)
    assert sorted(os.listdir(tmp_path)) == ["d"]
    assert sorted(os.listdir(tmp_path / "d")) == ["config.json", "model.safetensors"]
    back = load_draft(tmp_path / "d", target)
    assert back.config == draft.config and back.shared is not None
    for (n, a), (_, b) in zip(draft.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n
    assert not any("embed_tokens" in k or "lm_head" in k for k in back.state_dict())  # shared, not stored
    tok, feats = torch.tensor([[5, 6, 7]]), torch.randn(1, 3, 256)
    with torch.no_grad():
        torch.testing.assert_close(back.logits(back(tok, feats)[0]), draft.logits(draft(tok, feats)[0]))


def test_mismatched_or_broken_drafts_are_refused(tmp_path, target):
    other = EagleDraft(DraftConfig.for_target(target.config, hidden_size=128, vocab_size=1000))
    save_draft(other, tmp_path / "other")
    with pytest.raises(CheckpointError, match=r"hidden_size: draft 128, target 256.*vocab_size: draft 1000"):
        load_draft(tmp_path / "other", target)
    with pytest.raises(FileNotFoundError, match="train-draft"):
        load_draft(tmp_path / "nothing", target)
    good = EagleDraft(DraftConfig.for_target(target.config))
    save_draft(good, tmp_path / "bad")
    cfg = json.loads((tmp_path / "bad" / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps(cfg | {"model_type": "kimi_k3"}))
    with pytest.raises(CheckpointError, match="not a k3 draft"):
        load_draft(tmp_path / "bad", target)
    (tmp_path / "bad" / "config.json").write_text(json.dumps(cfg | {"intermediate_size": 64}))
    with pytest.raises(CheckpointError, match="shapes"):
        load_draft(tmp_path / "bad", target)
