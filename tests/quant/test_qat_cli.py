"""`k3 quantize` (post-training MXFP4 of a checkpoint) and `k3 train --qat` flag parsing."""

import argparse

import pytest
import torch

from k3.cli import main
from k3.cli.train import build_config
from k3.config import ConfigError, apply_overrides, k3_tiny
from k3.model.causal_lm import K3ForCausalLM
from k3.model.moe import RoutedExperts
from k3.model.safetensors_io import read_weight_map
from k3.quant.mxfp4 import quantize_dequantize_mxfp4


def _experts(m):
    return [(n, x) for n, x in m.named_modules() if isinstance(x, RoutedExperts)]


def test_quantize_writes_packed_experts_equal_to_ptq(tmp_path, capsys):
    cfg = apply_overrides(k3_tiny(), {"text_config": {"num_experts": 8, "num_experts_per_token": 2}})
    src, out = tmp_path / "bf16", tmp_path / "mxfp4"
    K3ForCausalLM(cfg).init_weights(seed=0).save_pretrained(src)
    (src / "tiktoken.model").write_text("tokenizer stand-in\n")
    assert main(["quantize", "--checkpoint", str(src), "--out", str(out), "--format", "mxfp4"]) == 0
    assert "routed experts mxfp4" in capsys.readouterr().out
    names = read_weight_map(str(out))
    assert any(n.endswith(".weight_packed") for n in names) and not any(n.endswith(".experts.0.w1.weight") for n in names)
    assert (out / "tiktoken.model").read_text() == "tokenizer stand-in\n"
    a = K3ForCausalLM.from_pretrained(src, dtype="float32")
    b = K3ForCausalLM.from_pretrained(out, dtype="float32")
    for (_, ea), (_, eb) in zip(_experts(a), _experts(b)):
        for wa, wb in zip((ea.w1, ea.w3, ea.w2), (eb.w1, eb.w3, eb.w2)):
            assert torch.equal(quantize_dequantize_mxfp4(wa.detach()), wb.detach())
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa if ".experts." not in k)  # the rest copied as is
    # back to bf16 experts: the MXFP4 values exactly (bf16 holds them)
    assert main(["quantize", "--checkpoint", str(out), "--out", str(tmp_path / "back"), "--format", "bf16"]) == 0
    c = K3ForCausalLM.from_pretrained(tmp_path / "back", dtype="float32")
    assert all(torch.equal(x, y) for x, y in zip(b.state_dict().values(), c.state_dict().values()))


def test_quantize_errors(tmp_path, capsys):
    assert main(["quantize", "--checkpoint", str(tmp_path)]) == 2
    assert "nothing to do" in capsys.readouterr().err
    assert main(["quantize", "--checkpoint", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "error" in capsys.readouterr().err


def _train_args(**kw):
    base = dict(resume=False, config=None, preset=None, data=None, out=None, max_steps=None, seed=None,
                device=None, micro_batch_tokens=None, deterministic=False, compile=False,
                activation_checkpointing=False, qat=None)
    return argparse.Namespace(**(base | kw))


def test_train_qat_flag():
    assert build_config(_train_args(qat="mxfp4,mxfp8")).qat == "mxfp4,mxfp8"
    assert build_config(_train_args()).qat is None
    with pytest.raises(ConfigError, match="--qat"):
        build_config(_train_args(qat="fp4"))
