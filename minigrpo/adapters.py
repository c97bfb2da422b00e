"""Adapters a run starts from or compares with: an SFT warm-up's weights loaded into the fresh adapter
(`--init-adapter`), and a reference adapter (`--reference-adapter`) whose weights are swapped into the policy's
adapter for the reference pass only, so the KL's reference costs one more set of LoRA weights, not a model.
Both must have the policy adapter's shape (the same model, rank and layers).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch


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

    try:
        result = set_peft_model_state_dict(model, load_peft_weights(str(folder), device=str(model.device)))
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
