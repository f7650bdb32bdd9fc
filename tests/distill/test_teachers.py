import copy
import math

import pytest
import torch

from k3.distill.losses import opd_loss
from k3.distill.teachers import ModelTeacher, RemoteTeacher, Router, domain_of, parse_teacher
from k3.rl.losses import PGConfig
from k3.rl.tasks import build_tasks

from tests.rl.conftest import tiny_model


def test_parse_teacher_and_errors():
    s = parse_teacher("math:low=runs/t/final@2.5")
    assert (s.domain, s.effort, s.path, s.weight, s.name) == ("math", "low", "runs/t/final", 2.5, "math:low")
    assert parse_teacher("worlds:max=http://h:8000/v1#m").path == "http://h:8000/v1#m"
    for bad in ("math=dir", "chess:low=dir", "math:medium=dir", "math:low=", "math:low=dir@0"):
        with pytest.raises(ValueError):
            parse_teacher(bad)


def test_routing_is_exact():
    r = Router({("math", "low"): "A", ("math", "max"): "B", ("worlds", "low"): "C"})
    assert r.route("math", "low") == "A" and r.route("math", "max") == "B" and r.route("worlds", "low") == "C"
    for d, e in (("math", "high"), ("worlds", "max"), ("code", "low")):
        with pytest.raises(KeyError, match=f"{d}:{e}"):
            r.route(d, e)
    with pytest.raises(ValueError):
        Router({})
    math_t, world_t = build_tasks(("math", "worlds"), "train", 1)
    assert domain_of(math_t) == "math" and domain_of(world_t) == "worlds"
    with pytest.raises(ValueError):
        domain_of(object())


def test_student_equal_to_teacher_has_zero_loss_and_gradient(tokenizer):
    student = tiny_model(tokenizer, seed=3).train()
    teacher = ModelTeacher("math:low", copy.deepcopy(student))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tokenizer.vocab_size - 256, (1, 24), generator=g)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    mask = torch.ones(1, 24, dtype=torch.bool)
    mask[0, [0, 10]] = False
    seq = torch.tensor([[0] * 10 + [1] * 14])
    t_lp = teacher.score(ids, cu)
    lp = student.token_logprobs(ids, cu_seqlens=cu)
    assert torch.equal(t_lp, lp.detach())
    loss, m = opd_loss(lp, t_lp, lp.detach(), mask, torch.zeros_like(ids), seq, PGConfig())
    loss.backward()
    assert float(loss.detach()) == 0.0 and m["reverse_kl"] == 0.0
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in student.parameters())
    # a different teacher gives a non-zero loss and gradient
    other = ModelTeacher("math:max", tiny_model(tokenizer, seed=4))
    student.zero_grad()
    lp = student.token_logprobs(ids, cu_seqlens=cu)
    loss, m = opd_loss(lp, other.score(ids, cu), lp.detach(), mask, torch.zeros_like(ids), seq, PGConfig())
    loss.backward()
    assert m["reverse_kl"] != 0.0 and any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.parameters())


def test_remote_teacher_topk_and_approximation():
    v = 10
    table = [{}, {3: math.log(0.5), 4: math.log(0.3)}, {3: math.log(0.9)}, {1: math.log(0.2)}]
    t = RemoteTeacher("math:low", lambda ids: table[: len(ids)], vocab_size=v)
    out = t.score(torch.tensor([[7, 3, 5, 1]]), torch.tensor([0, 4], dtype=torch.int32))
    assert out[0, 0] == 0.0
    assert out[0, 1].item() == pytest.approx(math.log(0.5))
    assert out[0, 2].item() == pytest.approx(math.log(0.1 / 9))      # absent: remaining mass over V - k
    assert out[0, 3].item() == pytest.approx(math.log(0.2))
    assert t.stats == {"tokens": 3, "approximated": 1}
    bad = RemoteTeacher("x", lambda ids: [{}], vocab_size=v)
    with pytest.raises(ValueError, match="entries"):
        bad.score(torch.tensor([[1, 2]]), torch.tensor([0, 2], dtype=torch.int32))
