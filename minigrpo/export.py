"""Exporting a trained policy as plain 16-bit weights: a merged standalone model (`minigrpo export`), or the
base alone for the vLLM engine to load (its adapter is written into it in place afterwards). Streamed one
decoder layer per shard, so the export never holds a second copy of the model in memory."""

from __future__ import annotations

from pathlib import Path

import torch


def export_weights(model, tokenizer, folder: Path, dtype: torch.dtype, merge_adapter: bool) -> None:
    """The policy as a plain transformers folder: the base (4-bit layers dequantized) in `dtype`, with the
    LoRA update W + scale x B @ A folded in when `merge_adapter`, else the base alone.

    Streamed: each weight is made on the model's device, moved to the cpu in `dtype` at once, and written
    with the rest of its decoder layer as one safetensors shard, so the export holds about one layer more
    than the model, on the device and on the host (a 7B model's 16-bit copy is 15 GB; Colab has 12.7 GB
    of RAM). transformers and vLLM read the sharded folder through its index file."""
    import copy
    import json

    from safetensors.torch import save_file

    inner = model.get_base_model()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    groups = _shard_groups(inner)
    index, total = {}, 0
    for n, (group, names) in enumerate(groups.items()):
        shard = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name in names:
            tensors[name] = _export_tensor(inner, name, merge_adapter).to("cpu", dtype).contiguous()
            index[name] = shard
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        del tensors
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1) + "\n")
    model_config = copy.deepcopy(inner.config)
    for quantized in ("quantization_config", "_pre_quantization_dtype"):  # transformers 4.x writes the second raw
        if hasattr(model_config, quantized):
            delattr(model_config, quantized)
    model_config.dtype = dtype
    model_config.use_cache = True
    model_config.save_pretrained(folder)
    inner.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _shard_groups(inner) -> dict[str, list[str]]:
    """The exported tensor names, grouped by decoder layer ("model.layers.3"), the rest in one group each."""
    names = []
    for name, module in inner.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):  # a LoRA-wrapped linear layer
            names.append(f"{name}.weight")
            if module.base_layer.bias is not None:
                names.append(f"{name}.bias")
    for name, _ in list(inner.named_parameters()) + list(inner.named_buffers()):
        if "lora_" in name or ".base_layer." in name or "rotary_emb" in name:
            continue
        names.append(name)
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        layer = next((i for i, p in enumerate(parts[:-1]) if p.isdigit()), None)
        groups.setdefault(".".join(parts[:layer + 1]) if layer is not None else name, []).append(name)
    return groups


def _export_tensor(inner, name: str, merge_adapter: bool) -> torch.Tensor:
    """One exported tensor, in float32 on the model's device; a LoRA-wrapped weight dequantized and merged."""
    owner, _, leaf = name.rpartition(".")
    module = inner.get_submodule(owner)
    if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
        if leaf == "bias":
            return module.base_layer.bias.detach().float()
        weight = _dense_weight(module.base_layer)
        if merge_adapter and "default" in module.lora_A and not getattr(module, "disable_adapters", False):
            a, b = module.lora_A["default"].weight.float(), module.lora_B["default"].weight.float()
            weight = weight + module.scaling["default"] * (b @ a)
        return weight
    return getattr(module, leaf).detach().float()


def _dense_weight(layer) -> torch.Tensor:
    weight = layer.weight
    if hasattr(weight, "quant_state"):  # a bitsandbytes 4-bit weight
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(weight.data, weight.quant_state).float()
    return weight.detach().float()
