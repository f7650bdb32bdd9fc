"""The SFT loss mask covers exactly the assistant's tokens, for every kind of message (golden cases)."""

import numpy as np

from k3.chat.render import render
from k3.sft.data import conversation
from k3.sft.packing import encode_conversation, targets_from_mask

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Read a key.",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}]
LATE_TOOLS = [{"type": "function", "function": {"name": "submit", "description": "Submit.",
                                                "parameters": {"type": "object", "properties": {}}}}]
END = "<|close|>message<|sep|><|end_of_msg|>"
MID = "<|close|>think<|sep|><|open|>response<|sep|>"


def _call(i, name, args):
    return {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": args}}


def _runs(tok, ids, mask):
    """Decoded text of each maximal run of masked tokens."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    return runs + ([tok.decode(cur)] if cur else [])


def test_plain_turns_and_preserved_thinking(tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "reasoning_content": "Greet.", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "reasoning_content": "Say bye.", "content": "Bye!"}]
    ids, mask = render(msgs, tokenizer, thinking_effort="low")
    # both turns' reasoning is trained on (preserved thinking), nothing of system / user / effort message
    assert _runs(tokenizer, ids, mask) == [f"Greet.{MID}Hello!<|close|>response<|sep|>{END}",
                                           f"Say bye.{MID}Bye!<|close|>response<|sep|>{END}"]


def test_parallel_tool_calls_and_results(tokenizer):
    msgs = [{"role": "user", "content": "Look up a and b"},
            {"role": "assistant", "reasoning_content": "Both.", "content": "",
             "tool_calls": [_call(0, "lookup", '{"key": "a"}'), _call(1, "lookup", '{"key": "b"}')]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"}, {"role": "tool", "tool_call_id": "c0", "content": "1"},
            {"role": "assistant", "content": "a=1, b=2"}]
    ids, mask = render(msgs, tokenizer, TOOLS, thinking_effort="max")
    calls = ('<|open|>tools<|sep|><|open|>call tool="lookup" index="1"<|sep|><|open|>argument key="key" '
             'type="string"<|sep|>a<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool="lookup" '
             'index="2"<|sep|><|open|>argument key="key" type="string"<|sep|>b<|close|>argument<|sep|>'
             '<|close|>call<|sep|><|close|>tools<|sep|>')
    assert _runs(tokenizer, ids, mask) == [f"Both.{MID}<|close|>response<|sep|>{calls}{END}",
                                           f"{MID}a=1, b=2<|close|>response<|sep|>{END}"]
    text = tokenizer.decode(ids)
    assert "tool-declare" in text and 'role="tool" tool="lookup" index="2"' in text  # present, but unmasked


def test_mid_session_tools_and_internal_messages(tokenizer):
    msgs = [{"role": "user", "content": "Go"},
            {"role": "assistant", "content": "", "tool_calls": [_call(0, "lookup", {"key": "x"})]},
            {"role": "tool", "tool_call_id": "c0", "content": "SEVEN"},
            {"role": "system", "content": "ignored", "tools": LATE_TOOLS},
            {"role": "assistant", "content": "", "tool_calls": [_call(0, "submit", "")]},
            {"role": "tool", "tool_call_id": "c0", "content": "ACCEPTED"}]
    ids, mask = render(msgs, tokenizer, TOOLS, thinking_effort="high", tool_choice="required",
                       response_format="json_object")
    runs = _runs(tokenizer, ids, mask)
    assert runs == [f'{MID}<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="lookup" index="1"<|sep|>'
                    f'<|open|>argument key="key" type="string"<|sep|>x<|close|>argument<|sep|><|close|>call<|sep|>'
                    f'<|close|>tools<|sep|>{END}',
                    f'{MID}<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="submit" index="1"<|sep|>'
                    f'<|close|>call<|sep|><|close|>tools<|sep|>{END}']
    masked = "".join(runs)
    for internal in ("New Tools Available", "tool_choice", "response_format", "thinking_effort", "SEVEN", "ACCEPTED"):
        assert internal not in masked
    assert all(s in tokenizer.decode(ids) for s in ("New Tools Available", "tool_choice=required", "json_object"))


def test_targets_shift_onto_masked_tokens(tokenizer):
    conv = conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
    ids, mask = render(conv["messages"], tokenizer, thinking_effort="low")
    x, y = encode_conversation(conv, tokenizer, "low")
    assert x.tolist() == ids
    m = np.asarray(mask, bool)
    assert (y[:-1][m[1:]] == x[1:][m[1:]]).all() and (y[:-1][~m[1:]] == -100).all() and y[-1] == -100
    # the first target is the first assistant token, predicted from the generation prompt's last token
    first = int(np.argmax(m))
    assert y[first - 1] == x[first] and (y[:first - 1] == -100).all()
    x1, y1 = targets_from_mask([5, 6, 7], [1, 1, 1])
    assert y1.tolist() == [6, 7, -100]
