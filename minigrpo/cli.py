"""`minigrpo` on the command line: a thin layer that builds a TrainConfig and calls the Python API."""

from __future__ import annotations

import sys

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from minigrpo import supervise
from minigrpo.cli_machine import machine_app
from minigrpo.cli_talk import UNCONFINED_HELP, talk_app
from minigrpo.config import PRESETS, TrainConfig
from minigrpo.errors import clear_errors

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="GRPO with a 4-bit base and LoRA adapters, on one consumer GPU (or a laptop cpu).")

PRESET_HELP = "[default: from the model preset]"


TIMEOUT_HELP = "Seconds a reward function may take per completion before it scores 0 (0: no limit)."


@app.command()
@clear_errors
def train(
    ctx: typer.Context,
    model: str = typer.Option("smollm2-135m", help="Preset name (`minigrpo models`), hub id, or local folder."),
    task: str = typer.Option(None, help="Built-in task, task .py file, data file, or hub dataset [default: "
                                        "addition; with --environment, the prompts its reset() writes]."),
    environment: str = typer.Option(None, help="An environment class file.py:Class (TRL's environment_factory): "
                                               "one per episode, its methods as tools [default: the task's own]."),
    reward: list[str] = typer.Option([], help="Extra reward function file.py:function (repeat) [default: none]."),
    reward_weight: list[float] = typer.Option([], help="One weight per reward function, the task's first (repeat) [default: 1.0 each, or the task's]."),
    strict_rewards: bool = typer.Option(False, help="Stop when a reward function raises (default: score 0)."),
    allow_unconfined_code: bool = typer.Option(False, help=UNCONFINED_HELP),
    reward_timeout: float = typer.Option(10.0, help=TIMEOUT_HELP),
    tool: list[str] = typer.Option([], help="A tool the model may call, file.py:function (repeat): each "
                                            "completion becomes an episode of turns [default: the task's own]."),
    max_turns: int = typer.Option(4, help="Model turns per episode, with tools."),
    max_episode_tokens: int = typer.Option(None, help="Tokens after the prompt per episode, tool results "
                                                      "included [default: max-turns x max-new-tokens]."),
    tool_timeout: float = typer.Option(10.0, help="Seconds a tool call may take."),
    steps: int = typer.Option(None, help="Optimizer steps [default: 30; with --resume, the run's own]."),
    resume: str = typer.Option(None, help="Continue this run folder from its latest checkpoint (other flags "
                                          "are taken from its config.json, but --steps may extend it) [default: none, a new run]."),
    save_every: int = typer.Option(10, help="Checkpoint every N steps (and at the end)."),
    keep: int = typer.Option(2, help="Checkpoints to keep."),
    output_dir: str = typer.Option(None, help="Run folder [default: runs/<time>-<model>-<task>]."),
    num_generations: int = typer.Option(None, "--num-generations", "-G", help=f"Completions per prompt. {PRESET_HELP}"),
    prompts_per_step: int = typer.Option(None, help=f"Prompts per step. {PRESET_HELP}"),
    max_new_tokens: int = typer.Option(None, help=f"Completion length limit. {PRESET_HELP}"),
    max_prompt_tokens: int = typer.Option(512, help="Prompt length limit; every prompt of the data is checked "
                                                    "against it before the model loads."),
    learning_rate: float = typer.Option(None, help=f"Adapter learning rate. {PRESET_HELP}"),
    beta: float = typer.Option(0.0, help="KL coefficient; 0 skips the reference pass."),
    loss: str = typer.Option("dapo", help="grpo | dr_grpo | dapo | bnpo | gspo | cispo: a preset of the knobs below."),
    scale_rewards: str = typer.Option(None, help="group | batch | none [default: from --loss]."),
    loss_aggregation: str = typer.Option(None, help="sequence | token | constant [default: from --loss]."),
    importance_sampling: str = typer.Option(None, help="token | sequence: a ratio per token, or one per completion "
                                                       "(GSPO) [default: from --loss]."),
    surrogate: str = typer.Option(None, help="ppo | cispo: clip the ratio, or cap it as a detached weight "
                                             "(CISPO) [default: from --loss]."),
    epsilon: float = typer.Option(None, help="Clip range below 1 [default: from --loss: 0.2, gspo 3e-4]."),
    epsilon_high: float = typer.Option(None, help="Clip range above 1 (clip-higher; cispo: the weight's cap - 1) "
                                                  "[default: from --loss, else --epsilon]."),
    top_entropy_quantile: float = typer.Option(1.0, help="Train on this top share of tokens by entropy (0.2: "
                                                         "the 80/20 rule); 1 trains on all."),
    num_iterations: int = typer.Option(1, help="Optimizer passes per rollout (the ratio and clipping engage above 1)."),
    mask_truncated: bool = typer.Option(False, help="Completions cut at the length limit do not count."),
    filter_groups: bool = typer.Option(False, help="Drop groups with equal rewards and draw more prompts (DAPO)."),
    max_filter_rounds: int = typer.Option(3, help="Extra generation rounds per step at most, with --filter-groups."),
    retire_solved: int = typer.Option(0, help="Retire a prompt solved by every completion on K visits in a row."),
    eval_before_after: bool = typer.Option(True, help="A fast greedy evaluation on held-out prompts at step 0 and "
                                                      "at the end, and the before/after line."),
    eval_every: int = typer.Option(0, help="A full evaluation (greedy and sampled) every N steps (0: never)."),
    eval_prompts: int = typer.Option(64, help="Held-out prompts per evaluation."),
    eval_samples: int = typer.Option(4, help="Samples per held-out prompt for the mean reward."),
    eval_data: str = typer.Option(None, help="A data file of held-out rows to evaluate on [default: the task's "
                                             "own held-out split; a data file holds out a tenth of its rows]."),
    lora_rank: int = typer.Option(None, help=f"LoRA rank (alpha = 2 x rank). {PRESET_HELP}"),
    temperature: float = typer.Option(1.0, help="Sampling temperature."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling threshold."),
    micro_batch_size: int = typer.Option(8, help="Completions per forward/backward pass."),
    generator: str = typer.Option("auto", help="vllm | hf | auto (vllm where installed and a GPU is present)."),
    decoder: str = typer.Option("auto", help="transformers generation's decode loop: static (fixed shapes, a CUDA "
                                             "graph per token on a card), eager (token by token), or auto."),
    gpu_memory_utilization: float = typer.Option(None, help="The vLLM engine's share of the card's memory "
                                                            "[default: sized from the model, see `minigrpo plan`]."),
    tis_cap: float = typer.Option(2.0, help="Cap of the truncated importance-sampling weight (0: off)."),
    seed: int = typer.Option(0, help="Seed for data order, sampling and initialisation."),
    dtype: str = typer.Option("auto", help="Compute dtype: auto (bfloat16 on sm_80+, float16 on older GPUs, float32 "
                                           "on cpu), bfloat16, float16 or float32."),
    load_in_4bit: bool = typer.Option(None, "--4bit/--no-4bit",
                                      help="nf4 base, or the compute dtype [default: 4-bit on GPU, the compute dtype on cpu]."),
    bf16_base: bool = typer.Option(None, "--bf16-base/--no-bf16-base",
                                   help="Keep a float32 model's frozen projections in bfloat16 [default: on a cpu with "
                                        "bf16 instructions, with --dtype auto and transformers generation]."),
    gradient_checkpointing: bool = typer.Option(
        None, "--gradient-checkpointing/--no-gradient-checkpointing",
        help="Recompute activations in backward: less memory, slower steps [default: off on a cpu with room "
             "(`minigrpo plan` says), on on a GPU]."),
    sample_every: int = typer.Option(5, help="Show a sampled completion every N steps (0: never)."),
    report_to: list[str] = typer.Option([], help="Also log to tensorboard and/or wandb (repeat) [default: none]."),
) -> None:
    """Train a LoRA adapter with GRPO and write a run folder."""
    from minigrpo.train import train as run_training

    if resume:
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
        if steps is not None:
            cfg.steps = steps
        cfg.output_dir = resume
    else:
        cfg = config_from_flags(ctx.params)
    run_training(cfg, resume=bool(resume))


RENAMED = {"reward": "rewards", "reward_weight": "reward_weights", "tool": "tools"}  # flag -> config field


def changed_flags(ctx: typer.Context, saved: TrainConfig) -> list[str]:
    """The flags given on this command line whose values differ from the resumed run's config, each with
    both values: re-running the same command with --resume appended changes nothing, so it is accepted."""
    changed = []
    for name, given in ctx.params.items():
        if name in ("resume", "steps") or getattr(ctx.get_parameter_source(name), "name", "") != "COMMANDLINE":
            continue
        field = RENAMED.get(name, name)
        before = getattr(saved, field, None)
        given = list(given) if isinstance(given, (list, tuple)) else given
        if given != (list(before) if isinstance(before, (list, tuple)) else before):
            changed.append(f"--{name.replace('_', '-')} is {before!r} in the run, {given!r} here")
    return changed


def config_from_flags(params: dict) -> TrainConfig:
    """The TrainConfig that `train`'s flags describe (their names are the config's, but for a few)."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    chosen = {name: value for name, value in params.items() if name in fields}
    chosen["task"] = params["task"] or ("environment" if params.get("environment") else "addition")
    chosen.update(rewards=list(params["reward"]), reward_weights=list(params["reward_weight"]) or None,
                  tools=list(params["tool"]), steps=30 if params["steps"] is None else params["steps"],
                  report_to=list(params["report_to"]))
    try:
        return TrainConfig(**chosen)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@clear_errors
def graduate(
    ctx: typer.Context,
    run: str = typer.Argument(None, help="A run folder, whose config.json is taken [default: train's flags, "
                                         "given after --]."),
    out: str = typer.Option(..., help="A new folder for train_trl.py, accelerate.yaml and README.md."),
    gpus: int = typer.Option(1, help="GPUs on the machine: accelerate's processes."),
    backend: str = typer.Option("zero2", help="zero2 | zero3 | fsdp: how the GPUs share the model (4-bit with "
                                              "zero2 only)."),
    full_finetune: bool = typer.Option(False, help="Train every weight, not LoRA adapters."),
    vllm_mode: str = typer.Option("colocate", help="colocate | server: vLLM in each training process, or a "
                                                   "separate server."),
    from_adapter: str = typer.Option(None, help="Continue from this adapter (runs/<run>/adapter) [default: a "
                                                "new one]."),
) -> None:
    """Continue on TRL across GPUs: a TRL script, an accelerate config and a README for the same task,
    rewards and settings, e.g. `minigrpo graduate runs/<run> --gpus 4 --out trl` or
    `minigrpo graduate --out trl --gpus 4 -- --model qwen-7b --task countdown`."""
    from pathlib import Path

    from minigrpo.graduate import graduate as write_folder

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
    else:
        train_command = typer.main.get_command(app).get_command(ctx, "train")
        cfg = config_from_flags(train_command.make_context("train", flags).params)
    folder = write_folder(cfg, Path(out), gpus, backend, full_finetune, vllm_mode, from_adapter)
    Console().print(f"wrote {folder}: train_trl.py, accelerate.yaml, README.md (the mapping). Launch there:\n"
                    f"  accelerate launch --config_file accelerate.yaml train_trl.py", highlight=False)


@app.command("eval")
@clear_errors
def eval_command(
    task: str = typer.Option(..., help="Built-in task, task .py file, data file, or hub dataset."),
    adapter: str = typer.Option(None, help="A trained adapter folder (runs/<run>/adapter) [default: none, the base model]."),
    model: str = typer.Option(None, help="Base model [default: the adapter's run config, else smollm2-135m]."),
    reward: list[str] = typer.Option([], help="Extra reward function file.py:function (repeat) [default: none]."),
    tool: list[str] = typer.Option([], help="A tool the model may call, file.py:function (repeat) [default: the "
                                            "task's own]."),
    prompts: int = typer.Option(64, help="Held-out prompts."),
    samples: int = typer.Option(4, help="Samples per prompt for the mean reward."),
    max_new_tokens: int = typer.Option(None, help="Completion length limit [default: the run's, else the preset's]."),
    max_turns: int = typer.Option(None, help="Model turns per episode [default: the run's, else "
                                             f"{TrainConfig.max_turns}]."),
    out: str = typer.Option(None, help="Folder for eval.jsonl [default: the adapter's run folder]."),
    seed: int = typer.Option(None, help="Seed of the held-out split [default: the run's, else 0]."),
    eval_data: str = typer.Option(None, help="A data file of held-out rows [default: the run's --eval-data, else "
                                             "the task's held-out split]."),
    allow_unconfined_code: bool = typer.Option(False, help=UNCONFINED_HELP),
) -> None:
    """Evaluate the base model or a trained adapter on the task's held-out split: pass@1 and mean reward."""
    from pathlib import Path

    from minigrpo import judge
    from minigrpo.console import describe_eval
    from minigrpo.episodes import settle_budget
    from minigrpo.evaluate import Evaluator
    from minigrpo.generation import HFGenerator
    from minigrpo.model import adapter_folder, load_trained, seed_everything
    from minigrpo.run import results_folder
    from minigrpo.tasks import check_sandbox, get_task
    
    t = get_task(task, reward, extra_tools=tool)
    check_sandbox(t, allow_unconfined_code, Console().print)
    adapter = adapter and adapter_folder(adapter)
    folder = results_folder(Path(out), "--out") if out else adapter.parent if adapter else None
    # the run's own seed by default: it decides the held-out split, which must be the one training never saw
    policy, tokenizer, cfg = load_trained(adapter, model, max_new_tokens=max_new_tokens, max_turns=max_turns,
                                          eval_prompts=prompts, eval_samples=samples, seed=seed, eval_data=eval_data)
    seed_everything(cfg.seed)
    settle_budget(cfg, t)
    generator = HFGenerator(policy, tokenizer)
    judge.attach(judge.base_generate(generator, tokenizer), folder)
    result = Evaluator(cfg, t, t.weights, tokenizer, generator, folder)(None)
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
    from minigrpo import openenv_task, reasoning_gym_task, verifiers_task

    for source in (reasoning_gym_task, verifiers_task, openenv_task):
        console.print(f"from libraries: {source.listing()}", highlight=False)


@app.command("check-reward")
@clear_errors
def check_reward(
    task: str = typer.Option(None, help="Built-in task, task .py file, data file, or hub dataset [default: "
                                        "none; with --environment alone, the prompts its reset() writes]."),
    environment: str = typer.Option(None, help="An environment class file.py:Class, as train takes it "
                                               "[default: the task's own]."),
    reward: list[str] = typer.Option([], help="Extra reward function file.py:function (repeat) [default: none]."),
    tool: list[str] = typer.Option([], help="A tool the model may call, file.py:function (repeat): each "
                                            "completion becomes an episode [default: the task's own]."),
    model: str = typer.Option("smollm2-135m", help="The model to sample completions from."),
    max_prompt_tokens: int = typer.Option(512, help="Prompt length limit, as train has it."),
    prompts: int = typer.Option(4, help="Prompts to sample completions for."),
    samples: int = typer.Option(None, help="Completions per prompt [default: the model preset's G]."),
    max_new_tokens: int = typer.Option(None, help="Completion length limit [default: from the model preset]."),
    max_turns: int = typer.Option(None, help=f"Model turns per episode [default: {TrainConfig.max_turns}]."),
    no_model: bool = typer.Option(False, "--no-model", help="Only the worked examples and the data; load no model."),
    seed: int = typer.Option(0),
    allow_unconfined_code: bool = typer.Option(False, help=UNCONFINED_HELP),
) -> None:
    """Run the rewards on worked examples and on sampled completions; warn about broken or useless ones."""
    from minigrpo.check import check_task
    from minigrpo.tasks import check_sandbox, get_task

    console = Console()
    if task is None and environment is None:
        raise typer.BadParameter("give --task (or --environment, whose reset() writes the prompts)")
    t = get_task(task or "environment", reward, extra_tools=tool, environment=environment)
    check_sandbox(t, allow_unconfined_code, console.print)
    check_task(t, t.make_data("train", seed)[:prompts], console, None if no_model else model, samples,
               max_new_tokens, seed, max_turns, max_prompt_tokens, tokenizer_of=model)


@app.command()
@clear_errors
def export(
    run: str = typer.Argument(..., help="A run folder."),
    out: str = typer.Option(..., help="Where to write the exported model."),
    merge: bool = typer.Option(True, "--merge/--adapter-only",
                               help="A merged standalone model, or just the PEFT adapter folder."),
    dtype: str = typer.Option("bfloat16", help="Weights of the merged model: bfloat16, float16 or float32."),
) -> None:
    """Export a trained run: a merged 16-bit model that transformers and vLLM load, or the adapter alone."""
    import shutil
    from pathlib import Path

    import torch

    from minigrpo.model import adapter_folder
    from minigrpo.run import results_folder

    adapter = adapter_folder(run)
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"--out {out} already exists and is not an empty folder; pick a new one (nothing was written)")
    results_folder(target, "--out")
    if not merge:
        shutil.copytree(adapter, out, dirs_exist_ok=True)
        Console().print(f"copied the adapter to {out}")
        return
    from minigrpo.export import export_weights
    from minigrpo.model import load_trained

    policy, tokenizer, _ = load_trained(adapter)
    export_weights(policy, tokenizer, Path(out), getattr(torch, dtype), merge_adapter=True)
    Console().print(f"wrote a merged {dtype} model to {out}")


@app.command()
@clear_errors
def plot(
    run: str = typer.Argument(..., help="A run folder."),
    out: str = typer.Option(None, help="PNG path [default: <run>/curves.png]."),
) -> None:
    """Write a run's curves (reward and its parts, groups with spread, eval, KL, length, step time) as a PNG."""
    from minigrpo.plot import plot_run

    Console().print(f"wrote {plot_run(run, out)}")


app.add_typer(machine_app)  # plan, doctor, bench
app.add_typer(talk_app)  # sample, chat


def main() -> None:
    if sys.argv[1:2] == ["train"]:  # watched: see minigrpo/supervise.py
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
