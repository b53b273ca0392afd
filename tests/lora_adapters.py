"""Random PEFT LoRA adapters for the tiny test checkpoints, and their merged references.

``peft_adapter`` has peft write an adapter (``init_lora_weights=False``: random A and B) and
saves ``merge_and_unload()`` of it beside; ``per_expert_adapter`` writes the per-expert module
format (``experts.{i}.<proj>``) by hand, merged into the base model for its reference.
"""

from __future__ import annotations

import json
import os

from checkpoints import building, load_reference


def peft_adapter(base: str, out: str, seed: int = 1, **lora) -> tuple:
    """(adapter dir, merged model dir) of a random LoRA adapter on ``base`` (built once, by one
    process of several: checkpoints.building)."""
    merged = out + "-merged"
    with building(out, merged, done="adapter_config.json") as temp:
        if temp is not None:
            import torch
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(seed)
            model = get_peft_model(load_reference(base), LoraConfig(init_lora_weights=False, **lora))
            with torch.no_grad():  # peft's random B is large: keep the deltas a perturbation
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.mul_(0.3)
            model.save_pretrained(temp[0])
            model.merge_and_unload().save_pretrained(temp[1])
    return out, merged


def per_expert_adapter(base: str, out: str, arch_names: tuple, seed: int = 1, r: int = 4, alpha: float = 8.0):
    """A hand-written adapter with per-expert modules ``experts.{e}.{gate,up,down}`` on every MoE
    layer (expert ranks alternate r and r // 2 through rank_pattern) and q_proj; returns
    (adapter dir, merged model dir)."""
    merged = out + "-merged"
    with building(out, merged, done="adapter_config.json") as temp:
        if temp is not None:
            _save_per_expert_adapter(base, temp[0], temp[1], arch_names, seed, r, alpha)
    return out, merged


def _save_per_expert_adapter(base: str, out: str, merged: str, arch_names: tuple, seed: int, r: int, alpha: float):
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    model = load_reference(base)
    cfg = model.config
    tensors, rank_pattern = {}, {}
    prefix = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"  # the checkpoint's (v4) key names
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn.q_proj
        _lora(tensors, f"model.layers.{i}.self_attn.q_proj", attn.weight, r, alpha / r, g)
        experts = getattr(layer.mlp, "experts", None)  # transformers 5 names the module mlp for every arch
        if experts is None:
            continue
        inter = experts.down_proj.shape[2]
        for e in range(experts.gate_up_proj.shape[0]):
            re_ = r if e % 2 == 0 else r // 2
            for j, name in enumerate(arch_names):
                key = f"model.layers.{i}.{prefix}.experts.{e}.{name}"
                if re_ != r:
                    rank_pattern[rf"layers\.{i}\.{prefix}\.experts\.{e}\.{name}"] = re_
                if j < 2:
                    w = experts.gate_up_proj.data[e, j * inter : (j + 1) * inter]
                else:
                    w = experts.down_proj.data[e]
                _lora(tensors, key, w, re_, alpha / re_, g)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    config = dict(peft_type="LORA", r=r, lora_alpha=alpha, rank_pattern=rank_pattern, target_modules=["q_proj"])
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    model.save_pretrained(merged)


def _lora(tensors: dict, key: str, w, r: int, scale: float, g) -> None:
    """Random factors for the weight ``w`` [out, in], merged into it in place."""
    import torch

    a = torch.randn(r, w.shape[1], generator=g) * 0.2
    b = torch.randn(w.shape[0], r, generator=g) * 0.2
    tensors[f"base_model.model.{key}.lora_A.weight"] = a.contiguous()
    tensors[f"base_model.model.{key}.lora_B.weight"] = b.contiguous()
    with torch.no_grad():
        w += scale * (b @ a)
