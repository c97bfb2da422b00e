"""Adapters a run starts from or compares with: an SFT warm-up's weights loaded into the fresh adapter
(`--init-adapter`), and a reference adapter (`--reference-adapter`) whose weights are swapped into the policy's
adapter for the reference pass only, so the KL's reference costs one more set of LoRA weights, not a model.
Both must have the policy adapter's shape (the same model, rank and layers); one made with another `lora_alpha`
keeps its own effect (its B is rescaled to the run's scale), and a folder that is not a whole adapter, or one made
for another model, is named in one line before the model loads (`refuse_foreign_adapters`).
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch

FLAGS = {"init_adapter": "--init-adapter", "reference_adapter": "--reference-adapter"}


def adapter_settings(folder: str | Path, flag: str) -> dict:
    """An adapter folder's adapter_config.json, or a one-line error naming the flag, the folder and what is wrong."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{flag} {folder}: no such folder; give an adapter folder (runs/<run>/adapter)")
    config = folder / "adapter_config.json"
    if not config.is_file():
        raise ValueError(f"{flag} {folder}: no adapter_config.json in it, so it is not an adapter folder")
    try:
        settings = json.loads(config.read_text())
    except ValueError as error:
        raise ValueError(f"{flag} {folder}: its adapter_config.json is not valid JSON ({error})") from None
    if not isinstance(settings, dict) or not settings.get("r"):
        raise ValueError(f"{flag} {folder}: its adapter_config.json has no LoRA rank (r): not a LoRA adapter")
    if not any((folder / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ValueError(f"{flag} {folder}: no adapter weights in it (adapter_model.safetensors)")
    extra = not_lora(settings, folder)
    if extra:
        raise ValueError(f"{flag} {folder} carries {'; '.join(extra)} besides its LoRA weights, which would be written "
                         f"into this run's frozen base: save it with LoRA weights only (in PEFT's LoraConfig: "
                         f"modules_to_save=None, trainable_token_indices=None, use_dora=False, bias=\"none\")")
    return settings


def not_lora(settings: dict, folder: Path) -> list[str]:
    """What an adapter holds besides LoRA's A and B matrices, from its config and its weights' names: trained
    copies of whole modules (TRL and PEFT's `modules_to_save`, e.g. the lm head), trainable tokens, DoRA's magnitude
    vectors, biases. A run's base is frozen and its own adapter is LoRA alone, so none of them can be carried.

    >>> not_lora({"r": 8, "modules_to_save": ["lm_head"], "use_dora": True, "bias": "none"}, Path("."))
    ['modules_to_save (lm_head)', 'DoRA magnitudes']
    """
    found = []
    if settings.get("modules_to_save"):
        found.append(f"modules_to_save ({', '.join(settings['modules_to_save'])})")
    if settings.get("trainable_token_indices"):
        found.append("trainable tokens")
    if settings.get("use_dora"):
        found.append("DoRA magnitudes")
    if settings.get("bias", "none") != "none":
        found.append(f"biases (bias={settings['bias']!r})")
    weights = Path(folder) / "adapter_model.safetensors"
    if weights.is_file():
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt") as f:
            others = [k for k in f.keys() if "lora_A" not in k and "lora_B" not in k]
        if others and not found:
            found.append(f"{len(others)} other tensors ({', '.join(others[:2])}{', ...' * (len(others) > 2)})")
    return found


def lora_scale(settings: dict) -> float:
    """The factor PEFT multiplies an adapter's B A by: alpha / r, or alpha / sqrt(r) with rsLoRA.

    >>> lora_scale({"r": 16, "lora_alpha": 32}), lora_scale({"r": 16, "lora_alpha": 8}), lora_scale({"r": 16})
    (2.0, 0.5, 0.5)
    """
    r, alpha = settings["r"], settings.get("lora_alpha", 8)  # PEFT's default alpha is 8
    return alpha / (math.sqrt(r) if settings.get("use_rslora") else r)


def refuse_foreign_adapters(cfg) -> None:
    """Before the model loads: each adapter the run names (to start from, or as the KL's reference) is a whole one,
    of the run's rank, made for the run's model."""
    for field, flag in FLAGS.items():
        folder = getattr(cfg, field)
        if not folder:
            continue
        settings = adapter_settings(folder, flag)
        if settings["r"] != cfg.lora_rank:
            raise ValueError(f"{flag} {folder} has LoRA rank {settings['r']} and this run's adapter rank "
                             f"{cfg.lora_rank}; give --lora-rank {settings['r']}")
        base = settings.get("base_model_name_or_path")
        if base and not _same_model(base, cfg.hub_id):
            raise ValueError(f"{flag} {folder} was made for {base}, and this run trains {cfg.hub_id}: give an "
                             f"adapter of {cfg.model}, or --model for the adapter's base")


def _same_model(base: str, hub_id: str) -> bool:
    """Whether an adapter's recorded base names this run's model: the same hub id, folder, or model name (a hub
    id and a local copy of it name the model by their last part)."""
    name = lambda x: Path(str(x).rstrip("/")).name.lower()  # noqa: E731
    return base == hub_id or name(base) == name(hub_id) or Path(base).resolve() == Path(hub_id).resolve()


def start_from(policy, init_adapter: str | None, reference_adapter: str | None):
    """The fresh policy with `init_adapter`'s weights, and `reference_adapter`'s kept as `reference_weights`."""
    if reference_adapter:
        own = {name: p.detach().clone() for name, p in lora_named_parameters(policy)}
        load_adapter_weights(policy, reference_adapter, "--reference-adapter")
        policy.reference_weights = {name: p.detach().clone() for name, p in lora_named_parameters(policy)}
        with torch.no_grad():
            for name, p in lora_named_parameters(policy):
                p.copy_(own[name])
    if init_adapter:
        load_adapter_weights(policy, init_adapter, "--init-adapter")
    return policy


def load_adapter_weights(model, folder: str | Path, flag: str) -> None:
    """The policy's adapter set to the weights of an adapter folder of the same shape (an SFT warm-up's, a
    reference), or an error naming what differs."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    theirs, ours = lora_scale(adapter_settings(folder, flag)), lora_scale(vars(model.peft_config["default"]))
    weights = load_peft_weights(str(folder), device=str(model.device))
    if not math.isclose(theirs, ours):  # its effect, B A x its scale, kept at this run's scale
        weights = {k: v * (theirs / ours) if "lora_B" in k else v for k, v in weights.items()}
    try:
        result = set_peft_model_state_dict(model, weights)
    except RuntimeError as error:  # a size mismatch: another rank or model
        raise ValueError(f"{flag} {folder} does not fit this model's adapter: {str(error).splitlines()[-1].strip()}"
                         ) from None
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if getattr(result, "unexpected_keys", None) or missing:
        raise ValueError(f"{flag} {folder} adapts other layers than this run's adapter (e.g. "
                         f"{(result.unexpected_keys or missing)[0]}): make it with the same model and settings")


@contextlib.contextmanager
def adapter_swapped(model, weights: dict[str, torch.Tensor]):
    """Inside, the policy's adapter holds `weights` (another adapter of its shape, e.g. the KL's reference);
    its own weights are back after."""
    params = dict(lora_named_parameters(model))
    own = {name: p.detach().clone() for name, p in params.items()}
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
        try:
            yield model
        finally:
            for name, p in params.items():
                p.copy_(own[name])


def lora_named_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if "lora_" in n and ".default." in n]
