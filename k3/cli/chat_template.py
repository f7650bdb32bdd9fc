"""`k3 chat-template FILE.json [--ids] [--tokenizer DIR]`: render a conversation file.

FILE.json is either a list of messages or an object with `messages` and optional `tools`,
`thinking`, `thinking_effort` (or `reasoning_effort`), `add_generation_prompt`, `tool_choice`,
`response_format`, `image_prompts` (an OpenAI-style request body works). Command-line flags
override the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

_RENDER_KEYS = ("thinking", "thinking_effort", "add_generation_prompt", "tool_choice", "response_format", "image_prompts")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("chat-template", help="render a conversation in K3's XTML chat format")
    p.add_argument("file", help="conversation JSON: a message list or {messages, tools, ...}")
    p.add_argument("--ids", action="store_true", help="print token ids and the assistant loss mask (needs --tokenizer)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (tiktoken.model or tokenizer.json)")
    p.add_argument("--no-thinking", dest="thinking", action="store_false", default=None, help="non-thinking mode")
    p.add_argument("--effort", help="thinking effort: low, medium, high, max or none")
    p.add_argument("--generation-prompt", dest="add_generation_prompt", action="store_true", default=None,
                   help="append the assistant generation prompt")
    p.set_defaults(func=run)


def _load(path: str) -> tuple[list, Any, dict]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, list):
        return data, None, {}
    if not isinstance(data, dict) or "messages" not in data:
        raise ValueError(f"{path}: expected a list of messages or an object with 'messages'")
    kwargs = {k: data[k] for k in _RENDER_KEYS if k in data}
    if "thinking_effort" not in kwargs and "reasoning_effort" in data:
        kwargs["thinking_effort"] = data["reasoning_effort"]
    if isinstance(data.get("kwargs"), dict):  # golden files keep their options under "kwargs"
        kwargs.update(data["kwargs"])
    return data["messages"], data.get("tools"), kwargs


def run(args: argparse.Namespace) -> int:
    from k3.chat import ChatFormatError, render, render_text

    try:
        messages, tools, kwargs = _load(args.file)
    except (OSError, ValueError) as e:
        print(f"k3 chat-template: cannot read {args.file}: {e}", file=sys.stderr)
        return 2
    if args.thinking is not None:
        kwargs["thinking"] = args.thinking
    if args.effort is not None:
        kwargs["thinking_effort"] = None if args.effort.lower() == "none" else args.effort
    if args.add_generation_prompt is not None:
        kwargs["add_generation_prompt"] = True
    try:
        if not args.ids:
            sys.stdout.write(render_text(messages, tools, **kwargs))
            sys.stdout.write("\n")
            return 0
        if not args.tokenizer:
            print("k3 chat-template: --ids needs --tokenizer DIR", file=sys.stderr)
            return 2
        from k3.data.tokenizer import load_tokenizer

        ids, mask = render(messages, load_tokenizer(args.tokenizer), tools, **kwargs)
    except ChatFormatError as e:
        print(f"k3 chat-template: invalid conversation: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"k3 chat-template: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"input_ids": ids, "loss_mask": mask}))
    return 0
