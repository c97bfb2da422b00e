"""`minigrpo train` on the command line: its flags, which build the run's TrainConfig (registered in app.py)."""

from __future__ import annotations

import typer

from minigrpo import settle
from minigrpo.cli.talk import UNCONFINED_HELP
from minigrpo.config import (Advantage, Decoder, Dtype, Generator, ImportanceSampling, KlEstimator, Loss,
                             LossAggregation, RewardAggregation, ScaleRewards, Surrogate, TrainConfig)
from minigrpo.errors import clear_errors

PRESET_HELP = "[default: from the model preset]"


TIMEOUT_HELP = "Seconds a reward function may take per completion before it scores 0 (0: no limit)."


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
    fork: str = typer.Option(None, help="RUN@STEP: a new run from that run's checkpoint at STEP, with the flags "
                                        "given here changed; the run itself is left as it is [default: none]."),
    save_every: int = typer.Option(10, help="Checkpoint every N steps (and at the end)."),
    keep: int = typer.Option(2, help="Checkpoints to keep."),
    output_dir: str = typer.Option(None, "--out", help="Run folder [default: runs/<time>-<model>-<task>]."),
    num_generations: int = typer.Option(None, "--num-generations", "-G", help=f"Completions per prompt. {PRESET_HELP}"),
    prompts_per_step: int = typer.Option(None, help=f"Prompts per step. {PRESET_HELP}"),
    max_new_tokens: int = typer.Option(None, help=f"Completion length limit. {PRESET_HELP}"),
    max_prompt_tokens: int = typer.Option(512, help="Prompt length limit; every prompt of the data is checked "
                                                    "against it before the model loads."),
    learning_rate: float = typer.Option(None, help=f"Adapter learning rate. {PRESET_HELP}"),
    beta: float = typer.Option(0.0, help="KL coefficient; 0 skips the reference pass."),
    kl_estimator: KlEstimator = typer.Option("k3", help="The KL's estimate per token."),
    reference_adapter: str = typer.Option(None, help="The KL's reference is the base plus this adapter (e.g. an "
                                                     "SFT warm-up's) [default: the base, adapters off]."),
    init_adapter: str = typer.Option(None, help="Start the adapter from this folder's weights (`minigrpo sft`'s "
                                                "adapter/) [default: a fresh adapter]."),
    advantage: Advantage = typer.Option("grpo", help="The baseline: the group mean, the mean of the others "
                                                     "(RLOO), or that divided by the group's mean success (MaxRL)."),
    reward_aggregation: RewardAggregation = typer.Option("sum", help="Several rewards weighted and summed, or each "
                                                                     "normalised within its group first (GDPO)."),
    entropy_coef: float = typer.Option(0.0, help="Bonus on the trained tokens' mean entropy (0: none)."),
    entropy_target: float = typer.Option(None, help="Adapt --entropy-coef each step to hold the mean entropy at "
                                                    "this many nats (TRL's adaptive entropy) [default: fixed]."),
    loss: Loss = typer.Option("dapo", help="A preset of the knobs below."),
    scale_rewards: ScaleRewards = typer.Option(None, help="Advantages divided by the std of the group, the batch, "
                                                          "or none [default: from --loss]."),
    loss_aggregation: LossAggregation = typer.Option(None, help="Tokens averaged per completion, over the batch, or "
                                                                "over a constant [default: from --loss]."),
    importance_sampling: ImportanceSampling = typer.Option(None, help="A ratio per token, or one per completion "
                                                                      "(GSPO) [default: from --loss]."),
    surrogate: Surrogate = typer.Option(None, help="Clip the ratio, or cap it as a detached weight (CISPO) "
                                                   "[default: from --loss]."),
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
                                             "own held-out split: every source holds out a tenth of its rows, "
                                             "at most 200]."),
    lora_rank: int = typer.Option(None, help=f"LoRA rank (alpha = 2 x rank). {PRESET_HELP}"),
    temperature: float = typer.Option(1.0, help="Sampling temperature."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling threshold."),
    micro_batch_size: int = typer.Option(8, help="Completions per forward/backward pass."),
    generator: Generator = typer.Option("auto", help="auto: vllm where it is installed and a GPU is present."),
    decoder: Decoder = typer.Option("auto", help="transformers generation's decode loop: static (fixed shapes, a "
                                                 "CUDA graph per token on a card), eager (token by token), or auto."),
    gpu_memory_utilization: float = typer.Option(None, help="The vLLM engine's share of the card's memory "
                                                            "[default: sized from the model, see `minigrpo plan`]."),
    tis_cap: float = typer.Option(2.0, help="Cap of the truncated importance-sampling weight (0: off)."),
    seed: int = typer.Option(0, min=0, help="Seed for data order, sampling and initialisation."),
    dtype: Dtype = typer.Option("auto", help="Compute dtype; auto: bfloat16 on sm_80+, float16 on older GPUs, "
                                             "float32 on cpu."),
    load_in_4bit: bool = typer.Option(None, "--4bit/--no-4bit",
                                      help="nf4 base, or the compute dtype [default: 4-bit on GPU, the compute dtype on cpu]."),
    bf16_base: bool = typer.Option(None, "--bf16-base/--no-bf16-base",
                                   help="Keep a float32 model's frozen projections in bfloat16 [default: on a cpu with "
                                        "bf16 instructions, with --dtype auto and transformers generation]."),
    gradient_checkpointing: bool = typer.Option(
        None, "--gradient-checkpointing/--no-gradient-checkpointing",
        help="Recompute activations in backward: less memory, slower steps [default: off on a cpu with room "
             "(`minigrpo plan` says), on on a GPU]."),
    sample_every: int = typer.Option(5, min=0, help="Show a sampled completion every N steps (0: never)."),
    report_to: list[str] = typer.Option([], help="Also log to tensorboard and/or wandb (repeat) [default: none]."),
) -> None:
    """Train a LoRA adapter with GRPO and write a run folder."""
    from minigrpo.train import train as run_training

    if fork:
        from minigrpo.fork import fork_config

        if resume:
            raise typer.BadParameter("--fork starts a new run and --resume continues one: give one of them")
        try:
            cfg = fork_config(fork, given_flags(ctx))
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
        cfg = settle.overridden(cfg, steps=steps, output_dir=resume)
    else:
        cfg = config_from_flags(ctx.params)
    run_training(cfg, resume=bool(resume))


RENAMED = {"reward": "rewards", "reward_weight": "reward_weights", "tool": "tools"}  # flag -> config field


def given_flags(ctx: typer.Context) -> dict:
    """The config fields that flags on this command line set (not their defaults), by field name."""
    out = {}
    for name, value in ctx.params.items():
        if name not in ("resume", "fork") and getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE":
            out[RENAMED.get(name, name)] = list(value) if isinstance(value, (list, tuple)) else value
    return out


def changed_flags(ctx: typer.Context, saved: TrainConfig) -> list[str]:
    """The flags given on this command line whose values differ from the resumed run's config, each with
    both values: re-running the same command with --resume appended changes nothing, so it is accepted."""
    changed = []
    for field, given in given_flags(ctx).items():
        before = getattr(saved, field, None)
        if field != "steps" and given != (list(before) if isinstance(before, (list, tuple)) else before):
            flag = next((f for f, name in RENAMED.items() if name == field), field)
            changed.append(f"--{flag.replace('_', '-')} is {before!r} in the run, {given!r} here")
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


@clear_errors
def sft(
    task: str = typer.Option(..., help="A data file (.jsonl .json .csv .parquet) of prompt/completion pairs, or "
                                       "chat `messages` ending with the assistant's answer."),
    out: str = typer.Option(..., help="A new folder for the adapter (OUT/adapter) and its record (sft.json)."),
    model: str = typer.Option("smollm2-135m", help="Preset name, hub id, or local folder: the base GRPO will train."),
    epochs: int = typer.Option(3, help="Passes over the examples."),
    learning_rate: float = typer.Option(None, help=f"Adapter learning rate. {PRESET_HELP}"),
    lora_rank: int = typer.Option(None, help=f"LoRA rank; train with the same. {PRESET_HELP}"),
    micro_batch_size: int = typer.Option(8, help="Examples per forward/backward pass and optimizer step."),
    load_in_4bit: bool = typer.Option(None, "--4bit/--no-4bit",
                                      help="nf4 base, or the compute dtype [default: 4-bit on GPU, the compute dtype on cpu]."),
    dtype: Dtype = typer.Option("auto", help="Compute dtype, as for train."),
    seed: int = typer.Option(0, min=0, help="Seed for the example order and initialisation."),
) -> None:
    """A supervised warm-up: LoRA on the completion tokens of worked examples, for `train --init-adapter`."""
    from pathlib import Path

    from rich.console import Console

    from minigrpo.sft import sft as warm_up

    cfg = TrainConfig(model=model, task=task, learning_rate=learning_rate, lora_rank=lora_rank, seed=seed,
                      micro_batch_size=micro_batch_size, load_in_4bit=load_in_4bit, dtype=dtype, eval_before_after=False)
    if epochs < 1:
        raise ValueError("--epochs must be at least 1")
    adapter = warm_up(cfg, Path(task), Path(out), epochs, Console().print)
    Console().print(f"wrote {adapter}; GRPO from it: minigrpo train --model {model} --init-adapter {adapter} "
                    f"(and --beta 0.01 --reference-adapter {adapter} to keep near it)", highlight=False)
