"""Malformed requests on the agent APIs and unreadable schemas for structured outputs get a 4xx in the
API's own error shape (OpenAI for chat / Responses, Anthropic for Messages), never a 500, and the
server keeps answering; `strict` tool flags survive the translation to chat. In-process with the
scripted engine of test_server.py."""

from __future__ import annotations

import json
import logging

import pytest
from starlette.testclient import TestClient

from k3.serve import anthropic_api, responses_api
from k3.serve.server import ServerConfig, build_app
from tests.serve.test_server import FakeEngine, scripted_reply

USER = [{"role": "user", "content": "hi"}]


def _tool(params: dict) -> dict:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": params}}], "tool_choice": "required"}


def _prop(schema: dict) -> dict:
    return _tool({"type": "object", "properties": {"a": schema}})


def _schema(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


CHAT = [_prop({"type": [["x"]]}), _prop({"type": 5}), _tool({"type": "object", "properties": {}, "required": 5}),
        _prop({"type": "string", "pattern": "(("}), _prop({"enum": []}), _prop({"type": "string", "maxLength": -1}),
        _prop({"type": "integer", "minimum": "x"}), _prop({"$ref": "#/nope"}), _schema(5), _schema(False),
        _schema({"type": "object", "required": 5}), _schema({"anyOf": 5}), _schema({"not": {}}),
        _schema({"type": "array", "minItems": 5, "maxItems": 2}),
        {"tool_choice": {"type": "function", "function": {"name": "f"}}}]
RESPONSES = [{"input": [{"type": "reasoning", "content": "x"}]}, {"input": [{"type": "reasoning", "summary": "abc"}]},
             {"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": 5}]}]},
             {"input": "x", "previous_response_id": ["a"]}, {"input": "x", "previous_response_id": {"a": 1}},
             {"input": "x", "reasoning": {"effort": ["a"]}}, {"input": "x", "reasoning": 5}, {"input": "x", "text": 5},
             {"input": "x", "text": {"format": {"type": "xml"}}}, {"input": "x", "store": "x"},
             {"input": "x", "text": {"format": {"type": "json_schema", "schema": 5}}}]
MESSAGES = [{"tool_choice": "any"}, {"tool_choice": {"type": "tool"}}, {"tool_choice": {"type": "any"}},
            {"tools": [5]}, {"tools": [{"name": "f", "input_schema": 5}]}, {"thinking": 5},
            {"stop_sequences": "x"}, {"system": [{"type": "image"}]}, {"output_config": 5},
            {"output_config": {"effort": "huge"}}, {"output_config": {"format": {"type": "json_schema"}}},
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
            {"output_format": {"type": "xml"}},
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                                             "input": 5}]}]},
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                                        "content": [{"type": "image"}]}]}]}]


@pytest.fixture(scope="module")
def client(tokenizer):
    app = build_app(FakeEngine(tokenizer, scripted_reply(tokenizer)), tokenizer,
                    ServerConfig(model_names=("m",), default_max_tokens=64))
    logging.disable(logging.ERROR)  # a 500 would log a traceback; the assertions below report it
    try:
        with TestClient(app, raise_server_exceptions=False) as c:
            yield c
    finally:
        logging.disable(logging.NOTSET)


def _post(client, path: str, body: dict):
    r = client.post(path, content=json.dumps({"model": "m", **body}), headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text[:300])
    return r.json()


@pytest.mark.parametrize("body", CHAT)
def test_unreadable_schemas_are_400(client, body):
    err = _post(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, **body})["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


def test_responses_and_messages_errors_keep_their_shapes(client):
    for body in RESPONSES:
        err = _post(client, "/v1/responses", body)["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
    for body in MESSAGES:
        got = _post(client, "/v1/messages", {"max_tokens": 4, "messages": USER, **body})
        assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert client.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": USER}).status_code == 200


def test_strict_tools_reach_the_chat_request():
    """`strict` on Responses and Messages tools is kept, so tool_choice auto with strict tools is
    grammar-enforced on every API (k3.serve.server._constraint reads it from the chat tools)."""
    params = {"type": "object", "properties": {"a": {"type": "string"}}}
    body, _ = responses_api.chat_body({"model": "m", "input": "x", "tools": [
        {"type": "function", "name": "f", "parameters": params, "strict": True}]}, [])
    assert body["tools"][0]["function"]["strict"] is True
    body = anthropic_api.chat_body({"model": "m", "max_tokens": 4, "messages": USER, "tools": [
        {"name": "f", "input_schema": params, "strict": True}, {"name": "g", "input_schema": params}]})
    assert [t["function"]["strict"] for t in body["tools"]] == [True, None]


def test_strict_tools_option(tokenizer):
    """ServerConfig.strict_tools (CLI --no-strict-tools) decides whether tool_choice auto with strict
    tools gets a grammar; a non-strict tool among them never does."""
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}
    loose = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
    for on, tools, want in ((True, [tool], True), (False, [tool], False), (True, [tool, loose], False)):
        fake = FakeEngine(tokenizer, scripted_reply(tokenizer))
        seen = []
        submit_n = fake.submit_n
        fake.submit_n = lambda p, params, n, **kw: seen.append(kw.get("constraint")) or submit_n(p, params, n, **kw)
        app = build_app(fake, tokenizer, ServerConfig(model_names=("m",), strict_tools=on))
        with TestClient(app) as c:
            r = c.post("/v1/chat/completions", json={"model": "m", "messages": USER, "tools": tools, "max_tokens": 4})
        assert r.status_code == 200 and (seen[0] is not None) == want
