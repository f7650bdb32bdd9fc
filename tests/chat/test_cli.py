"""`k3 chat-template FILE.json [--ids] [--tokenizer DIR]`."""

from __future__ import annotations

import json
from pathlib import Path

from k3.cli import main
from k3.chat import encode_chat

GOLDEN = Path(__file__).parent / "golden"


def test_renders_golden_file(capsys) -> None:
    case = json.loads((GOLDEN / "22_response_format_json_schema.json").read_text(encoding="utf-8"))
    assert main(["chat-template", str(GOLDEN / "22_response_format_json_schema.json")]) == 0
    assert capsys.readouterr().out == "".join(case["expected"]) + "\n"


def test_request_body_and_flags(tmp_path, capsys) -> None:
    body = {"model": "k3", "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"}
    f = tmp_path / "req.json"
    f.write_text(json.dumps(body))
    assert main(["chat-template", str(f)]) == 0
    assert "`thinking_effort=low`" in capsys.readouterr().out
    assert main(["chat-template", str(f), "--no-thinking", "--generation-prompt"]) == 0
    out = capsys.readouterr().out
    assert "thinking-effort" not in out and out.endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>\n')
    assert main(["chat-template", str(f), "--effort", "none"]) == 0
    assert "thinking-effort" not in capsys.readouterr().out


def test_ids_with_tokenizer(tmp_path, tok, capsys) -> None:
    tok.save(tmp_path / "tok")
    f = tmp_path / "conv.json"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    f.write_text(json.dumps(msgs))
    assert main(["chat-template", str(f), "--ids", "--tokenizer", str(tmp_path / "tok")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["input_ids"], out["loss_mask"]) == encode_chat(tok, msgs)


def test_errors(tmp_path, capsys) -> None:
    f = tmp_path / "conv.json"
    f.write_text(json.dumps([{"role": "wizard", "content": "x"}]))
    assert main(["chat-template", str(f)]) == 1
    assert "unknown role 'wizard'" in capsys.readouterr().err
    f.write_text(json.dumps([{"role": "user", "content": "x"}]))
    assert main(["chat-template", str(f), "--ids"]) == 2
    assert "--ids needs --tokenizer" in capsys.readouterr().err
    assert main(["chat-template", str(f), "--ids", "--tokenizer", str(tmp_path / "nope")]) == 2
    assert "tokenizer directory not found" in capsys.readouterr().err
    assert main(["chat-template", str(tmp_path / "missing.json")]) == 2
    f.write_text("{not json")
    assert main(["chat-template", str(f)]) == 2
    assert "cannot read" in capsys.readouterr().err
