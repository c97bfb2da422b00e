"""`minigrpo` on the command line: a thin layer that builds a TrainConfig and calls the Python API."""

from __future__ import annotations

import logging
import sys

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from minigrpo import supervise
from minigrpo.cli.after import after_app
from minigrpo.cli.machine import machine_app
from minigrpo.cli.flags import Panelled, config_flags
from minigrpo.cli.talk import talk_app
from minigrpo.cli.train import config_from_flags, sft, train
from minigrpo.config import Backend, TrainConfig, VllmMode
from minigrpo.presets import PRESETS
from minigrpo.errors import clear_errors

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="GRPO with a 4-bit base and LoRA adapters, on one consumer GPU (or a laptop cpu).")
app.command(cls=Panelled)(train)
app.command()(sft)

@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@clear_errors
def graduate(
    ctx: typer.Context,
    run: str = typer.Argument(None, help="A run folder, whose config.json is taken [default: train's flags, "
                                         "given after --]."),
    out: str = typer.Option(..., help="A new folder for train_trl.py, accelerate.yaml and README.md."),
    gpus: int = typer.Option(1, help="GPUs on the machine: accelerate's processes."),
    backend: Backend = typer.Option("zero2", help="How the GPUs share the model (4-bit with zero2 only)."),
    full_finetune: bool = typer.Option(False, help="Train every weight, not LoRA adapters."),
    vllm_mode: VllmMode = typer.Option("colocate", help="vLLM in each training process, or a separate server."),
    init_adapter: str = typer.Option(None, help="Start from this adapter (runs/<run>/adapter) [default: the run's "
                                                "--init-adapter, else a new one]."),
) -> None:
    """Continue on TRL across GPUs: a TRL script, an accelerate config and a README for the same task,
    rewards and settings, e.g. `minigrpo graduate runs/<run> --gpus 4 --out trl` or
    `minigrpo graduate --out trl --gpus 4 -- --model qwen-7b --task countdown`."""
    from pathlib import Path

    from minigrpo.graduate import graduate as write_folder
    from minigrpo.run import stopped_at

    flags = list(ctx.args)
    if run and run.startswith("-"):  # after --, the first of train's flags lands in the RUN argument's place
        run, flags = None, [run, *flags]
    if run and flags:
        raise ValueError(f"give a run folder or train's flags after --, not both (got {run} and {' '.join(flags)})")
    if run:
        if not (Path(run) / "config.json").exists():
            raise ValueError(f"{run} is not a run folder (it has no config.json); for a new setup give train's "
                             f"flags after --")
        cfg = TrainConfig.load(Path(run) / "config.json")
        stopped = stopped_at(Path(run))
        if stopped:  # its recipe graduates all the same: the TRL script trains from the start
            Console().print(f"[yellow]note[/]: {stopped}; the TRL script trains its settings from the start",
                            highlight=False)
    else:
        train_command = typer.main.get_command(app).get_command(ctx, "train")
        cfg = config_from_flags(train_command.make_context("train", flags).params)
    folder = write_folder(cfg, Path(out), gpus, backend, full_finetune, vllm_mode, init_adapter)
    Console().print(f"wrote {folder}: train_trl.py, accelerate.yaml, README.md (the mapping). Launch there:\n"
                    f"  accelerate launch --config_file accelerate.yaml train_trl.py", highlight=False)


@app.command("eval")
@clear_errors
@config_flags("allow_unconfined_code")
def eval_command(
    task: str = typer.Option(..., help="Built-in task, task .py file, data file, or hub dataset."),
    adapter: str = typer.Option(None, help="A trained adapter folder (runs/<run>/adapter) [default: none, the base model]."),
    model: str = typer.Option(None, help="Base model [default: the adapter's run config, else smollm2-135m]."),
    reward: list[str] = typer.Option([], help="Extra reward function file.py:function (repeat) [default: none]."),
    tool: list[str] = typer.Option([], help="A tool the model may call, file.py:function (repeat) [default: the "
                                            "task's own]."),
    prompts: int = typer.Option(64, help="Held-out prompts."),
    samples: int = typer.Option(4, help="Samples per prompt for the mean reward."),
    max_new_tokens: int = typer.Option(None, min=1, help="Completion length limit [default: the run's, else the "
                                                         "preset's]."),
    max_turns: int = typer.Option(None, min=1, help="Model turns per episode [default: the run's, else "
                                                    f"{TrainConfig.max_turns}]."),
    out: str = typer.Option(None, help="Folder for eval.jsonl [default: the adapter's run folder]."),
    seed: int = typer.Option(None, min=0, help="Seed of the held-out split [default: the run's, else 0]."),
    eval_data: str = typer.Option(None, help="A data file of held-out rows [default: the run's --eval-data, else "
                                             "the task's held-out split]."),
    *, allow_unconfined_code: bool,  # its option: config.py's field
) -> None:
    """Evaluate the base model or a trained adapter on the task's held-out split: pass@1 and mean reward."""
    from pathlib import Path

    from minigrpo.judge import rubric as judge
    from minigrpo.console import describe_eval
    from minigrpo import settle
    from minigrpo.evaluate import Evaluator
    from minigrpo.generate.hf import HFGenerator
    from minigrpo.model import seed_everything
    from minigrpo.trained import adapter_folder, load_trained
    from minigrpo.run import results_folder, writable
    from minigrpo.tasks import refuse_unconfined_code, get_task
    
    for flag, value in (("--prompts", prompts), ("--samples", samples)):
        if value < 1:
            raise ValueError(f"{flag} {value}: give at least 1")
    t = get_task(task, reward, extra_tools=tool)
    settle.refuse_missing_eval_data(eval_data)
    refuse_unconfined_code(t, allow_unconfined_code, Console().print)
    adapter = adapter and adapter_folder(adapter)
    folder = results_folder(Path(out), "--out") if out else adapter.parent if adapter else None
    if folder is not None:
        writable(folder, "the run folder (where eval.jsonl goes; or give --out)")  # before the work, not after
    # the run's own seed by default: it decides the held-out split, which must be the one training never saw
    policy, tokenizer, cfg = load_trained(adapter, model, max_new_tokens=max_new_tokens, max_turns=max_turns,
                                          eval_prompts=prompts, eval_samples=samples, seed=seed, eval_data=eval_data)
    seed_everything(cfg.seed)
    cfg = settle.episode_budget(cfg, t)
    generator = HFGenerator(policy, tokenizer)
    judge.attach(judge.base_generate(generator, tokenizer), folder)
    result = Evaluator(cfg, t, tokenizer, generator, folder)(None)
    Console().print(f"{f'adapter {adapter}' if adapter else 'base model ' + cfg.model} on {t.name}: "
                    f"{describe_eval(result)}", highlight=False)


@app.command()
@clear_errors
def models() -> None:
    """List the model presets and the sizes they set."""
    # narrow enough for an 80-column terminal: the numbers never wrap, the hub id and note share the last column
    table = Table(title="model presets (`minigrpo plan` says what fits a card)",
                  caption="sizes are for a 16 GB GPU with the base in 4-bit; any flag overrides them",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("preset", no_wrap=True)
    table.add_column("G x prompts,\nnew tokens", no_wrap=True)
    table.add_column("lr", no_wrap=True)
    table.add_column("LoRA\nrank", no_wrap=True)
    table.add_column("hub id\nnote", overflow="fold")
    for name, p in PRESETS.items():
        table.add_row(name, f"{p.num_generations} x {p.prompts_per_step}, {p.max_new_tokens}", f"{p.learning_rate:g}",
                      str(p.lora_rank), f"{p.hub_id}\n[dim]{escape(p.note)}[/dim]")
    Console().print(table)


@app.command()
@clear_errors
def tasks() -> None:
    """List the built-in tasks."""
    from minigrpo.tasks import BUILT_IN, built_in

    table = Table(title="built-in tasks (--task NAME)")
    table.add_column("task", no_wrap=True)
    table.add_column("reward functions")
    table.add_column("what it is")
    for name, task in ((name, built_in(name)) for name in BUILT_IN):
        table.add_row(name, ", ".join(task.reward_names), task.description)
    console = Console()
    console.print(table)
    console.print("rewards to add to any task: --reward rewards.format:format_reward (think/answer structure); "
                  "rewards.length:overlong_penalty(...) from Python. Your own: --reward file.py:function.")
    from minigrpo.sources import openenv, reasoning_gym, verifiers

    for source in (reasoning_gym, verifiers, openenv):
        console.print(f"from libraries: {source.listing()}", highlight=False)


@app.command("check-reward")
@clear_errors
@config_flags("environment", "rewards", "tools", "model", "max_prompt_tokens", "seed", "allow_unconfined_code",
              helps={"model": "The model to sample completions from."})
def check_reward(
    task: str = typer.Option(None, help="Built-in task, task .py file, data file, or hub dataset [default: "
                                        "none; with --environment alone, the prompts its reset() writes]."),
    prompts: int = typer.Option(4, min=1, help="Prompts to sample completions for."),
    samples: int = typer.Option(None, min=1, help="Samples per prompt, a group's spread as training sees it "
                                                  "[default: the model preset's G]."),
    max_new_tokens: int = typer.Option(None, min=1, help="Completion length limit [default: from the model preset]."),
    max_turns: int = typer.Option(None, min=1, help=f"Model turns per episode [default: {TrainConfig.max_turns}]."),
    no_model: bool = typer.Option(False, "--no-model", help="Only the worked examples and the data; load no model."),
    *, environment: str, rewards: list[str], tools: list[str], model: str, max_prompt_tokens: int, seed: int,
    allow_unconfined_code: bool,  # options of config.py's fields
) -> None:
    """Run the rewards on worked examples and on sampled completions; warn about broken or useless ones."""
    from minigrpo.check import check_task, precheck_rewards
    from minigrpo.scoring import RewardError
    from minigrpo.tasks import refuse_unconfined_code, get_task

    console = Console()
    if task is None and environment is None:
        raise typer.BadParameter("give --task (or --environment, whose reset() writes the prompts)")
    t = get_task(task or "environment", rewards, extra_tools=tools, environment=environment)
    refuse_unconfined_code(t, allow_unconfined_code, console.print)
    rows = t.make_data("train", seed)
    try:  # first the checks train makes before it loads a model: where they stop it, this command fails too
        precheck_rewards(t, rows[:prompts])
    except RewardError as error:
        raise ValueError(f"train would stop here, before loading the model: {error}") from None
    check_task(t, rows[:prompts], console, None if no_model else model, samples, max_new_tokens, seed, max_turns,
               max_prompt_tokens, tokenizer_of=model)


app.add_typer(machine_app)  # plan, doctor, bench
app.add_typer(talk_app)  # sample, chat
app.add_typer(after_app)  # export, plot


# flags renamed so that one thing has one name in every command; the old spelling is told the new one
RENAMED = {"--output-dir": "--out", "--from-adapter": "--init-adapter", "--n": "--samples",
           "--group": "--num-generations"}


# what a flag is called in the field's other tools, where its initials could stand for two of ours (--lora-rank)
CALLED = {"--lr": "--learning-rate", "--batch-size": "--micro-batch-size", "--output": "--out"}


def meant(flag: str, known: set[str]) -> str | None:
    """The flag a guessed one stands for: its name elsewhere (`CALLED`), its words' initials (--mnt:
    --max-new-tokens) or a word left out (--max-tokens: --max-new-tokens), where exactly one known flag fits.

    >>> meant("--lr", {"--learning-rate", "--lora-rank", "--steps"}), meant("--mnt", {"--max-new-tokens"})
    ('--learning-rate', '--max-new-tokens')
    >>> meant("--max-tokens", {"--max-new-tokens", "--max-turns"}), meant("--x", {"--steps"})
    ('--max-new-tokens', None)
    """
    if CALLED.get(flag) in known:
        return CALLED[flag]
    typed = flag.lstrip("-").split("-")
    fits = [k for k in known if "".join(w[0] for w in k.lstrip("-").split("-")) == "".join(typed) or
            (len(typed) > 1 and _in_order(typed, k.lstrip("-").split("-")))]
    return fits[0] if len(fits) == 1 else None


def _in_order(words: list[str], within: list[str]) -> bool:
    """Whether `words` appear in `within` in order, with some left out."""
    rest = iter(within)
    return len(words) < len(within) and all(any(w == x for x in rest) for w in words)


def _guessed_flag(argv: list[str]) -> str | None:
    """One line for an option no command has that stands for one that some command has."""
    from typer._click.core import Context  # typer's own click

    root = typer.main.get_command(app)
    known = set()
    for name in root.list_commands(Context(root)):
        command = root.get_command(Context(root), name)
        for sub in ([command.get_command(Context(command), n) for n in command.list_commands(Context(command))]
                    if hasattr(command, "list_commands") else [command]):
            known.update(opt for param in sub.params for opt in getattr(param, "opts", []) + getattr(
                param, "secondary_opts", []) if opt.startswith("--"))
    for arg in argv:
        flag = arg.partition("=")[0]
        if flag.startswith("--") and flag not in known and meant(flag, known):
            return f"no such option {flag}: did you mean {meant(flag, known)}?"
    return None


def main() -> None:
    renamed = [arg.partition("=")[0] for arg in sys.argv[1:] if arg.partition("=")[0] in RENAMED]
    if renamed:
        Console(stderr=True).print(f"[bold red]error[/]: {renamed[0]} is now {RENAMED[renamed[0]]} (one name for one "
                                   f"thing in every command)", highlight=False)
        sys.exit(2)
    guessed = _guessed_flag(sys.argv[1:])
    if guessed:
        Console(stderr=True).print(f"[bold red]error[/]: {guessed}", highlight=False)
        sys.exit(2)
    # bitsandbytes logs a note about an optional kernel package when anything imports it (transformers' trainer
    # module does, for a reward's TrainerState): not for a user's screen
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    if sys.argv[1:2] and sys.argv[1] in supervise.WATCHED:  # commands that run user code: supervise.py
        code = supervise.watch(sys.argv)
        if code is not None:
            sys.exit(code)
        try:
            app()
        finally:
            supervise.finished()
    app()


if __name__ == "__main__":
    main()
