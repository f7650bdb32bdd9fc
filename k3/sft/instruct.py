"""Generated instruction-following items: a request with a format constraint that code can check, a short
reasoning, and a response that satisfies it. Deterministic from the seed (no data files).

Item k of split s is `instruct_item(seed)` with seed = k (train) or HELDOUT_OFFSET + k (held-out): the two
splits never share a seed. `check(item, text)` scores any response (the model's included) against the
item's constraint; it never raises.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Callable

from k3.sft import effort
from k3.sft.data import conversation

HELDOUT_OFFSET = 1_000_000

TOPICS = ["rivers", "bread", "bicycles", "owls", "glaciers", "tea", "chess", "volcanoes", "bees", "lighthouses",
          "maps", "violins", "cactus plants", "trains", "comets", "honey", "forests", "kites", "pianos", "deserts",
          "whales", "clocks", "gardens", "bridges", "candles", "islands", "rainbows", "wolves", "tulips", "rockets"]
ADJECTIVES = ["quiet", "old", "bright", "useful", "strong", "small", "calm", "warm", "simple", "rare", "green",
              "fast", "gentle", "curious", "famous", "tiny", "deep", "clever"]
WORDS = ["sun", "stone", "river", "light", "paper", "green", "music", "window", "garden", "cloud", "silver",
         "morning", "story", "ocean", "friend", "summer"]
KEYS = ["name", "color", "size", "place", "age", "kind", "price", "score", "title", "city"]


def _sentence(rng: random.Random, topic: str) -> str:
    return f"{topic.capitalize()} are {rng.choice(ADJECTIVES)} and {rng.choice(ADJECTIVES)}."


def _bullets(rng: random.Random, topic: str) -> dict:
    n = rng.randint(2, 5)
    lines = [f"- {topic.capitalize()} are {a}." for a in rng.sample(ADJECTIVES, n)]
    return {"kind": "bullets", "n": n,
            "prompt": f"Tell me about {topic}. Answer in exactly {n} bullet points.",
            "reasoning": f"The user wants exactly {n} bullet points about {topic}.",
            "check": f"{n} lines, each starting with \"- \".",
            "response": "\n".join(lines)}


def _json_keys(rng: random.Random, topic: str) -> dict:
    keys = rng.sample(KEYS, rng.randint(2, 3))
    obj = {k: (rng.randint(1, 99) if k in ("age", "price", "score", "size") else rng.choice(WORDS)) for k in keys}
    return {"kind": "json_keys", "keys": keys,
            "prompt": f"Describe {topic} as JSON with the keys {', '.join(keys)}. Respond with JSON only.",
            "reasoning": f"A JSON object with exactly the keys {', '.join(keys)}.",
            "check": f"the object has the keys {', '.join(keys)} and no other; no text around it.",
            "response": json.dumps(obj)}


def _lowercase(rng: random.Random, topic: str) -> dict:
    return {"kind": "lowercase",
            "prompt": f"Write one sentence about {topic}. Use only lowercase letters.",
            "reasoning": "One sentence, all in lowercase.",
            "check": "no capital letter anywhere, not even the first.",
            "response": _sentence(rng, topic).lower()}


def _uppercase(rng: random.Random, topic: str) -> dict:
    return {"kind": "uppercase",
            "prompt": f"Write one sentence about {topic} in capital letters only.",
            "reasoning": "One sentence, all in capital letters.",
            "check": "every letter is a capital.",
            "response": _sentence(rng, topic).upper()}


def _end_with(rng: random.Random, topic: str) -> dict:
    word = rng.choice(WORDS)
    return {"kind": "end_with", "word": word,
            "prompt": f"Write a short sentence about {topic}. End your answer with the word \"{word}\".",
            "reasoning": f"The last word must be {word}.",
            "check": f"the answer ends with {word}, no word after it.",
            "response": f"{topic.capitalize()} are {rng.choice(ADJECTIVES)} like the {word}"}


def _word_twice(rng: random.Random, topic: str) -> dict:
    word = rng.choice(WORDS)
    return {"kind": "word_twice", "word": word,
            "prompt": f"Write about {topic} and use the word \"{word}\" exactly twice.",
            "reasoning": f"Use {word} two times, no more.",
            "check": f"count {word}: exactly 2.",
            "response": f"{topic.capitalize()} love the {word}. The {word} is {rng.choice(ADJECTIVES)}."}


GENERATORS: dict[str, Callable[[random.Random, str], dict]] = {
    "bullets": _bullets, "json_keys": _json_keys, "lowercase": _lowercase, "uppercase": _uppercase,
    "end_with": _end_with, "word_twice": _word_twice,
}


def instruct_item(seed: int) -> dict:
    """Item `seed`: {"kind", "prompt", "reasoning", "check", "response", constraint fields...}."""
    rng = random.Random(seed)
    kind = sorted(GENERATORS)[seed % len(GENERATORS)]
    return GENERATORS[kind](rng, rng.choice(TOPICS)) | {"seed": seed}


def instruct_items(split: str, n: int) -> list[dict]:
    """n items of split "train" or "heldout" (disjoint seeds)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    base = 0 if split == "train" else HELDOUT_OFFSET
    return [instruct_item(base + k) for k in range(n)]


def item_conversation(item: dict, thinking_effort: str | None = None) -> dict:
    """The item as an SFT conversation: user request -> assistant reasoning + response. With a
    `thinking_effort` the conversation carries it and the reasoning's length follows it (k3.sft.effort);
    without one the reasoning is the item's line and the conversation renders at the run's effort."""
    reasoning = item["reasoning"] if thinking_effort is None else \
        effort.expand_instruction(item["prompt"], item["reasoning"], item["check"], thinking_effort)
    return conversation([{"role": "user", "content": item["prompt"]},
                         {"role": "assistant", "reasoning_content": reasoning, "content": item["response"]}],
                        thinking_effort=thinking_effort, source=f"<instruct {item['seed']}>", kind=item["kind"])


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text)


def check(item: dict, text: Any) -> bool:
    """Does `text` satisfy the item's constraint? Never raises (model output may be anything)."""
    if not isinstance(text, str) or not text.strip():
        return False
    t = text.strip()
    kind = item["kind"]
    if kind == "bullets":
        lines = [ln for ln in t.splitlines() if ln.strip()]
        return len(lines) == item["n"] and all(ln.startswith("- ") and ln[2:].strip() for ln in lines)
    if kind == "json_keys":
        try:
            obj = json.loads(t)
        except (json.JSONDecodeError, RecursionError):
            return False
        return isinstance(obj, dict) and sorted(obj) == sorted(item["keys"])
    if kind == "lowercase":
        return t == t.lower() and bool(_words(t))
    if kind == "uppercase":
        return t == t.upper() and bool(_words(t))
    if kind == "end_with":
        words = _words(t)
        return bool(words) and words[-1].lower() == item["word"].lower()
    if kind == "word_twice":
        return [w.lower() for w in _words(t)].count(item["word"].lower()) == 2
    return False
