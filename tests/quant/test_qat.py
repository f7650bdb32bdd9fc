"""Quantisation-aware training: fake-quant forward, straight-through gradients, MXFP8 activations, the
QAT checkpoint's packed experts, and serving from packed weights (fp32, k3-tiny with 8 experts)."""

import pytest
import torch

from k3.config import ConfigError, apply_overrides, k3_tiny
from k3.model.causal_lm import K3ForCausalLM
from k3.model.moe import RoutedExperts, pack_routed_experts
from k3.quant.mxfp4 import decode_mxfp4, encode_mxfp4, quantize_dequantize_mxfp4
from k3.quant.mxfp8 import fake_quant_mxfp8, mxfp8_exponents, quantize_dequantize_mxfp8
from k3.quant.qat import QATConfig, apply_qat, qat_modules, remove_qat


def _cfg():
    return apply_overrides(k3_tiny(), {"text_config": {"num_experts": 8, "num_experts_per_token": 2}})


def _model(seed: int = 0) -> K3ForCausalLM:
    return K3ForCausalLM(_cfg()).init_weights(seed=seed).float()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous().view(torch.int32)


def _experts(m: K3ForCausalLM) -> list[tuple[str, RoutedExperts]]:
    return [(n, x) for n, x in m.named_modules() if isinstance(x, RoutedExperts)]


def _ids(n: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (2, n), generator=torch.Generator().manual_seed(seed))


def test_config_parse_and_errors():
    assert QATConfig.parse("mxfp4") == QATConfig(weights="mxfp4", activations=None)
    assert QATConfig.parse(" MXFP4 , mxfp8") == QATConfig(weights="mxfp4", activations="mxfp8")
    assert not QATConfig.parse("none").enabled and QATConfig.parse("mxfp4,mxfp8").spec() == "mxfp4,mxfp8"
    for bad in ("mxfp5", "mxfp4,mxfp4", "int8"):
        with pytest.raises(ConfigError, match="--qat"):
            QATConfig.parse(bad)
    with pytest.raises(ConfigError, match="high_precision"):
        QATConfig(high_precision=("router",)).validate()


def test_fake_quant_forward_is_dequant_quant_bit_exact():
    m = _model()
    assert apply_qat(m, QATConfig.parse("mxfp4")) == len(qat_modules(m)) > 0
    for _, ex in _experts(m):
        for w, used in zip((ex.w1, ex.w3, ex.w2), ex.weights()):
            assert not torch.equal(_bits(w), _bits(used))  # the masters stay off the grid
            assert torch.equal(_bits(used), _bits(decode_mxfp4(*encode_mxfp4(w), dtype=torch.float32)))
    remove_qat(m)
    assert all(a is b for _, ex in _experts(m) for a, b in zip(ex.weights(), (ex.w1, ex.w3, ex.w2)))


def _expert_grads(ex: RoutedExperts, z, idx, w) -> list[torch.Tensor]:
    ex.zero_grad(set_to_none=True)
    z = z.clone().requires_grad_(True)
    (ex(z, idx, w) ** 2).sum().backward()
    return [ex.w1.grad.clone(), ex.w3.grad.clone(), ex.w2.grad.clone(), z.grad.clone()]


def test_ste_gradients_equal_those_of_the_quantised_weights():
    """STE: the masters' gradient is the gradient w.r.t. the fake-quantised weights (and with MXFP8, the
    activations' rounding is identity for the input gradient)."""
    m = _model()
    ex = _experts(m)[0][1]
    g = torch.Generator().manual_seed(3)
    z = torch.randn(10, ex.w1.shape[2], generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(10)])
    w = torch.rand(10, 2, generator=g)
    for spec in ("mxfp4", "mxfp4,mxfp8"):
        cfg = QATConfig.parse(spec)
        apply_qat(m, cfg)
        got = _expert_grads(ex, z, idx, w)
        remove_qat(m)
        plain = RoutedExperts(_cfg().text_config)
        with torch.no_grad():
            for n in ("w1", "w3", "w2"):
                getattr(plain, n).copy_(quantize_dequantize_mxfp4(getattr(ex, n)))
        if cfg.activations:  # the reference sees the quantised activations as plain inputs, gradients pass
            plain.input_transform = lambda x: x + (quantize_dequantize_mxfp8(x) - x).detach()
        want = _expert_grads(plain, z, idx, w)
        for a, b in zip(got, want):
            assert torch.equal(a, b), spec


def test_mxfp8_values_and_scale_rule():
    x = torch.zeros(3, 32)
    x[0, :4] = torch.tensor([448.0, 1.0625, 1.1875, -3.0])  # k = 0: 1.0625 ties to 1.0, 1.1875 to 1.25
    x[1, :3] = torch.tensor([511.0, 256.0, 0.5])  # k = floor(log2 511) - 8 = 0: 511 saturates to 448
    # k = floor(log2(3 * 2^-20)) - 8 = -27; 2^-37 = 2^-10 * 2^k: half the smallest subnormal, ties to 0
    x[2, :3] = torch.tensor([3.0 * 2.0 ** -20, 2.0 ** -30, 2.0 ** -37])
    assert mxfp8_exponents(x).flatten().tolist() == [0, 0, -27]
    q = quantize_dequantize_mxfp8(x)
    assert q[0, :4].tolist() == [448.0, 1.0, 1.25, -3.0]
    assert q[1, :3].tolist() == [448.0, 256.0, 0.5]
    assert q[2, :3].tolist() == [3.0 * 2.0 ** -20, 2.0 ** -30, 0.0]
    assert (q[:, 4:] == 0).all()
    # every E4M3 value times a power of two is reproduced exactly; bf16 input gives the same values
    y = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 10
    once = quantize_dequantize_mxfp8(y)
    assert torch.equal(quantize_dequantize_mxfp8(once), once)
    assert torch.equal(quantize_dequantize_mxfp8(y.bfloat16()).float(), quantize_dequantize_mxfp8(y.bfloat16().float()))
    # half an ulp: 2^-4 relative for normals (3 mantissa bits), 2^-10 * 2^k for subnormals; above 448 * 2^k
    # the block's top values saturate
    s = torch.exp2(mxfp8_exponents(y).float()).repeat_interleave(32, dim=-1)
    sat = y.abs() > 448 * s
    assert ((once - y).abs() <= torch.maximum(y.abs() * 2 ** -4, s * 2 ** -10))[~sat].all()
    assert torch.equal(once[sat], 448 * s[sat] * y[sat].sign())
    yg = y.clone().requires_grad_(True)
    fake_quant_mxfp8(yg).sum().backward()
    assert torch.equal(yg.grad, torch.ones_like(y))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_dequantize_mxfp8(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="non-finite"):
        quantize_dequantize_mxfp8(torch.full((1, 32), float("nan")))


def test_mxfp8_hook_quantises_the_expert_gemm_inputs():
    """With activations='mxfp8' the expert output equals that of experts fed quantised z and a quantised
    GLU output; a model forward changes, weights untouched."""
    m = _model()
    ex = _experts(m)[0][1]
    seen = []
    apply_qat(m, QATConfig(weights=None, activations="mxfp8"))
    inner = ex.input_transform
    ex.input_transform = lambda t: seen.append(t.shape[-1]) or inner(t)
    with torch.no_grad():
        m(_ids())
    I, L = ex.w1.shape[1], ex.w1.shape[2]
    assert seen[:2] == [L, I]  # z before w1 / w3, the GLU output before w2


def test_qat_checkpoint_decodes_to_the_trained_weights(tmp_path):
    """A QAT model saves its experts packed (by default) and they decode to exactly the fake-quantised
    weights its forward used; the model served from the packed file gives the fake-quant logits."""
    m = _model(seed=1).eval()
    apply_qat(m, QATConfig.parse("mxfp4"))
    used = {n: [t.clone() for t in ex.weights()] for n, ex in _experts(m)}
    with torch.no_grad():
        logits = m(_ids()).logits
    m.save_pretrained(tmp_path / "ck", dtype="float32")
    from k3.model.safetensors_io import read_weight_map

    names = read_weight_map(str(tmp_path / "ck"))
    assert any(n.endswith("experts.0.w1.weight_packed") for n in names)
    assert not any(n.endswith("experts.0.w1.weight") for n in names)
    loaded = K3ForCausalLM.from_pretrained(tmp_path / "ck", dtype="float32").eval()
    for n, ex in _experts(loaded):
        for a, b in zip(ex.weights(), used[n]):
            assert torch.equal(_bits(a), _bits(b))
    assert pack_routed_experts(loaded) == len(used)
    for _, ex in _experts(loaded):
        assert ex.packed and ex.w1 is None
        assert "w13_packed" in dict(ex.named_buffers()) and "experts.w1" not in dict(loaded.named_parameters())
    with torch.no_grad():
        served = loaded(_ids()).logits
    assert torch.equal(served, logits)


def test_packed_storage_memory_and_ptq_rounding():
    """pack_mxfp4 on off-grid weights is post-training quantisation (the OCP rule): the packed model
    computes with quantize_dequantize(w); experts take 4.25 bits per weight; training it is refused."""
    m = _model(seed=2).eval()
    ex = _experts(m)[0][1]
    want = [quantize_dequantize_mxfp4(w.detach()) for w in (ex.w1, ex.w3, ex.w2)]
    n_weights = sum(w.numel() for w in (ex.w1, ex.w3, ex.w2))
    ex.pack_mxfp4()
    for a, b in zip(ex.weights(), want):
        assert torch.equal(_bits(a), _bits(b))
    nbytes = sum(b.numel() * b.element_size() for b in ex.buffers())
    assert nbytes * 8 / n_weights == 4.25
    with pytest.raises(ValueError, match="packed"):
        apply_qat(m, QATConfig.parse("mxfp4"))
    apply_qat(m, QATConfig(weights=None, activations="mxfp8"))  # serving with MXFP8 activations is fine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_packed_serving_matches_decoded_bf16():
    """bf16 on CUDA: the packed model (Triton MXFP4 GEMM) against the same weights decoded to bf16
    (torch._grouped_mm): equal up to bf16 summation order."""
    m = K3ForCausalLM(_cfg()).init_weights(seed=4).to(torch.bfloat16).cuda().eval()
    for _, ex in _experts(m):
        with torch.no_grad():
            for n in ("w1", "w3", "w2"):
                getattr(ex, n).copy_(quantize_dequantize_mxfp4(getattr(ex, n)))
    ids = _ids(64).cuda()
    with torch.no_grad():
        want = m(ids).logits.float()
        pack_routed_experts(m)
        got = m(ids).logits.float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
