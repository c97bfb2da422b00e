"""Checkpoints that a run can resume from exactly, and that a crash mid-save cannot break.

    runs/<run>/checkpoints/step-000012/
        adapter/      the LoRA weights (PEFT format)
        state.pt      every RNG (python, numpy, torch), and each part of the RunState with a state of its own
                      (`RunState.state_dict`: optimizer, scheduler, generator, float16 scaler, prompt pool, entropy)

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
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

PREFIX = "step-"


def save(run_dir: Path, step: int, state, keep: int) -> Path:
    """Write `state` (a RunState) as the checkpoint after `step`, keeping the newest `keep` checkpoints."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:06d}"
    partial = root / f".partial-{PREFIX}{step:06d}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    state.model.save_pretrained(partial / "adapter")
    saved = {
        "step": step,
        "rng": random_state(),
        "state": state.state_dict(),  # every part of the RunState, by name
    }
    torch.save(saved, partial / "state.pt")
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


def load_newest(run_dir: Path, state, say=print) -> tuple[Path, int]:
    """Restore the newest checkpoint that reads whole, saying which were skipped and why."""
    for checkpoint in candidates(run_dir):
        try:
            return checkpoint, load(checkpoint, state)
        except Exception as error:  # a truncated or corrupted file: torch, safetensors and pickle raise many kinds
            say(f"[yellow]warning[/]: checkpoint {checkpoint} cannot be read ({type(error).__name__}: "
                f"{str(error)[:120]}); trying the one before it")
    raise FileNotFoundError(f"{run_dir} has no complete checkpoint to resume from")


def load(checkpoint: Path, state) -> int:
    """Restore everything `save` wrote into `state` (a RunState); returns the step it was taken after."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(checkpoint / "adapter" / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(state.model, weights)
    if getattr(result, "unexpected_keys", None):
        raise RuntimeError(f"{checkpoint} does not match this model: unexpected {result.unexpected_keys[:3]}")
    saved = torch.load(checkpoint / "state.pt", weights_only=False)
    state.load_state_dict(saved["state"] if "state" in saved else _parts_of_an_older_save(saved))
    state.generator.sync(state.model)
    set_random_state(saved["rng"])
    return saved["step"]


def random_state() -> dict:
    """Every process-wide random stream a run draws from (python, numpy, torch, each card's)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_random_state(rng: dict) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


@contextmanager
def streams_kept(generator):
    """Every random stream of the process and of `generator` (a vLLM engine's seed stream) as it was before the
    block: what the block draws, the run's training never sees.

    >>> _ = torch.manual_seed(1)
    >>> with streams_kept(None):
    ...     _ = torch.rand(5), random.random()
    >>> first = torch.rand(1)
    >>> _ = torch.manual_seed(1)
    >>> bool(torch.rand(1) == first)
    True
    """
    saved = random_state()
    engine = generator.state_dict() if hasattr(generator, "state_dict") else None
    try:
        yield
    finally:
        set_random_state(saved)
        if engine is not None:
            generator.load_state_dict(engine)


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


def _parts_of_an_older_save(saved: dict) -> dict:
    """A checkpoint written before `RunState.state_dict`: its parts at the top level (the entropy control's under
    "extra"), so a run begun with an earlier release resumes."""
    parts = {name: saved.get(name) for name in ("optimizer", "scheduler", "prompts", "generator", "scaler")}
    parts["entropy"] = saved.get("extra", {}).get("entropy")
    return {name: state for name, state in parts.items() if state}
