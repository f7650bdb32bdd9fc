"""Generated instruction items: deterministic, disjoint splits, responses pass their own checks, violations fail."""

from k3.sft import instruct


def test_items_are_deterministic_disjoint_and_self_consistent():
    train, held = instruct.instruct_items("train", 60), instruct.instruct_items("heldout", 60)
    assert train == instruct.instruct_items("train", 60)
    assert not {i["seed"] for i in train} & {i["seed"] for i in held}
    assert {i["kind"] for i in train} == set(instruct.GENERATORS)
    for it in train + held:
        assert instruct.check(it, it["response"]), it


def test_checks_reject_violations():
    items = {it["kind"]: it for it in instruct.instruct_items("train", 12)}
    b = items["bullets"]
    assert not instruct.check(b, "\n".join(["- x"] * (b["n"] + 1)))
    assert not instruct.check(b, "x\n" * b["n"])
    assert not instruct.check(items["json_keys"], '{"other": 1}')
    assert not instruct.check(items["json_keys"], "{not json")
    assert not instruct.check(items["lowercase"], "Capital here.")
    assert not instruct.check(items["uppercase"], "NOT all UPPER case")
    assert not instruct.check(items["end_with"], f"{items['end_with']['word']} is first, not last")
    w = items["word_twice"]["word"]
    assert not instruct.check(items["word_twice"], f"{w} {w} {w}")
    for bad in (None, "", "   ", 3, ["x"]):
        assert not any(instruct.check(it, bad) for it in items.values())
