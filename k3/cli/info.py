"""`k3 info`: layer layout and total / active parameter counts, computed on the meta device."""

from __future__ import annotations

import argparse
import json

import torch


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="layer layout and parameter counts (allocates nothing)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, help="a preset name (default k3-tiny)")
    src.add_argument("--checkpoint", default=None, help="a checkpoint directory (reads its config.json)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def describe(config) -> dict:
    from k3.model.causal_lm import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(config)
    total, active = model.num_parameters()
    tc = config.text_config
    layers = []
    for i in range(tc.num_hidden_layers):
        layers.append({
            "index": i,
            "mixer": "MLA" if tc.is_mla(i) else "KDA",
            "ffn": "LatentMoE" if tc.is_moe(i) else "dense",
            "attn_res_block_start": i % tc.attn_res_block_size == 0,
        })
    vision = None
    if model.vision is not None:
        vc = model.vision.cfg
        vision = {
            "params": model.num_vision_parameters(),
            "tower_params": sum(p.numel() for p in model.vision.vision_tower.parameters()),
            "projector_params": sum(p.numel() for p in model.vision.mm_projector.parameters()),
            "layers": vc.num_hidden_layers, "hidden_size": vc.hidden_size, "patch_size": vc.patch_size,
            "merge_kernel_size": list(vc.merge_kernel_size), "media_placeholder_token_id": config.media_placeholder_token_id,
        }
    from k3.train.flops import BYTES_PER_PARAM, flops_per_token

    return {
        "total_params": total,
        "active_params": active,
        # the spec's k3 MFU convention (training = 3 x forward; MLA at the causal average of an 8K context)
        "train_flops_per_token_8k": flops_per_token(tc, active, 8192),
        "train_state_bytes": total * BYTES_PER_PARAM,  # fp32 weights, gradients, optimizer states
        "vision": vision,
        "num_layers": tc.num_hidden_layers,
        "num_kda_layers": sum(l["mixer"] == "KDA" for l in layers),
        "num_mla_layers": sum(l["mixer"] == "MLA" for l in layers),
        "hidden_size": tc.hidden_size,
        "vocab_size": tc.vocab_size,
        "experts": f"{tc.num_experts} routed (top-{tc.num_experts_per_token}) + {tc.num_shared_experts} shared",
        "layers": layers,
    }


def run(args: argparse.Namespace) -> int:
    from k3.config import K3Config, get_preset

    config = K3Config.load(args.checkpoint) if args.checkpoint else get_preset(args.preset or "k3-tiny")
    info = describe(config)
    if args.json:
        print(json.dumps(info))
        return 0
    name = args.checkpoint or args.preset or "k3-tiny"
    print(f"{name}: {info['num_layers']} layers ({info['num_kda_layers']} KDA + {info['num_mla_layers']} MLA), "
          f"hidden {info['hidden_size']}, vocab {info['vocab_size']}, experts {info['experts']}")
    print(f"total parameters  {info['total_params']:>18,} ({info['total_params'] / 1e9:.2f} B)")
    print(f"active per token  {info['active_params']:>18,} ({info['active_params'] / 1e9:.2f} B)")
    print(f"training FLOPs    {info['train_flops_per_token_8k'] / 1e9:>18,.3f} G per token at 8K context")
    print(f"training state    {info['train_state_bytes'] / 2**30:>18,.1f} GiB (fp32 weights, gradients, "
          f"optimizer states; shard it over GPUs with torchrun)")
    v = info["vision"]
    if v is not None:
        print(f"vision (in total) {v['params']:>18,} ({v['params'] / 1e6:.2f} M): tower {v['tower_params']:,} "
              f"({v['layers']} layers, hidden {v['hidden_size']}, patch {v['patch_size']}, merge "
              f"{v['merge_kernel_size'][0]}x{v['merge_kernel_size'][1]}) + projector {v['projector_params']:,}; "
              f"media pad id {v['media_placeholder_token_id']}")
    print("layout (| = AttnRes block start):")
    row = []
    for l in info["layers"]:
        mark = "|" if l["attn_res_block_start"] else " "
        row.append(f"{mark}{l['index']}:{l['mixer']}{'' if l['ffn'] == 'LatentMoE' else '+dense'}")
    for i in range(0, len(row), 12):
        print("  " + " ".join(row[i:i + 12]))
    return 0
