"""Model-output parser: expected results, tolerance, streaming == batch, round trips."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.chat import ChatDelta, StreamingParser, parse, render_text
from k3.chat.xtml import CLOSE, END_OF_MSG, MARKERS, OPEN, SEP

O, C, S, E = OPEN, CLOSE, SEP, END_OF_MSG
TAIL = C + "message" + S + E


def result(reasoning: str = "", content: str = "", calls: list | None = None) -> dict:
    return {"reasoning_content": reasoning, "content": content, "tool_calls": calls or []}


def fn(index: int, name: str, arguments: str) -> dict:
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


CALLS_OUT = (
    "Let me check." + C + "think" + S + O + "response" + S + "Checking." + C + "response" + S + O + "tools" + S
    + O + 'call tool="get_weather" index="1"' + S + O + 'argument key="city" type="string"' + S + "Paris" + C + "argument" + S
    + O + 'argument key="days" type="number"' + S + "3" + C + "argument" + S + C + "call" + S
    + O + 'call tool="search" index="2"' + S + O + 'argument key="q" type="string"' + S + 'a "b" <c>' + C + "argument" + S
    + O + 'argument key="filters" type="object"' + S + '{"lang": "ü", "n": [1, 2.5]}' + C + "argument" + S
    + O + 'argument key="exact" type="boolean"' + S + "false" + C + "argument" + S
    + O + 'argument key="x" type="null"' + S + "null" + C + "argument" + S + C + "call" + S
    + O + 'call tool="noargs" index="3"' + S + C + "call" + S
    + O + 'call tool="raw" index="4"' + S + O + 'json type="object"' + S + "{broken" + C + "json" + S + C + "call" + S
    + C + "tools" + S + TAIL
)

CASES = [
    ("think_then_response", "I think." + C + "think" + S + O + "response" + S + "Answer." + C + "response" + S + TAIL, {},
     result("I think.", "Answer.")),
    ("explicit_think_open", O + "think" + S + "r" + C + "think" + S + O + "response" + S + "a" + C + "response" + S + TAIL, {},
     result("r", "a")),
    ("full_message", O + 'message role="assistant"' + S + O + "think" + S + "r" + C + "think" + S + O + "response" + S + "a"
     + C + "response" + S + TAIL, {"start": None}, result("r", "a")),
    ("non_thinking", "Just the answer." + C + "response" + S + TAIL, {"start": "response"}, result("", "Just the answer.")),
    ("tool_calls", CALLS_OUT, {}, result("Let me check.", "Checking.", [
        fn(0, "get_weather", '{"city": "Paris", "days": 3}'),
        fn(1, "search", '{"q": "a \\"b\\" <c>", "filters": {"lang": "ü", "n": [1, 2.5]}, "exact": false, "x": null}'),
        fn(2, "noargs", "{}"), fn(3, "raw", "{broken")])),
    ("escaped_attrs", "" + C + "think" + S + O + "tools" + S + O + 'call tool="a&amp;b" index="1"' + S
     + O + 'argument key="k &quot;q&quot; &amp;quot;" type="string"' + S + "v" + C + "argument" + S + C + "call" + S + C + "tools" + S + TAIL,
     {}, result("", "", [fn(0, "a&b", '{"k \\"q\\" &quot;": "v"}')])),
    ("truncated_in_think", "Still thinking about", {}, result("Still thinking about")),
    ("truncated_in_response", "r" + C + "think" + S + O + "response" + S + "partial ans", {}, result("r", "partial ans")),
    ("truncated_in_call", "r" + C + "think" + S + O + "response" + S + "a" + C + "response" + S + O + "tools" + S
     + O + 'call tool="f" index="1"' + S + O + 'argument key="x" type="string"' + S + "hal", {}, result("r", "a")),
    ("truncated_mid_tag", "r" + C + "think" + S + O + "respo", {}, result("r")),
    ("truncated_mid_marker", "r" + C + "think" + S + "<|op", {}, result("r", "<|op")),
    ("unknown_tag_is_text", "r" + O + "foo bar" + S + "x" + C + "think" + S, {}, result("r" + O + "foo bar" + S + "x")),
    ("close_unopened_is_text", "r" + C + "response" + S + "x", {}, result("r" + C + "response" + S + "x")),
    ("stray_sep_is_text", "a" + S + "b", {}, result("a" + S + "b")),
    ("interrupted_header_is_text", "a" + O + "think" + C + "think" + S + "b", {}, result("a" + O + "think", "b")),
    ("implicit_close_of_think", "r" + O + "response" + S + "a" + TAIL, {}, result("r", "a")),
    ("after_end_of_msg_ignored", "r" + C + "think" + S + O + "response" + S + "a" + C + "response" + S + TAIL + "garbage" + O,
     {}, result("r", "a")),
    ("text_outside_channels", "r" + C + "think" + S + "loose" + O + "response" + S + "a" + C + "response" + S + "tail" + TAIL,
     {}, result("r", "looseatail")),
    ("bad_typed_value_kept_raw", C + "think" + S + O + "tools" + S + O + 'call tool="f" index="1"' + S
     + O + 'argument key="n" type="number"' + S + "twelve" + C + "argument" + S + C + "call" + S + C + "tools" + S + TAIL,
     {}, result("", "", [fn(0, "f", '{"n": "twelve"}')])),
    ("call_without_tools_block", C + "think" + S + O + 'call tool="f"' + S + C + "call" + S + TAIL, {},
     result("", "", [fn(0, "f", "{}")])),
    ("call_closed_by_outer_close", C + "think" + S + O + "tools" + S + O + 'call tool="f" index="1"' + S
     + O + 'argument key="a" type="number"' + S + "1" + C + "tools" + S + TAIL, {}, result("", "", [fn(0, "f", '{"a": 1}')])),
    ("call_missing_tool_attr", C + "think" + S + O + "tools" + S + O + "call" + S + C + "call" + S + C + "tools" + S, {},
     result("", O + "call" + S + C + "call" + S)),
    ("argument_outside_call", C + "think" + S + O + "response" + S + O + 'argument key="k"' + S + "v", {},
     result("", O + 'argument key="k"' + S + "v")),
    ("cot_in_content", "" + C + "think" + S + O + "response" + S + "Let me think step by step... answer 4" + C + "response" + S + TAIL,
     {}, result("", "Let me think step by step... answer 4")),
    ("empty", "", {}, result()),
]


@pytest.mark.parametrize("text,kwargs,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_parse_text(text: str, kwargs: dict, expected: dict) -> None:
    assert parse(text, **kwargs) == expected


@pytest.mark.parametrize("text,kwargs,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_parse_ids_matches_text(text: str, kwargs: dict, expected: dict, tok) -> None:
    ids = tok.encode(text, allow_special=True)
    assert parse(ids, tok, **kwargs) == expected


@pytest.mark.parametrize("text,kwargs", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_streaming_equals_batch_every_split_text(text: str, kwargs: dict) -> None:
    batch = parse(text, **kwargs)
    for cut in range(len(text) + 1):
        p = StreamingParser(**kwargs)
        p.feed(text[:cut])
        p.feed(text[cut:])
        p.finish()
        assert p.result() == batch, cut


@pytest.mark.parametrize("text,kwargs", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_streaming_equals_batch_every_split_ids(text: str, kwargs: dict, tok) -> None:
    ids = tok.encode(text, allow_special=True)
    batch = parse(ids, tok, **kwargs)
    for cut in range(len(ids) + 1):
        p = StreamingParser(tok, **kwargs)
        deltas = p.feed(ids[:cut]) + p.feed(ids[cut:]) + p.finish()
        assert p.result() == batch, cut
        assert _accumulate(deltas) == batch, cut


def _accumulate(deltas: list[ChatDelta]) -> dict:
    out = result()
    for d in deltas:
        if d.kind == "tool_call":
            tc = dict(d.tool_call)
            assert tc.pop("index") == len(out["tool_calls"])
            out["tool_calls"].append(tc)
        else:
            out["reasoning_content" if d.kind == "reasoning" else "content"] += d.text
    return out


def test_token_by_token_deltas(tok) -> None:
    ids = tok.encode(CALLS_OUT, allow_special=True)
    p = StreamingParser(tok)
    deltas = [d for t in ids for d in p.feed(t)] + p.finish()
    assert _accumulate(deltas) == parse(CALLS_OUT)
    kinds = [d.kind for d in deltas]
    # reasoning first, then content, then complete tool calls (each emitted exactly once)
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert kinds.count("tool_call") == 4 and kinds[-4:] == ["tool_call"] * 4
    first_call = next(d for d in deltas if d.kind == "tool_call").tool_call
    assert first_call == {"index": 0, "id": "call_0", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}


def test_tool_call_emitted_only_after_close(tok) -> None:
    text = C + "think" + S + O + "tools" + S + O + 'call tool="f" index="1"' + S + O + 'argument key="a" type="string"' + S + "x" + C + "argument" + S
    p = StreamingParser()
    assert not [d for d in p.feed(text) if d.kind == "tool_call"]
    assert [d.kind for d in p.feed(C + "call" + S)] == ["tool_call"]


def test_finish_can_close_an_open_call() -> None:
    """A forced call the model ended early (end marker inside it) still comes out with close_calls."""
    text = C + "think" + S + O + "tools" + S + O + 'call tool="f" index="1"' + S + O + 'argument key="a" type="string"' + S + "x" + E
    dropped, closed = StreamingParser(), StreamingParser()
    dropped.feed(text)
    closed.feed(text)
    assert dropped.finish() == [] and dropped.result()["tool_calls"] == []
    (d,) = closed.finish(close_calls=True)
    assert d.kind == "tool_call" and d.tool_call["function"] == {"name": "f", "arguments": '{"a": "x"}'}
    assert StreamingParser().finish(close_calls=True) == []  # nothing open: nothing emitted


def test_special_text_from_ordinary_tokens_is_content(tok) -> None:
    """The think-leak guard: marker text made of ordinary BPE pieces never opens a channel."""
    leak = O + "response" + S + "leaked"
    ids = tok.encode(leak) + [tok.special_id(C)] + tok.encode("think") + [tok.special_id(S)]
    assert parse(ids, tok) == result(leak)
    assert parse(tok.decode(ids)) != result(leak)  # at text level it is indistinguishable


def test_tool_call_id_factory_and_done_flag() -> None:
    p = StreamingParser(tool_call_id=lambda i, name: f"functions.{name}:{i}")
    p.feed(C + "think" + S + O + "tools" + S + O + 'call tool="add" index="1"' + S + C + "call" + S + C + "tools" + S)
    assert not p.done
    p.feed(TAIL + "more")
    assert p.done
    p.finish()
    assert p.result()["tool_calls"][0]["id"] == "functions.add:0"


def test_invalid_utf8_tokens_decode_like_batch(tok) -> None:
    partial = tok.encode("日本")[:1]  # a token that is an incomplete UTF-8 sequence on its own
    ids = tok.encode("a") + partial + [tok.special_id(C)] + tok.encode("think") + [tok.special_id(S)] + partial
    batch = parse(ids, tok)
    for cut in range(len(ids) + 1):
        p = StreamingParser(tok)
        p.feed(ids[:cut]), p.feed(ids[cut:]), p.finish()
        assert p.result() == batch
    assert "\ufffd" in batch["reasoning_content"]


def test_parser_argument_errors(tok) -> None:
    with pytest.raises(ValueError, match="start"):
        StreamingParser(start="tools")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        parse([1, 2, 3])
    p = StreamingParser(tok)
    p.feed("text")
    with pytest.raises(ValueError, match="cannot mix"):
        p.feed([1])


def test_linear_time_streaming() -> None:
    """O(1) amortised work per chunk: 4x the output costs ~4x the time (quadratic would be 16x)."""
    unit = "word " * 3 + O + "response" + S + "x" + C + "response" + S

    def cost(n: int) -> float:
        best = float("inf")
        for _ in range(3):
            text = unit * n
            t0 = time.perf_counter()
            p = StreamingParser()
            for k in range(0, len(text), 3):
                p.feed(text[k : k + 3])
            p.finish()
            best = min(best, time.perf_counter() - t0)
        return best

    assert cost(800) / cost(200) < 8


def test_linear_time_single_feed(tok) -> None:
    """One big feed of ids (the batch path) must not grow its delta strings quadratically."""
    unit = tok.encode("some reasoning words ")

    def cost(n: int) -> float:
        ids = unit * n
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            parse(ids, tok)
            best = min(best, time.perf_counter() - t0)
        return best

    assert cost(8000) / cost(2000) < 8


# ------------------------------------------------------------------ round trip (hypothesis)

_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=40)
_safe_text = _text.filter(lambda s: not any(m in s for m in MARKERS))
_json_scalar = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=False, allow_infinity=False) | _text
_json = st.recursive(_json_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3), max_leaves=6)
_key = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12)
_name = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,15}", fullmatch=True)


def _turns(text_strategy):
    args = st.dictionaries(_key.filter(lambda k: not any(m in k for m in MARKERS)), _json, max_size=4)
    strings_ok = args.filter(lambda a: all(not isinstance(v, str) or not any(m in v for m in MARKERS) for v in a.values()))
    call = st.tuples(_name, strings_ok if text_strategy is _safe_text else args)
    return st.tuples(text_strategy, text_strategy, st.lists(call, max_size=3))


def _turn(reasoning: str, content: str, calls: list) -> dict:
    turn = {"role": "assistant", "reasoning_content": reasoning, "content": content}
    if calls:
        turn["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
                              for i, (n, a) in enumerate(calls)]
    return turn


def _expected(turn: dict) -> dict:
    calls = [{**c, "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
             for c in turn.get("tool_calls", [])]
    reasoning = turn["reasoning_content"] if turn["reasoning_content"].strip() else ""
    return {"reasoning_content": reasoning, "content": turn["content"], "tool_calls": calls}


def _normalise(parsed: dict) -> dict:
    calls = [{**c, "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
             for c in parsed["tool_calls"]]
    return {**parsed, "tool_calls": calls}


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(_turns(_safe_text))
def test_round_trip_text(parts) -> None:
    turn = _turn(*parts)
    assert _normalise(parse(render_text([turn], thinking_effort=None), start=None)) == _expected(turn)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(_turns(_text))
def test_round_trip_ids(tok, parts) -> None:
    """At token level even marker text inside content / arguments round-trips."""
    from k3.chat import render

    turn = _turn(*parts)
    ids, mask = render([turn], tok, thinking_effort=None)
    assert _normalise(parse(ids, tok, start=None)) == _expected(turn)
    # the generation-prompt form: the parser sees only what the model produced
    produced = [i for i, m in zip(ids, mask) if m]
    assert _normalise(parse(produced, tok)) == _expected(turn)


_pieces = st.lists(st.sampled_from(list(MARKERS) * 3 + ["think", "response", "tools", 'call tool="f"', 'argument key="k" type="number"',
                                                        'json type="object"', "message", "1", " x ", "<|", "|>", '"', "é", "\n"]), max_size=40)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_pieces, st.sampled_from(["think", "response", None]), st.data())
def test_never_raises_and_chunking_invariant(tok, pieces, start, data) -> None:
    text = "".join(pieces)
    batch = parse(text, start=start)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=4)))
    p = StreamingParser(start=start)
    prev = 0
    for c in cuts + [len(text)]:
        p.feed(text[prev:c])
        prev = c
    p.finish()
    assert p.result() == batch
    assert parse(tok.encode(text, allow_special=True), tok, start=start) == batch


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_pieces)
def test_forced_call_always_comes_out(tok, pieces) -> None:
    """Named tool_choice: whatever the model writes after the forced call header, finish(close_calls=True)
    emits that call (first, under its own name)."""
    p = StreamingParser(tok, start="response")
    p.feed(tok.encode(C + "response" + S + O + "tools" + S + O + 'call tool="get_weather" index="1"' + S, allow_special=True))
    p.feed(tok.encode("".join(pieces), allow_special=True))
    p.finish(close_calls=True)
    calls = p.result()["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "get_weather"
