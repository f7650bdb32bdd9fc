"""Embedded open-ended tasks without a verifier (scored by the judge, k3.rl.judged): short
explanations and lists whose quality a rubric can grade but no checker can. Each task carries a
reference answer (its length sets the effort budget).
"""

from __future__ import annotations

import random

from k3.rl.tasks.base import Task, split_seed

_TOPICS = ("a list", "a loop", "a function", "recursion", "a dictionary", "a variable", "an exception",
           "a class", "a module", "a string", "an integer", "a tuple", "a file", "a test", "a comment")
_FORMS = (
    ("Explain in one sentence what {t} is in Python.", "{T} in Python is a basic building block of programs."),
    ("Give one short example of when to use {t} in Python.", "Use {t} when the program needs it, for example in a script."),
    ("Name two facts about {t} in Python, one per line.", "- {T} is part of Python.\n- {T} is used often."),
)


def open_task(split: str, index: int) -> Task:
    rng = random.Random(split_seed(split, index) * 6151 + 3)
    topic = rng.choice(_TOPICS)
    question, ref = rng.choice(_FORMS)
    cap = topic[0].upper() + topic[1:]
    return Task(task_id=f"open-{split}-{index}", kind="open",
                messages=[{"role": "user", "content": question.format(t=topic)}],
                reference=ref.format(t=topic, T=cap), score=None, meta={"topic": topic})


def open_tasks(split: str, n: int) -> list[Task]:
    return [open_task(split, i) for i in range(n)]
