"""Decision-token loss weights: which tokens are marked (golden), the weighted loss with all weights 1 is the
plain loss, the weighted loss is the normalised weighted mean, and decision_weight 1 leaves batches
unweighted (today's loss path exactly)."""

import numpy as np
import torch

from k3.chat.render import render
from k3.model.causal_lm import K3ForCausalLM
from k3.sft.packing import collate, encode_conversation, encode_weighted, pack
from k3.sft.weights import encode_with_decisions, normalise, weighted_loss
from tests.sft.test_mask import TOOLS, _call, _runs

CONV = {"messages": [
    {"role": "system", "content": "You are an agent."}, {"role": "user", "content": "What is under k3?"},
    {"role": "assistant", "reasoning_content": "Look it up.", "content": "",
     "tool_calls": [_call(0, "lookup", {"key": "k3"})]},
    {"role": "tool", "tool_call_id": "c0", "content": '{"value": 42}'},
    {"role": "assistant", "reasoning_content": "", "content": "",
     "tool_calls": [_call(1, "lookup", {"key": "k4"}), _call(2, "lookup", {"key": "k5"})]},
    {"role": "tool", "tool_call_id": "c1", "content": "1"}, {"role": "tool", "tool_call_id": "c2", "content": "2"},
    {"role": "assistant", "reasoning_content": "Done.", "content": "It is 42."}], "tools": TOOLS}


def test_decision_tokens_golden(tokenizer):
    msgs, tools = CONV["messages"], CONV["tools"]
    ids, mask, decision = encode_with_decisions(msgs, tokenizer, tools, "high", think_tokens=1000)
    assert (ids, mask) == render(msgs, tokenizer, tools, thinking_effort="high")  # the same tokens
    assert all(m for m, d in zip(mask, decision) if d)  # only assistant tokens
    # whole reasoning + its closing tag (think_tokens covers it), tool names, argument values; an empty
    # reasoning marks its closing tag; keys, tags, the response and the tool results are not marked
    assert _runs(tokenizer, ids, decision) == ["Look it up.<|close|>", "lookup", "k3", "<|close|>", "lookup", "k4",
                                               "lookup", "k5", "Done.<|close|>"]
    _, _, short = encode_with_decisions(msgs, tokenizer, tools, "high", think_tokens=1)
    first = tokenizer.decode(tokenizer.encode("Look it up.")[:1])
    assert _runs(tokenizer, ids, short)[:2] == [first, "lookup"]
    # each non-empty reasoning keeps its first token only (its other tokens and its closing tag drop out)
    assert sum(short) == sum(decision) - len(tokenizer.encode("Look it up.")) - len(tokenizer.encode("Done."))


def test_weights_shift_onto_targets(tokenizer):
    x, y, w = encode_weighted(CONV, tokenizer, "low", 4.0, 2)
    x0, y0 = encode_conversation(CONV, tokenizer, "low")
    assert np.array_equal(x, x0) and np.array_equal(y, y0) and w.dtype == np.float32
    _, _, decision = encode_with_decisions(CONV["messages"], tokenizer, TOOLS, "low", 2)
    assert np.array_equal(w[:-1], np.where(np.asarray(decision[1:]) == 1, 4.0, 1.0)) and w[-1] == 1


def test_weighted_loss(base_dir, tokenizer):
    docs = [encode_weighted(CONV, tokenizer, "low", 6.0, 4), encode_weighted(CONV, tokenizer, "max", 6.0, 4)]
    data = pack(docs, 2048, tokenizer.pad_id)
    batch = collate(data, list(range(data.num_rows)))
    valid = batch.labels != -100
    w = batch.loss_weights
    assert w is not None and torch.allclose(w[valid].mean(), torch.tensor(1.0)) and (w[~valid] == 0).all()
    assert w[valid].max() > 1 and w[valid].min() < 1
    model = K3ForCausalLM.from_pretrained(base_dir, dtype="float32").eval()
    with torch.no_grad():
        plain = model(batch.input_ids, labels=batch.labels, cu_seqlens=batch.cu_seqlens, return_logits=False).loss
        logits = model(batch.input_ids, cu_seqlens=batch.cu_seqlens).logits
        ones = torch.from_numpy(normalise(np.ones(batch.labels.shape, np.float32), batch.labels.numpy()))
        obj1, mean1 = weighted_loss(logits, batch.labels, ones)
        obj, mean = weighted_loss(logits, batch.labels, w)
    # all weights 1: the model's own loss
    torch.testing.assert_close(obj1, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mean1, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mean, plain, rtol=1e-6, atol=1e-6)  # the logged loss stays the plain mean
    ce = torch.nn.functional.cross_entropy(logits[0][valid[0]], batch.labels[valid], reduction="none")
    torch.testing.assert_close(obj, (ce * w[valid]).sum() / ce.numel(), rtol=1e-6, atol=1e-6)
    # what the SFT loop computes: logits only at the targets (logits_index), the same objective and mean
    keep = valid.flatten().nonzero().squeeze(1)
    with torch.no_grad():
        at = model(batch.input_ids, cu_seqlens=batch.cu_seqlens, logits_index=keep).logits
        obj_at, mean_at = weighted_loss(at, batch.labels.flatten()[keep], w.flatten()[keep])
    assert at.shape == (keep.numel(), logits.shape[-1])
    torch.testing.assert_close(at, logits.flatten(0, 1)[keep], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(obj_at, obj, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mean_at, mean, rtol=1e-6, atol=1e-6)


def test_unweighted_docs_give_unweighted_batches(tokenizer):
    data = pack([encode_conversation(CONV, tokenizer, "low")], 2048, tokenizer.pad_id)
    assert data.w is None and collate(data, [0]).loss_weights is None


def test_decision_weight_config():
    import pytest

    from k3.config import ConfigError
    from k3.sft.config import SFTConfig

    assert SFTConfig.from_dict({}).validate().decision_weight == 5.0
    for bad in (0.5, True, "5"):
        with pytest.raises(ConfigError, match="decision_weight"):
            SFTConfig.from_dict({"decision_weight": bad}).validate()
