"""Per-Head Muon: orthogonality, block independence, torch.optim.Muon agreement, AdamW part, state."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from k3.optim.muon import BlockSpec, PerHeadMuon, merge_blocks, newton_schulz, split_blocks

LR, WD = 0.02, 0.1
# fp32 Newton-Schulz vs torch.optim.Muon's bf16 Newton-Schulz: relative Frobenius difference of
# the update. Measured ~0.02-0.035 over 4 steps; bf16 rounding of 5 quintic steps dominates.
FP32_VS_BF16_REL = 6e-2
# Quintic NS with the bf16-tuned coefficients leaves singular values in ~[0.68, 1.14] for
# well-conditioned (rectangular) blocks after 5 steps, by design.
SV_LO, SV_HI = 0.6, 1.25


def _param(*shape: int, seed: int = 0) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.1)


def _muon(params, specs, ns_dtype="float32", wd=0.0, **kw) -> PerHeadMuon:
    group = dict(kind="muon", params=params, block_specs=specs)
    return PerHeadMuon([group], lr=LR, weight_decay=wd, ns_dtype=ns_dtype, **kw)


def _update(opt: PerHeadMuon, params, grads) -> list[torch.Tensor]:
    """Apply one step with the given grads; return each parameter's change."""
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    return [p.detach() - b for p, b in zip(params, before)]


def _orthogonal_part(delta: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Undo the lr * 0.2*sqrt(max(m, n)) scaling of a Muon update (weight decay off)."""
    return -delta / (LR * 0.2 * math.sqrt(max(m, n)))


@pytest.mark.parametrize("spec,shape,block_shape", [
    (BlockSpec.whole(), (24, 40), (24, 40)),
    (BlockSpec.rows(8), (32, 40), (8, 40)),
    (BlockSpec.cols(8), (40, 24), (40, 8)),
    (BlockSpec.experts(), (3, 12, 28), (12, 28)),
])
def test_split_merge_roundtrip(spec, shape, block_shape):
    x = torch.randn(*shape)
    blocks = split_blocks(x, spec)
    assert tuple(blocks.shape[1:]) == block_shape
    torch.testing.assert_close(merge_blocks(blocks.clone(), spec, x.shape), x, rtol=0, atol=0)


def test_newton_schulz_batched_equals_single_and_is_orthogonal():
    x = torch.randn(5, 16, 48)
    batched = newton_schulz(x)
    for i in range(5):
        torch.testing.assert_close(batched[i : i + 1], newton_schulz(x[i : i + 1]), rtol=1e-5, atol=1e-6)
    sv = torch.linalg.svdvals(batched)
    assert SV_LO < sv.min() and sv.max() < SV_HI
    tall = newton_schulz(x.transpose(1, 2))  # tall blocks are handled transposed
    torch.testing.assert_close(tall, batched.transpose(1, 2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["rows", "cols"])
def test_head_updates_are_orthogonal(kind):
    heads, hd, d = 4, 8, 40
    shape, spec = ((heads * hd, d), BlockSpec.rows(hd)) if kind == "rows" else ((d, heads * hd), BlockSpec.cols(hd))
    p = _param(*shape)
    opt = _muon([p], [spec])
    grad = torch.randn(*shape)
    delta = _update(opt, [p], [grad])[0]
    blocks = split_blocks(delta, spec)
    for blk in blocks:
        o = _orthogonal_part(blk, *blk.shape)
        sv = torch.linalg.svdvals(o)
        assert SV_LO < sv.min() and sv.max() < SV_HI, sv
        # Close to the exact polar factor U V^T of the head's (first-step) momentum.
    g_blocks = split_blocks(grad, spec)
    for blk, g in zip(blocks, g_blocks):
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        o = _orthogonal_part(blk, *blk.shape)
        cos = (o * (u @ vh)).sum() / (o.norm() * (u @ vh).norm())
        assert cos > 0.95


@pytest.mark.parametrize("kind", ["rows", "cols", "experts"])
def test_blocks_are_independent(kind):
    """Changing one head's (expert's) gradient leaves every other block's update unchanged."""
    nb, m, n = 4, 8, 24
    if kind == "rows":
        shape, spec = (nb * m, n), BlockSpec.rows(m)
    elif kind == "cols":
        shape, spec = (n, nb * m), BlockSpec.cols(m)
    else:
        shape, spec = (nb, m, n), BlockSpec.experts()
    grads = [torch.randn(*shape) for _ in range(3)]
    runs = []
    for perturb in (False, True):
        p = _param(*shape)
        opt = _muon([p], [spec], wd=WD)
        deltas = []
        for step, g in enumerate(grads):
            g = g.clone()
            if perturb:
                gb = split_blocks(g, spec)  # a view: edits land in g
                gb[1] *= 10.0
                if step == 2:
                    gb[1] = torch.randn_like(gb[1])
            deltas.append(split_blocks(_update(opt, [p], [g])[0], spec))
        runs.append(deltas)
    for base, pert in zip(*runs):
        keep = [0, 2, 3]
        torch.testing.assert_close(pert[keep], base[keep], rtol=0, atol=1e-7)
    assert not torch.allclose(runs[0][2][1], runs[1][2][1], atol=1e-4)  # the edited block did move


def test_whole_matrix_couples_heads():
    """Control: with one whole-matrix block, rescaling one head's rows changes the others."""
    p1, p2 = _param(32, 24), _param(32, 24)
    g = torch.randn(32, 24)
    g2 = g.clone()
    g2[8:16] *= 10.0
    d1 = _update(_muon([p1], [BlockSpec.whole()]), [p1], [g])[0]
    d2 = _update(_muon([p2], [BlockSpec.whole()]), [p2], [g2])[0]
    assert (d1[:8] - d2[:8]).abs().max() > 1e-3


@pytest.mark.parametrize("spec", [BlockSpec.rows(16), BlockSpec.whole()])
def test_matches_torch_muon_on_one_head(spec):
    w0 = torch.randn(16, 48) * 0.1
    grads = [torch.randn(16, 48) for _ in range(4)]
    ours_bf16 = torch.nn.Parameter(w0.clone())
    ours_fp32 = torch.nn.Parameter(w0.clone())
    ref = torch.nn.Parameter(w0.clone())
    opt_bf16 = _muon([ours_bf16], [spec], ns_dtype="bfloat16", wd=WD)
    opt_fp32 = _muon([ours_fp32], [spec], ns_dtype="float32", wd=WD)
    opt_ref = torch.optim.Muon([ref], lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw")
    for g in grads:
        d_ref = _update(opt_ref, [ref], [g])[0]
        d_bf16 = _update(opt_bf16, [ours_bf16], [g])[0]
        d_fp32 = _update(opt_fp32, [ours_fp32], [g])[0]
        # Same algebra and the same bf16 Newton-Schulz: equal up to fp32 rounding.
        torch.testing.assert_close(d_bf16, d_ref, rtol=1e-5, atol=1e-7)
        assert (d_fp32 - d_ref).norm() / d_ref.norm() < FP32_VS_BF16_REL
    torch.testing.assert_close(ours_bf16.detach(), ref.detach(), rtol=1e-5, atol=1e-7)


def test_batched_across_parameters_equals_separate_optimizers():
    """Blocks of equal shape from different params/groups share one NS call without cross-talk."""
    shapes_specs = [((32, 24), BlockSpec.rows(8)), ((24, 16), BlockSpec.cols(8)), ((2, 8, 24), BlockSpec.experts()),
                    ((8, 24), BlockSpec.whole())]
    grads = [torch.randn(*s) for s, _ in shapes_specs]
    joint = [_param(*s, seed=i) for i, (s, _) in enumerate(shapes_specs)]
    groups = [dict(kind="muon", params=joint[:2], block_specs=[sp for _, sp in shapes_specs[:2]]),
              dict(kind="muon", params=joint[2:], block_specs=[sp for _, sp in shapes_specs[2:]], lr=LR / 2)]
    opt = PerHeadMuon(groups, lr=LR, weight_decay=WD, ns_dtype="float32")
    joint_deltas = _update(opt, joint, grads)
    for i, ((shape, spec), g) in enumerate(zip(shapes_specs, grads)):
        p = _param(*shape, seed=i)
        alone = PerHeadMuon([dict(kind="muon", params=[p], block_specs=[spec])],
                            lr=LR if i < 2 else LR / 2, weight_decay=WD, ns_dtype="float32")
        torch.testing.assert_close(joint_deltas[i], _update(alone, [p], [g])[0], rtol=1e-5, atol=1e-7)


def test_update_rms_matches_adamw_scale():
    """0.2*sqrt(max(m, n)) * NS output has RMS ~0.2 (NS output RMS ~ 1/sqrt(max(m, n)))."""
    p = _param(64, 256)
    delta = _update(_muon([p], [BlockSpec.rows(16)]), [p], [torch.randn(64, 256)])[0]
    rms = (delta / LR).pow(2).mean().sqrt()
    assert 0.15 < rms < 0.25


def test_adamw_part_matches_torch_adamw():
    w0 = torch.randn(10, 6)
    ours, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt = PerHeadMuon([dict(kind="adamw", params=[ours])], lr=1e-2, weight_decay=WD, betas=(0.9, 0.95), adam_eps=1e-8)
    opt_ref = torch.optim.AdamW([ref], lr=1e-2, weight_decay=WD, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(5):
        g = torch.randn(10, 6)
        _update(opt, [ours], [g])
        _update(opt_ref, [ref], [g])
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-5, atol=1e-6)


def test_bf16_params_keep_fp32_state():
    p = torch.nn.Parameter(torch.randn(16, 32).bfloat16())
    q = torch.nn.Parameter(torch.randn(32).bfloat16())
    opt = PerHeadMuon([dict(kind="muon", params=[p], block_specs=[BlockSpec.rows(8)]),
                       dict(kind="adamw", params=[q])], lr=LR, ns_dtype="float32")
    _update(opt, [p, q], [torch.randn(16, 32).bfloat16(), torch.randn(32).bfloat16()])
    opt2 = PerHeadMuon([dict(kind="muon", params=[p], block_specs=[BlockSpec.rows(8)]),
                        dict(kind="adamw", params=[q])], lr=LR, ns_dtype="float32")
    opt2.load_state_dict(opt.state_dict())
    assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    # Loaded state is the exact fp32 state, not rounded through the bf16 parameter dtype.
    torch.testing.assert_close(opt2.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"], rtol=0, atol=0)
    torch.testing.assert_close(opt2.state[q]["exp_avg_sq"], opt.state[q]["exp_avg_sq"], rtol=0, atol=0)
    assert opt2.state[p]["momentum_buffer"] is not opt.state[p]["momentum_buffer"]
    assert p.dtype == torch.bfloat16


def _tiny_setup(seed: int):
    torch.manual_seed(seed)
    params = [_param(32, 24, seed=1), _param(24, 16, seed=2), _param(2, 8, 24, seed=3), _param(24, seed=4)]
    groups = [dict(kind="muon", params=params[:3], block_specs=[BlockSpec.rows(8), BlockSpec.cols(4), BlockSpec.experts()]),
              dict(kind="adamw", params=params[3:], weight_decay=0.0, lr=3e-3)]
    return params, PerHeadMuon(groups, lr=LR, weight_decay=WD, ns_dtype="float32")


def test_state_dict_roundtrip_continues_identically():
    grads = [[torch.randn(32, 24), torch.randn(24, 16), torch.randn(2, 8, 24), torch.randn(24)] for _ in range(4)]
    params, opt = _tiny_setup(0)
    for g in grads[:2]:
        _update(opt, params, g)
    saved_params = [p.detach().clone() for p in params]
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    blob.seek(0)
    loaded = torch.load(blob, weights_only=True)
    for g in grads[2:]:
        _update(opt, params, g)
    params2, opt2 = _tiny_setup(1)
    with torch.no_grad():
        for p2, s in zip(params2, saved_params):
            p2.copy_(s)
    opt2.load_state_dict(loaded)
    assert opt2.param_groups[0]["block_specs"] == [("rows", 8), ("cols", 4), ("experts", 0)]
    for g in grads[2:]:
        _update(opt2, params2, g)
    for p, p2 in zip(params, params2):
        torch.testing.assert_close(p2.detach(), p.detach(), rtol=0, atol=0)
    assert copy.deepcopy(opt2.state_dict())["param_groups"][1]["lr"] == 3e-3


def test_params_without_grad_are_skipped():
    p, q = _param(16, 8), _param(16, 8, seed=1)
    opt = _muon([p, q], [BlockSpec.whole(), BlockSpec.whole()])
    q0 = q.detach().clone()
    p.grad = torch.randn(16, 8)
    opt.step()
    torch.testing.assert_close(q.detach(), q0, rtol=0, atol=0)
    assert q not in opt.state


@pytest.mark.parametrize("group,match", [
    (dict(kind="sgd"), "kind"),
    (dict(kind="muon", block_specs=[("rows", 5)]), "block size 5"),
    (dict(kind="muon", block_specs=[("experts", 0)]), "experts"),
    (dict(kind="muon", block_specs=[("diag", 0)]), "block spec"),
    (dict(kind="muon", block_specs=[("whole", 0), ("whole", 0)]), "block_specs"),
])
def test_bad_groups_raise(group, match):
    with pytest.raises(ValueError, match=match):
        PerHeadMuon([dict(group, params=[_param(16, 8)])])


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="ns_dtype"):
        PerHeadMuon([dict(kind="adamw", params=[_param(4)])], ns_dtype="fp8")
    with pytest.raises(ValueError, match="momentum"):
        PerHeadMuon([dict(kind="adamw", params=[_param(4)])], momentum=1.0)
    with pytest.raises(ValueError, match="x:"):
        newton_schulz(torch.randn(4, 4))
