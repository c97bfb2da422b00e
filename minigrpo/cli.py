"""`minigrpo` on the command line: a thin layer that builds a TrainConfig and calls the Python API."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from minigrpo.config import PRESETS, TrainConfig

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="GRPO with a 4-bit base and LoRA adapters, on one consumer GPU (or a laptop cpu).")

PRESET_HELP = "[default: from the model preset]"


@app.command()
def train(
    model: str = typer.Option("smollm2-135m", help="Preset name (`minigrpo models`), hub id, or local folder."),
    task: str = typer.Option("addition", help="Built-in task (`minigrpo tasks`)."),
    steps: int = typer.Option(30, help="Optimizer steps."),
    output_dir: str = typer.Option(None, help="Run folder [default: runs/<time>-<model>-<task>]."),
    num_generations: int = typer.Option(None, "--num-generations", "-G", help=f"Completions per prompt. {PRESET_HELP}"),
    prompts_per_step: int = typer.Option(None, help=f"Prompts per step. {PRESET_HELP}"),
    max_new_tokens: int = typer.Option(None, help=f"Completion length limit. {PRESET_HELP}"),
    learning_rate: float = typer.Option(None, help=f"Adapter learning rate. {PRESET_HELP}"),
    beta: float = typer.Option(0.0, help="KL coefficient; 0 skips the reference pass."),
    lora_rank: int = typer.Option(None, help=f"LoRA rank (alpha = 2 x rank). {PRESET_HELP}"),
    temperature: float = typer.Option(1.0, help="Sampling temperature."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling threshold."),
    micro_batch_size: int = typer.Option(8, help="Completions per forward/backward pass."),
    generator: str = typer.Option("auto", help="vllm | hf | auto (vllm where installed and a GPU is present)."),
    gpu_memory_utilization: float = typer.Option(0.3, help="The vLLM engine's share of GPU memory."),
    tis_cap: float = typer.Option(2.0, help="Cap of the truncated importance-sampling weight (0: off)."),
    seed: int = typer.Option(0, help="Seed for data order, sampling and initialisation."),
    no_4bit: bool = typer.Option(False, "--no-4bit", help="Load the base in 16-bit (32-bit on cpu) instead of nf4."),
    no_gradient_checkpointing: bool = typer.Option(False, "--no-gradient-checkpointing",
                                                   help="Faster steps, more activation memory."),
    sample_every: int = typer.Option(5, help="Show a sampled completion every N steps (0: never)."),
) -> None:
    """Train a LoRA adapter with GRPO and write a run folder."""
    from minigrpo.train import train as run_training

    try:
        cfg = TrainConfig(
            model=model, task=task, steps=steps, output_dir=output_dir, num_generations=num_generations,
            prompts_per_step=prompts_per_step, max_new_tokens=max_new_tokens, learning_rate=learning_rate,
            beta=beta, lora_rank=lora_rank, temperature=temperature, top_p=top_p,
            micro_batch_size=micro_batch_size, generator=generator,
            gpu_memory_utilization=gpu_memory_utilization, tis_cap=tis_cap, seed=seed, load_in_4bit=not no_4bit,
            gradient_checkpointing=not no_gradient_checkpointing, sample_every=sample_every,
        )
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    run_training(cfg)


@app.command()
def models() -> None:
    """List the model presets and the sizes they set."""
    table = Table(title="model presets (sizes for a 16 GB GPU with a 4-bit base)")
    for column in ("preset", "hub id", "LoRA rank", "lr", "G", "prompts/step", "max new tokens", "note"):
        table.add_column(column, no_wrap=column in ("preset", "hub id"))
    for name, p in PRESETS.items():
        table.add_row(name, p.hub_id, str(p.lora_rank), f"{p.learning_rate:g}", str(p.num_generations),
                      str(p.prompts_per_step), str(p.max_new_tokens), p.note)
    Console().print(table)


@app.command()
def tasks() -> None:
    """List the built-in tasks."""
    from rewards import TASKS

    table = Table(title="built-in tasks")
    table.add_column("task")
    table.add_column("reward functions")
    table.add_column("what it is")
    for name, task in TASKS.items():
        table.add_row(name, ", ".join(task.reward_names), task.description)
    Console().print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
