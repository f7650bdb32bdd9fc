"""Reading conversations: bad ones are reported by file and line and skipped or rejected (--on-bad)."""

import json

import pytest

from k3.cli import main
from k3.config import ConfigError
from k3.sft.data import load_conversations

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
CALL = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
BAD = [
    ({"messages": [{"role": "robot", "content": "?"}, {"role": "assistant", "content": "x"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "tool", "tool_call_id": "c0", "content": "1"},
                   {"role": "assistant", "content": "x"}]}, "no preceding assistant message with tool_calls"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{a: 1"}}]}]},
     "arguments are not valid JSON"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "zz", "content": "1"}]}, "matches no tool call"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant message"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}],
      "thinking_effort": "huge"}, "thinking_effort 'huge'"),
    ({"text": "not a conversation"}, "expected an object with a `messages` list"),
]


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_conversations_reported_by_file_and_line(tmp_path):
    lines = [json.dumps(GOOD)] + [json.dumps(b) for b, _ in BAD] + ["{not json", json.dumps(GOOD["messages"])]
    f = _write(tmp_path / "c.jsonl", lines)
    good, bad = load_conversations(f, "skip")
    assert len(good) == 2 and [g["source"] for g in good] == [f"{f}:1", f"{f}:{len(lines)}"]
    for k, (_, why) in enumerate(BAD):
        assert bad[k].source == f"{f}:{k + 2}" and why in bad[k].reason, (bad[k], why)
    assert bad[-1].source == f"{f}:{len(lines) - 1}" and "not valid JSON" in bad[-1].reason
    with pytest.raises(ConfigError, match=rf"(?s){len(BAD) + 1} malformed.*c.jsonl:2: messages\[0\]: unknown role"):
        load_conversations(f, "error")


def test_folder_and_nothing_usable(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    _write(d / "b.jsonl", [json.dumps(GOOD)])
    _write(d / "a.jsonl", [json.dumps(GOOD), json.dumps(BAD[0][0])])
    good, bad = load_conversations(d)
    assert [g["source"] for g in good] == [f"{d}/a.jsonl:1", f"{d}/b.jsonl:1"] and len(bad) == 1
    with pytest.raises(ConfigError, match="no usable conversations"):
        load_conversations(_write(tmp_path / "x.jsonl", [json.dumps(BAD[0][0])]))
    with pytest.raises(FileNotFoundError):
        load_conversations(tmp_path / "missing.jsonl")


def test_cli_rejects_bad_data_with_on_bad_error(tmp_path, base_dir, capsys):
    f = _write(tmp_path / "c.jsonl", [json.dumps(GOOD)] * 20 + [json.dumps(BAD[2][0])])
    rc = main(["sft", "--base", str(base_dir), "--data", str(f), "--out", str(tmp_path / "run"), "--on-bad", "error"])
    assert rc == 2
    assert f"{f}:21: messages[1].tool_calls[0]: arguments are not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoint").exists()
    assert main(["sft", "--out", str(tmp_path / "r2")]) == 2 and "--base" in capsys.readouterr().err
