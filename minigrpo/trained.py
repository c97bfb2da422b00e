"""A finished run, read back: its adapter's folder (or why there is none to read) and its policy, the base as the run
loaded it with the trained adapter, for `eval`, `sample`, `chat` and `export`."""

from __future__ import annotations

import json
from pathlib import Path

from minigrpo.config import TrainConfig
from minigrpo.console import quiet_libraries
from minigrpo.model import default_dtype, load_base, load_tokenizer
from minigrpo.presets import PRESETS
from minigrpo.run import stopped_at
from minigrpo.weights import offline_copy, resolve_weights


def adapter_folder(path: str | Path) -> Path:
    """A trained adapter's folder, given it or its run folder; an error that says what was expected."""
    path = Path(path)
    saved = sorted(path.glob("checkpoints/step-*/adapter/adapter_config.json"))
    stopped = stopped_at(path)
    if stopped:  # its final adapter was not written; an older one may lie there, from before a --resume
        raise ValueError(f"{stopped}; its last checkpoint's adapter is {saved[-1].parent}" if saved else stopped)
    for folder in (path, path / "adapter"):
        if (folder / "adapter_config.json").exists():
            return folder
    if (path / "config.json").exists():  # a run folder that ended before saving its final adapter
        raise ValueError(f"{path} is a run with no final adapter (it stopped before its end)" + (
            f": its last checkpoint's is {saved[-1].parent}, or continue it with minigrpo train --resume {path}"
            if saved else " and no checkpoint yet: continue it with minigrpo train --resume " + str(path)))
    raise ValueError(f"{path} is not a trained adapter: expected a folder with adapter_config.json, such as "
                     f"runs/<run>/adapter (or the run folder itself)")


def _adapter_base(adapter: Path) -> str | None:
    """The base an adapter trained elsewhere (TRL's output folder) names, as a preset name where it is one."""
    base = json.loads((Path(adapter) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    presets = {p.hub_id: name for name, p in PRESETS.items()}
    if base and Path(base).resolve() == offline_copy().resolve():
        return "smollm2-135m"  # minigrpo's offline copy of the tiny model
    return presets.get(base, base)


def load_trained(adapter: str | Path | None, model: str | None = None, **overrides):
    """A run's policy for sampling or export: its base (as the run loaded it) with the trained adapter.
    Returns (model, tokenizer, config)."""
    quiet_libraries()  # before peft, which imports bitsandbytes
    from peft import PeftModel

    if adapter:
        adapter = adapter_folder(adapter)
    run_dir = Path(adapter).parent if adapter else None
    saved = run_dir / "config.json" if run_dir else None
    given = {name: value for name, value in dict(model=model, **overrides).items() if value is not None}
    cfg = TrainConfig.load(saved, **given) if saved and saved.exists() else TrainConfig(
        **{"model": (adapter and _adapter_base(adapter)) or "smollm2-135m", "lora_rank": 1, **given})
    weights = resolve_weights(cfg.hub_id)
    tokenizer = load_tokenizer(weights)
    base = load_base(weights, cfg.load_in_4bit, default_dtype(cfg.dtype), cfg.max_prompt_tokens + cfg.completion_tokens,
                     cfg.micro_batch_size, cfg.bf16_base)
    if adapter:
        policy = PeftModel.from_pretrained(base, str(adapter))
    else:
        from peft import LoraConfig, get_peft_model

        policy = get_peft_model(base, LoraConfig(r=1, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    return policy.eval(), tokenizer, cfg
