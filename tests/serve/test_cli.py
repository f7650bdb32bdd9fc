"""`k3 chat` against the live server, and `k3 serve` argument handling."""

from __future__ import annotations

import io

import pytest

from k3.cli import build_parser
from k3.cli.chat import DIM, RESET, Client, turn


def test_chat_client_streams_a_turn(live_server, capsys):
    args = build_parser().parse_args(["chat", "--url", live_server.base_url + "/v1", "--prompt", "hello there",
                                      "--prompt", "and again", "--max-tokens", "4", "--effort", "low"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.count("prompt (") == 2 and "cached)" in out  # one usage line per turn


def test_chat_turn_shows_tool_calls(live_server):
    client = Client(live_server.base_url + "/v1", "none", 60)
    payload = {"model": "k3-tiny", "messages": [{"role": "user", "content": "weather?"}], "stream": True,
               "max_tokens": 4, "stream_options": {"include_usage": True},
               "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    buf = io.StringIO()
    msg = turn(client, payload, buf, color=True)
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "[tool call] get_weather(" in buf.getvalue()


def test_chat_reports_unreachable_server(capsys):
    args = build_parser().parse_args(["chat", "--url", "http://127.0.0.1:9/v1", "--prompt", "x", "--timeout", "2"])
    assert args.func(args) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_serve_requires_a_tokenizer_for_presets(capsys):
    args = build_parser().parse_args(["serve", "--preset", "k3-tiny"])
    assert args.func(args) == 2
    assert "--tokenizer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])


class _ScriptedClient:
    def __init__(self, events):
        self.events = events

    def stream(self, path, payload):
        yield from self.events


def test_chat_turn_dims_reasoning_and_keeps_it_in_history():
    def ev(**delta):
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

    events = [ev(role="assistant", content=""), ev(reasoning_content="hmm ", reasoning="hmm "),
              ev(reasoning_content="ok", reasoning="ok"), ev(content="Hi!"),
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3,
                                        "prompt_tokens_details": {"cached_tokens": 4}}}]
    buf = io.StringIO()
    msg = turn(_ScriptedClient(events), {}, buf, color=True)
    assert buf.getvalue().startswith(DIM + "hmm ok" + RESET + "\nHi!")
    assert "9 prompt (4 cached), 3 completion" in buf.getvalue()
    assert msg == {"role": "assistant", "content": "Hi!", "reasoning_content": "hmm ok"}
    plain = io.StringIO()
    turn(_ScriptedClient(events), {}, plain, color=False)
    assert "\x1b" not in plain.getvalue() and plain.getvalue().startswith("[thinking] hmm ok\nHi!")
