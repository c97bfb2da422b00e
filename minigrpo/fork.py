"""Forking a run: a new run that starts from another run's kept checkpoint with some settings changed (a
learning rate, beta, a reward weight), to recover from a collapse or to try a change from the same point.

    minigrpo train --fork runs/<run>@20 --learning-rate 5e-6

The new run's settings are the parent's config.json with the flags given on the command line over it; its
config records `forked_from`. Its folder gets a copy of the parent's checkpoint at that step and of its logs up
to it (so its curves read from step 0), and it resumes from there as any run resumes; the parent's folder is
only read. The optimizer's state carries over; a changed learning rate or weight decay takes effect at once.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from minigrpo import checkpoint
from minigrpo.config import TrainConfig


def parse(spec: str) -> tuple[Path, int]:
    """`RUN@STEP` -> (the run folder, the step).

    >>> parse("runs/a@20")
    (PosixPath('runs/a'), 20)
    """
    run, sep, step = spec.rpartition("@")
    if not sep or not run or not step.isdigit():
        raise ValueError(f"--fork {spec}: give a run folder and one of its checkpoints' steps, as RUN@STEP")
    return Path(run), int(step)


def kept(spec: str) -> Path:
    """The parent's checkpoint folder that `spec` names, or the error that lists the steps it kept."""
    run, step = parse(spec)
    if not (run / "config.json").is_file():
        raise ValueError(f"--fork {spec}: {run} is not a run folder (it has no config.json)")
    found = {int(p.name[len(checkpoint.PREFIX):]): p for p in checkpoint.candidates(run)}
    if step not in found:
        raise ValueError(f"--fork {spec}: {run} kept no checkpoint at step {step}; it kept "
                         f"{', '.join(map(str, sorted(found))) or 'none'} (--keep and --save-every decide which)")
    return found[step]


FIXED = ("model", "lora_rank", "lora_alpha")  # the checkpoint's adapter has their shape: a fork keeps them


def fork_config(spec: str, given: dict) -> TrainConfig:
    """The fork's settings: the parent's, with the `given` fields over them and where it came from."""
    from minigrpo.config import LOSS_PRESETS as PRESETS

    run, _ = parse(spec)
    kept(spec)
    fields = json.loads((run / "config.json").read_text())
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"preset"}
    fields = {k: v for k, v in fields.items() if k in names}
    for name in FIXED:
        if name in given and given[name] != fields.get(name):
            raise ValueError(f"--fork {spec}: the checkpoint's adapter was made with --{name.replace('_', '-')} "
                             f"{fields.get(name)}; a fork keeps it (start a new run to change it)")
    for name in ("task", "seed"):  # the checkpoint's prompt pool holds that task's rows, drawn by that seed
        if name in given and given[name] != fields.get(name):
            raise ValueError(f"--fork {spec}: the checkpoint's prompt pool holds the rows of --task "
                             f"{fields.get('task')} (seed {fields.get('seed')}); a fork keeps --{name}. For another, "
                             f"start a new run from its adapter: --init-adapter {kept(spec) / 'adapter'}")
    if "loss" in given or "advantage" in given:  # the knobs the old preset filled in give way to the new one's
        for knob in {k for preset in PRESETS.values() for k in preset} - set(given):
            fields[knob] = None
    cfg = TrainConfig(**{**fields, "output_dir": None, **given, "forked_from": spec})
    if cfg.steps <= parse(spec)[1]:
        raise ValueError(f"--fork {spec}: the fork starts after step {parse(spec)[1]} and the run ends at step "
                         f"{cfg.steps}; give --steps above {parse(spec)[1]}")
    return cfg


def seed_folder(folder: Path, spec: str) -> None:
    """The new run's folder, holding a copy of the parent's checkpoint and its logs (resume cuts them back
    to the checkpoint's step)."""
    source = kept(spec)
    run, _ = parse(spec)
    shutil.copytree(source, Path(folder) / "checkpoints" / source.name)
    for name in ("metrics.jsonl", "samples.jsonl", "eval.jsonl"):
        if (run / name).is_file():
            shutil.copyfile(run / name, Path(folder) / name)


def apply_changes(cfg: TrainConfig, optimizer, scheduler) -> None:
    """After the parent's optimizer and schedule are restored: the fork's own learning rate and weight decay."""
    scheduler.base_lrs = [cfg.learning_rate] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = cfg.learning_rate
        group["lr"] = cfg.learning_rate * factor(scheduler.last_epoch)
        group["weight_decay"] = cfg.weight_decay
