"""Side by side with TRL's GRPOTrainer: the same model, adapter, group size, lengths, reward and optimiser,
each trainer in a fresh process, taking turns (`minigrpo bench trl`; needs `pip install trl`). TRL runs the
script `minigrpo graduate` writes, so the comparison and the way to more GPUs are one piece of code."""

from __future__ import annotations

import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from minigrpo.bench.steps import ChildFailed, run_child, run_variant
from minigrpo.config import TrainConfig

# the setting of the side-by-side with TRL: the same model, adapter, group size, lengths, reward and optimiser
TRL_SETTING = dict(model="smollm2-135m", task="addition", num_generations=8, prompts_per_step=2, max_new_tokens=64,
                   learning_rate=1e-5, beta=0.04, lora_rank=16, lora_alpha=32, load_in_4bit=False, loss="dapo",
                   temperature=1.0, gradient_checkpointing=True)


def run_trl(steps: int) -> list[dict]:
    """TRL's GRPOTrainer on TRL_SETTING in a fresh process; per-step seconds and peak resident memory."""
    with tempfile.TemporaryDirectory(prefix="minigrpo-bench-trl-") as tmp:
        out = Path(tmp) / "steps.json"
        run_child("import sys; from minigrpo.bench.trl import _trl_child; _trl_child(int(sys.argv[1]), sys.argv[2])",
                  [str(steps), str(out)])
        return json.loads(out.read_text())


def _trl_child(steps: int, out: str) -> None:
    """TRL's side: the script `minigrpo graduate` writes for TRL_SETTING, its trainer timed step by step."""
    import resource

    from transformers import TrainerCallback

    records = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            records.append({"step": state.global_step, "time/step": time.perf_counter() - self.start,
                            "mem/peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})

    tmp = Path(tempfile.mkdtemp(prefix="minigrpo-trl-"))
    trainer = graduated_trainer(TrainConfig(**TRL_SETTING, steps=steps, save_every=0), tmp, cpu=True)
    trainer.add_callback(Clock())
    trainer.train()
    Path(out).write_text(json.dumps(records))


def graduated_trainer(cfg: TrainConfig, folder: Path, cpu: bool):
    """TRL's GRPOTrainer as the script `minigrpo graduate` writes for `cfg` builds it (the script in
    folder/graduated, TRL's output in folder/trl)."""
    from minigrpo.graduate import graduate

    script_dir = graduate(cfg, Path(folder) / "graduated")
    spec = importlib.util.spec_from_file_location("train_trl", script_dir / "train_trl.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.build(str(Path(folder) / "trl"), cfg.steps, cpu=cpu)


def compare_with_trl(steps: int = 6, rounds: int = 1, console: Console | None = None,
                     against: list[str] = ()) -> dict[str, str]:
    """TRL's GRPOTrainer, minigrpo as it runs by default (transformers generation on a cpu, its own dtype and
    checkpointing choices), the same in bfloat16 (where the cpu has bf16 instructions: the opt-in there),
    minigrpo with the vLLM engine, and minigrpo's default from each other checkout
    in `against` (a folder with an older or changed copy of the code), taking turns. A trainer that cannot
    run here is skipped with the reason, one that fails is shown with its last lines, and the table always
    prints what was measured. Returns the reason for each trainer left out."""
    from minigrpo.hardware import cpu_has_bf16, vllm_available

    console = console or Console(width=140)
    ours = {k: v for k, v in TRL_SETTING.items() if k not in ("gradient_checkpointing", "load_in_4bit")}
    columns = {"TRL GRPOTrainer": None, "minigrpo": dict(ours, generator="auto"),
               "minigrpo (bf16)": dict(ours, generator="auto", dtype="bfloat16"),
               "minigrpo (vllm)": dict(ours, generator="vllm")}
    code_dirs = {f"minigrpo ({Path(folder).name})": folder for folder in against}
    columns.update({name: dict(ours, generator="auto") for name in code_dirs})
    left_out = {}
    if not cpu_has_bf16():
        left_out["minigrpo (bf16)"] = "this cpu has no bf16 instructions (bf16 would be emulated)"
    if importlib.util.find_spec("trl") is None:
        left_out["TRL GRPOTrainer"] = "TRL is not installed (pip install trl)"
    if not vllm_available():
        left_out["minigrpo (vllm)"] = "vLLM is not installed (minigrpo doctor --vllm-requirement names the build)"
    steps_of: dict[str, list[dict]] = {name: [] for name in columns if name not in left_out}
    for r in range(rounds):
        for name in list(steps_of):
            console.print(f"round {r + 1}/{rounds}: {name}", highlight=False)
            try:
                records = run_trl(steps) if columns[name] is None else run_variant(dict(columns[name], steps=steps),
                                                                                   code_dir=code_dirs.get(name))
            except ChildFailed as error:
                console.print(f"[red]{name} failed[/]: {error}", highlight=False, markup=False)
                left_out[name] = f"failed ({str(error).splitlines()[0]})"
                del steps_of[name]
                continue
            steps_of[name] += records[1:]  # the first step pays for warm-up
    print_trl_table(steps_of, left_out, steps, rounds, console)
    return left_out


def print_trl_table(steps_of: dict[str, list[dict]], left_out: dict[str, str], steps: int, rounds: int,
                    console: Console) -> None:
    table = Table(title=f"{TRL_SETTING}; median over steps 2..{steps}, {rounds} round(s)")
    for column in ("trainer", "s/step", "x TRL", "peak GB", "x TRL mem", "generate s", "tokens/s"):
        table.add_column(column)
    base = None
    for name, records in steps_of.items():
        seconds = statistics.median(m["time/step"] for m in records)
        peak = max(m["mem/peak_gb"] for m in records)
        if name == "TRL GRPOTrainer":
            base = (seconds, peak)
        ratio = (lambda a, b: f"{a / b:.2f}") if base else (lambda a, b: "-")
        generate = [m["time/generate"] for m in records if "time/generate" in m]
        rate = [m["tokens_per_s"] for m in records if "tokens_per_s" in m]
        table.add_row(name, f"{seconds:.2f}", ratio(seconds, base[0] if base else 1), f"{peak:.2f}",
                      ratio(peak, base[1] if base else 1), f"{statistics.median(generate):.2f}" if generate else "-",
                      f"{statistics.median(rate):.0f}" if rate else "-")
    for name, why in left_out.items():
        table.add_row(name, "-", "-", "-", "-", "-", "-", end_section=False)
        console.print(f"{name}: not measured: {why}", highlight=False, markup=False)
    console.print(table)
