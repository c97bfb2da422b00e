"""`minigrpo train` and `minigrpo sft` on the command line (registered in app.py). Their options are TrainConfig's
fields (cli/flags.py); only what is not a setting of the run is stated here."""

from __future__ import annotations

import typer

from minigrpo import settle
from minigrpo.cli.flags import config_flags, flag_fields, given, settings_of
from minigrpo.config import TASK, TrainConfig, flag_of
from minigrpo.errors import clear_errors


@clear_errors
@config_flags(defaults={"task": None})  # unset, so that --environment alone means its own prompts
def train(
    ctx: typer.Context,
    resume: str = typer.Option(None, rich_help_panel=TASK, help="Continue this run folder from its latest checkpoint "
                               "(other flags are taken from its config.json, but --steps may extend it) [default: "
                               "none, a new run]."),
    fork: str = typer.Option(None, rich_help_panel=TASK, help="RUN@STEP: a new run from that run's checkpoint at "
                             "STEP, with the flags given here changed; the run itself is left as it is "
                             "[default: none]."),
    **settings,
) -> None:
    """Train a LoRA adapter with GRPO and write a run folder."""
    from minigrpo.train import train as run_training

    if fork:
        from minigrpo.fork import fork_config

        if resume:
            raise typer.BadParameter("--fork starts a new run and --resume continues one: give one of them")
        try:
            cfg = fork_config(fork, given(ctx))
        except ValueError as error:
            raise typer.BadParameter(str(error)) from None
    elif resume:
        from pathlib import Path

        config = Path(resume) / "config.json"
        if not config.exists():
            raise typer.BadParameter(f"{resume} is not a run folder (it has no config.json)")
        cfg = TrainConfig.load(config)
        changed = changed_flags(ctx, cfg)
        if changed:
            raise typer.BadParameter(f"--resume continues {resume} with the settings in its config.json, and "
                                     f"only --steps can change: {'; '.join(changed)}. Drop the flag, or start a "
                                     f"new run to change it")
        cfg = settle.overridden(cfg, steps=given(ctx).get("steps"), output_dir=resume)
    else:
        cfg = config_from_flags(ctx.params)
    run_training(cfg, resume=bool(resume))


def changed_flags(ctx: typer.Context, saved: TrainConfig) -> list[str]:
    """The flags given on this command line whose values differ from the resumed run's config, each with
    both values: re-running the same command with --resume appended changes nothing, so it is accepted."""
    flags = {f.name: flag_of(f) for f in flag_fields()}
    changed = []
    for field, value in given(ctx).items():
        before = getattr(saved, field, None)
        if field != "steps" and value != (list(before) if isinstance(before, (list, tuple)) else before):
            changed.append(f"{flags[field]} is {before!r} in the run, {value!r} here")
    return changed


def config_from_flags(params: dict) -> TrainConfig:
    """The TrainConfig that `train`'s flags describe."""
    chosen = settings_of(params)
    chosen["task"] = chosen["task"] or ("environment" if chosen.get("environment") else TrainConfig.task)
    chosen["reward_weights"] = chosen["reward_weights"] or None  # none given: the task's own
    try:
        return TrainConfig(**chosen)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


@clear_errors
@config_flags("model", "learning_rate", "lora_rank", "micro_batch_size", "load_in_4bit", "dtype", "seed",
              helps={"micro_batch_size": "Examples per forward/backward pass and optimizer step."})
def sft(
    task: str = typer.Option(..., help="A data file (.jsonl .json .csv .parquet) of prompt/completion pairs, or "
                                       "chat `messages` ending with the assistant's answer."),
    out: str = typer.Option(..., help="A new folder for the adapter (OUT/adapter) and its record (sft.json)."),
    epochs: int = typer.Option(3, min=1, help="Passes over the examples."),
    **settings,
) -> None:
    """A supervised warm-up: LoRA on the completion tokens of worked examples, for `train --init-adapter` (train
    with the same --model and --lora-rank)."""
    from pathlib import Path

    from rich.console import Console

    from minigrpo.sft import sft as warm_up

    cfg = TrainConfig(task=task, eval_before_after=False, **settings)
    adapter = warm_up(cfg, Path(task), Path(out), epochs, Console().print)
    Console().print(f"wrote {adapter}; GRPO from it: minigrpo train --model {cfg.model} --init-adapter {adapter} "
                    f"(and --beta 0.01 --reference-adapter {adapter} to keep near it)", highlight=False)
