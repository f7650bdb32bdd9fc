"""Golden conversations: hand-written expected XTML (spec §2, §2.8) vs the renderer, plus the
token-level contract (per-segment encoding, control-only specials, assistant loss mask)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3.chat import END_OF_MSG, OPEN, encode_chat, render, render_segments, render_text
from k3.chat.xtml import CLOSE, MARKERS, SEP

GOLDEN = sorted((Path(__file__).parent / "golden").glob("*.json"))


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def run_text(case: dict) -> str:
    return render_text(case["messages"], case["tools"], **case["kwargs"])


def test_enough_goldens() -> None:
    assert len(GOLDEN) >= 20


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_text(path: Path) -> None:
    case = load(path)
    assert run_text(case) == "".join(case["expected"])


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_tokens(path: Path, tok) -> None:
    case = load(path)
    expected = "".join(case["expected"])
    ids, mask = render(case["messages"], tok, case["tools"], **case["kwargs"])
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    assert tok.decode(ids) == expected
    if path.stem not in ("13_typed_arguments", "25_images_with_prompts", "26_marker_text_in_content"):
        # no marker text inside content: every marker in the text is a control token
        n_markers = sum(expected.count(m) for m in MARKERS)
        assert sum(tok.is_special(i) for i in ids) == n_markers
    assert encode_chat(tok, case["messages"], case["tools"], **case["kwargs"]) == (ids, mask)


def test_segments_split_like_official_encoder(tok) -> None:
    """Tag name, ` key`, `="`, value and `"` are encoded separately (BPE never merges across)."""
    ids, _ = render([{"role": "user", "content": "Hi"}], tok, thinking_effort=None)
    e = tok.encode
    want = (
        [tok.special_id(OPEN)] + e("message") + e(" role") + e('="') + e("user") + e('"') + [tok.special_id(SEP)]
        + e("Hi") + [tok.special_id(CLOSE)] + e("message") + [tok.special_id(SEP), tok.eos_id]
    )
    assert ids == want


def test_marker_text_in_content_is_ordinary_tokens(tok) -> None:
    case = load(Path(__file__).parent / "golden" / "26_marker_text_in_content.json")
    ids, _ = render(case["messages"], tok, case["tools"], **case["kwargs"])
    neutral = json.loads(json.dumps(case["messages"]).replace("<|", "[[").replace("|>", "]]"))
    ids_neutral, _ = render(neutral, tok, case["tools"], **case["kwargs"])
    assert sum(tok.is_special(i) for i in ids) == sum(tok.is_special(i) for i in ids_neutral)
    user_text = case["messages"][0]["content"]
    body = tok.encode(user_text)
    assert not any(tok.is_special(i) for i in body)
    assert any(ids[k : k + len(body)] == body for k in range(len(ids)))


def test_image_prompts_are_control_segments(tok) -> None:
    case = load(Path(__file__).parent / "golden" / "25_images_with_prompts.json")
    ids, mask = render(case["messages"], tok, case["tools"], **case["kwargs"])
    assert ids.count(tok.special_id("<|media_begin|>")) == 2
    assert ids.count(tok.special_id("<|media_end|>")) == 2
    assert not any(mask)


def _spans(ids: list[int], mask: list[int], tok) -> list[str]:
    out, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def test_loss_mask_thinking_agent_loop(tok) -> None:
    case = load(Path(__file__).parent / "golden" / "28_agent_loop.json")
    ids, mask = render(case["messages"], tok, case["tools"], **case["kwargs"])
    tail = "<|close|>message<|sep|><|end_of_msg|>"
    assert _spans(ids, mask, tok) == [
        'r1<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
        '<|open|>call tool="ls" index="1"<|sep|><|open|>argument key="dir" type="string"<|sep|>.'
        '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>' + tail,
        'r2<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
        '<|open|>call tool="cat" index="1"<|sep|><|open|>argument key="file" type="string"<|sep|>f.txt'
        '<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>' + tail,
    ]
    assert ids[-1] != tok.eos_id and mask[-1] == 0  # the generation prompt is not trained on


def test_loss_mask_non_thinking(tok) -> None:
    case = load(Path(__file__).parent / "golden" / "03_non_thinking.json")
    ids, mask = render(case["messages"], tok, case["tools"], **case["kwargs"])
    assert _spans(ids, mask, tok) == ["Hello!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"]


def test_loss_mask_empty_without_assistant(tok) -> None:
    ids, mask = render([{"role": "user", "content": "x"}], tok, add_generation_prompt=True)
    assert len(ids) == len(mask) and not any(mask)


def test_generation_prompt_is_prefix_of_assistant_turn() -> None:
    """Prompt + the assistant's produced text == the rendered conversation with that turn."""
    user = [{"role": "user", "content": "q"}]
    turn = {"role": "assistant", "reasoning_content": "r", "content": "a"}
    for thinking in (True, False):
        prompt = render_text(user, thinking=thinking, add_generation_prompt=True)
        full = render_text(user + [turn], thinking=thinking)
        assert full.startswith(prompt)
        produced = full[len(prompt):]
        assert produced.endswith(CLOSE + "message" + SEP + END_OF_MSG)


def test_effort_values_and_input_not_mutated() -> None:
    msgs = [{"role": "assistant", "content": "", "tool_calls": [{"id": "b", "function": {"name": "f", "arguments": "{}"}},
                                                               {"id": "a", "function": {"name": "g", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a", "name": "x", "content": "1"},
            {"role": "tool", "tool_call_id": "b", "content": "2"}]
    snapshot = json.dumps(msgs)
    for effort in ("low", "medium", "high", "max"):
        assert f"`thinking_effort={effort}`." in render_text(msgs, thinking_effort=effort)
    assert json.dumps(msgs) == snapshot


def test_segments_flags() -> None:
    segs = render_segments([{"role": "user", "content": "<|open|>"}], thinking_effort=None)
    assert [s.text for s in segs if s.special] == [OPEN, SEP, CLOSE, SEP, END_OF_MSG]
    assert any(s.text == "<|open|>" and not s.special for s in segs)
