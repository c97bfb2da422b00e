"""Checkpoints that a run can resume from exactly, and that a crash mid-save cannot break.

    runs/<run>/checkpoints/step-000012/
        adapter/      the LoRA weights (PEFT format)
        state.pt      optimizer, scheduler, every RNG (python, numpy, torch, the generator's), the prompt pool,
                      the float16 gradient scaler

A checkpoint is written under a temporary name and renamed when complete, so a folder named `step-*` is
always whole; a process killed mid-save leaves only a `.partial-*` folder, which resume ignores and removes.
The metrics and samples files are cut back to the checkpoint's step on resume, so the resumed run's logs
read as if it had never stopped.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

PREFIX = "step-"


def save(run_dir: Path, step: int, model, optimizer, scheduler, prompts, generator, keep: int, scaler=None,
         extra: dict | None = None) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    partial = root / f".partial-{PREFIX}{step:06d}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial / "adapter")
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        "prompts": prompts.state_dict(),
        "generator": generator.state_dict() if hasattr(generator, "state_dict") else None,
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        "extra": {name: part.state_dict() for name, part in (extra or {}).items()},  # e.g. the entropy control
    }
    torch.save(state, partial / "state.pt")
    _fsync_tree(partial)
    if final.exists():  # the same step saved again (an interrupt right after a scheduled save)
        shutil.rmtree(final)
    os.rename(partial, final)  # atomic: from here on the checkpoint exists, whole
    for old in sorted(root.glob(f"{PREFIX}*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run; half-written ones are removed."""
    found = candidates(run_dir)
    return found[0] if found else None


def candidates(run_dir: Path) -> list[Path]:
    """A run's checkpoints, newest first (half-written ones are removed): resume tries them in turn, as a
    file damaged after its save (a full disk, a copy cut short) shows only when it is read."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    for partial in root.glob(".partial-*"):
        shutil.rmtree(partial, ignore_errors=True)
    return sorted((p for p in root.glob(f"{PREFIX}*") if (p / "state.pt").exists()), reverse=True)


def load_newest(run_dir: Path, model, optimizer, scheduler, prompts, generator, scaler=None, say=print,
                extra: dict | None = None) -> tuple[Path, int]:
    """Restore the newest checkpoint that reads whole, saying which were skipped and why."""
    for checkpoint in candidates(run_dir):
        try:
            return checkpoint, load(checkpoint, model, optimizer, scheduler, prompts, generator, scaler, extra)
        except Exception as error:  # a truncated or corrupted file: torch, safetensors and pickle raise many kinds
            say(f"[yellow]warning[/]: checkpoint {checkpoint} cannot be read ({type(error).__name__}: "
                f"{str(error)[:120]}); trying the one before it")
    raise FileNotFoundError(f"{run_dir} has no complete checkpoint to resume from")


def load(checkpoint: Path, model, optimizer, scheduler, prompts, generator, scaler=None, extra: dict | None = None) -> int:
    """Restore everything `save` wrote; returns the step it was taken after."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights)
    if getattr(result, "unexpected_keys", None):
        raise RuntimeError(f"{checkpoint} does not match this model: unexpected {result.unexpected_keys[:3]}")
    state = torch.load(checkpoint / "state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    prompts.load_state_dict(state["prompts"])
    if state["generator"] is not None and hasattr(generator, "load_state_dict"):
        generator.load_state_dict(state["generator"])
    if state.get("scaler") and scaler is not None and scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])
    for name, part in (extra or {}).items():
        if name in state.get("extra", {}):
            part.load_state_dict(state["extra"][name])
    generator.sync(model)
    rng = state["rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return state["step"]


def truncate_logs(run_dir: Path, step: int, say=print) -> None:
    """Drop log lines of steps after `step`: they belong to the part of the run that is being redone. A
    half-written last line (the process was killed mid-write) is dropped with a warning; a bad line
    elsewhere is an error that names it."""
    for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
        path = Path(run_dir) / name
        if not path.exists():
            continue
        lines = [line for line in path.read_text(errors="replace").split("\n") if line.strip()]
        kept = []
        for number, line in enumerate(lines, start=1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number < len(lines):
                    raise ValueError(f"{path}, line {number}: not valid JSON; the log is damaged (remove that "
                                     f"line to resume)") from None
                say(f"[yellow]warning[/]: {path}: dropped a half-written last line")
                continue
            if (record.get("step") or 0) <= step:
                kept.append(line)
        path.write_text("".join(line + "\n" for line in kept))


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
