"""Side-by-side step benchmarks: the same training run under a few variants, in one command.

Each variant trains in a fresh process (so peak memory is its own), the variants take turns round by
round (so a noisy machine hurts them alike), and the figures are medians over the steps after the first
(which pays for warm-up). Ratios are against the first variant.

    minigrpo bench compare --variant vllm:generator=vllm --variant hf:generator=hf \\
        --set num_generations=8 --set prompts_per_step=8 --set max_new_tokens=64 --steps 4
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from minigrpo.config import TrainConfig

# glibc keeps freed medium blocks in its heap, so the resident set would count memory that is free; serving
# every block over 64 KiB from mmap returns it on free, and the resident set then tracks live tensors
LIVE_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def parse_settings(items: list[str]) -> dict:
    """["beta=0.04", "generator=hf"] -> {"beta": 0.04, "generator": "hf"}, values checked against TrainConfig."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in names:
            raise ValueError(f"{item!r} is not NAME=VALUE with a TrainConfig field name")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


class ChildFailed(RuntimeError):
    """A benchmark's child process failed; the message ends with its last lines of output."""


def run_child(code: str, args: list[str], env: dict | None = None, code_dir: str | None = None) -> None:
    """`python -c code *args` in a fresh process (importing minigrpo from `code_dir`, another checkout, if
    given), which dies with this one; on failure, ChildFailed with what it printed last."""
    if code_dir:
        env = {**(env or {}), "PYTHONPATH": str(Path(code_dir).resolve())}
    from minigrpo.supervise import die_with_parent

    done = subprocess.run([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, errors="replace", env={**os.environ, **(env or {})}, cwd=code_dir,
                          preexec_fn=die_with_parent)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        raise ChildFailed(f"exit status {done.returncode}; its last lines:\n{tail}")


def run_variant(settings: dict, env: dict | None = None, code_dir: str | None = None) -> list[dict]:
    """Train in a fresh process with these settings (and extra environment variables, and the code of
    another checkout); its per-step metrics."""
    with tempfile.TemporaryDirectory(prefix="minigrpo-bench-") as tmp:
        cfg = dict(settings, output_dir=str(Path(tmp) / "run"), sample_every=0, eval_before_after=False)
        code = ("import json, sys; from minigrpo import TrainConfig, train; "
                "train(TrainConfig(**json.loads(sys.argv[1])))")
        run_child(code, [json.dumps(cfg)], env, code_dir)
        lines = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]


def compare(variants: dict[str, dict], common: dict, rounds: int = 1, console: Console | None = None) -> list[dict]:
    console = console or Console(width=140)
    steps: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(rounds):
        for name, settings in variants.items():
            console.print(f"round {r + 1}/{rounds}: {name}", highlight=False)
            metrics = run_variant({**common, **settings})
            steps[name] += metrics[1:] if len(metrics) > 1 else metrics  # the first step pays for warm-up

    def med(name, key):
        values = [m[key] for m in steps[name] if key in m]
        return statistics.median(values) if values else float("nan")

    rows = []
    for name in variants:
        rows.append({
            "variant": name, "s/step": med(name, "time/step"), "generate s": med(name, "time/generate"),
            "train s": med(name, "time/train"), "sync s": med(name, "time/sync"),
            "tokens/s": med(name, "tokens_per_s"), "peak GB": max(m["mem/peak_gb"] for m in steps[name]),
        })
    first = rows[0]
    table = Table(title=f"median over steps 2+ ({rounds} round(s)); common: {common}")
    for column in ("variant", "s/step", "x first", "generate s", "train s", "sync s", "sync share", "tokens/s",
                   "peak GB", "x first mem"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["variant"], f"{row['s/step']:.2f}", f"{row['s/step'] / first['s/step']:.2f}",
                      f"{row['generate s']:.2f}", f"{row['train s']:.2f}", f"{row['sync s']:.3f}",
                      f"{row['sync s'] / row['s/step']:.1%}", f"{row['tokens/s']:.0f}", f"{row['peak GB']:.2f}",
                      f"{row['peak GB'] / first['peak GB']:.2f}")
    console.print(table)
    return rows


def extra_memory_gb(fn) -> float:
    """Peak memory while `fn()` runs, above what was in use before it: GPU memory where there is a GPU, else
    the resident set sampled every 2 ms (run with LIVE_MEMORY_ENV, so freed memory leaves it)."""
    import threading

    import torch

    from minigrpo.hardware import memory_in_use_gb

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        return (torch.cuda.max_memory_allocated() - before) / 2**30
    before, peak, running = memory_in_use_gb(), [0.0], [True]

    def watch():
        while running[0]:
            peak[0] = max(peak[0], memory_in_use_gb())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        fn()
    finally:
        running[0] = False
        watcher.join()
    return max(peak[0], memory_in_use_gb()) - before


def weights_or_random(preset: str, folder: Path, random_weights: bool = False) -> tuple[str, bool]:
    """The preset's real weights where they are here (or reachable) unless `random_weights`, else random
    weights of its shape (speed and memory do not depend on the values) written to `folder`, with the
    offline tokenizer. A random model almost never ends a completion early: every one runs to the limit."""
    import torch
    from transformers import AutoModelForCausalLM

    from minigrpo.console import quiet_libraries
    from minigrpo.model import byte_tokenizer, default_dtype, load_tokenizer
    from minigrpo.presets import PRESETS
    from minigrpo.presets import preset_shape
    from minigrpo.weights import OFFLINE_HUB_ID, hub_problem, offline_copy, resolve_weights

    hub_id = TrainConfig(model=preset).hub_id
    if not random_weights and (hub_id == OFFLINE_HUB_ID or hub_problem(hub_id) is None):
        return resolve_weights(hub_id), False
    if preset not in PRESETS:
        raise ValueError(f"no weights for {preset} here and no known shape; known: {', '.join(PRESETS)}")
    # made on the GPU where there is one: drawing qwen-1.5b's on a 2-core cpu took 20 s
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(preset_shape(preset), dtype=default_dtype())
    quiet_libraries()
    model.save_pretrained(folder)
    # smollm2's tokenizer where its converted copy is already here; else a byte-level one. never the hub or the
    # package index: a machine without a network (a lent GPU) would wait on them for nothing
    copy = offline_copy()
    tokenizer = load_tokenizer(str(copy)) if (copy / "config.json").exists() else byte_tokenizer()
    tokenizer.save_pretrained(folder)
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return str(folder), True


def measure_setting(weights: str, base: TrainConfig, G: int, n: int, steps: int, generator: str) -> dict:
    """Train one G x max-new-tokens setting in a fresh process; the medians of its steps after the first."""
    settings = dict(model=weights, task="addition", steps=steps, num_generations=G, max_new_tokens=n,
                    prompts_per_step=base.prompts_per_step, lora_rank=base.lora_rank,
                    learning_rate=base.learning_rate, generator=generator)
    metrics = run_variant(settings, env=LIVE_MEMORY_ENV)
    metrics = metrics[1:] or metrics  # the first step pays for warm-up
    med = lambda k: statistics.median(m.get(k, 0.0) for m in metrics)
    return {"G": G, "max_new_tokens": n, "prompts": base.prompts_per_step,
            "s/step": med("time/step"), "tokens/s": med("tokens_per_s"), "sync s": med("time/sync"),
            "prompt tokens": max(m["prompt_len/max"] for m in metrics),
            "completion tokens": max(m["completion_len/max"] for m in metrics),
            "loaded GB": med("mem/loaded_gb"), "peak GB": max(m["mem/peak_gb"] for m in metrics),
            "reserved GB": max(m.get("mem/peak_reserved_gb", 0.0) for m in metrics)}


def bench_model(preset: str, groups=(4, 8), lengths=None, steps: int = 3, generator: str = "auto",
                random_weights: bool = False, console: Console | None = None) -> list[dict]:
    """Generation tokens/s, seconds per step, sync time and peak memory for a few G x max-new-tokens,
    then a memory plan for the rest (see `StepMemory`)."""
    import torch
    from transformers import AutoConfig

    from minigrpo.model import default_dtype
    from minigrpo.plan import Sizes, StepMemory, trainer_gb

    console = console or Console(width=140)
    gpu = torch.cuda.is_available()
    lengths = lengths or ((128, 512) if gpu else (32, 64))
    base = TrainConfig(model=preset)
    with tempfile.TemporaryDirectory(prefix="minigrpo-bench-model-") as tmp:
        weights, random_weights = weights_or_random(preset, Path(tmp) / "model", random_weights)
        shape = AutoConfig.from_pretrained(weights)
        console.print(f"{preset}: {'random weights of its shape' if random_weights else 'its real weights'}, "
                      f"{'GPU: ' + torch.cuda.get_device_name(0) if gpu else 'cpu'}", highlight=False)
        rows = []
        for G in groups:
            for n in lengths:  # each row as it is measured, so a run stopped part-way still leaves figures
                rows.append(measure_setting(weights, base, G, n, steps, generator))
                console.print(f"  G={G}, {n} new tokens: " + ", ".join(
                    f"{k} {v:.3g}" for k, v in rows[-1].items() if k not in ("G", "max_new_tokens")), highlight=False)
    from minigrpo.hardware import vllm_available

    # on a GPU with vLLM the cache is part of the engine's share, not of the step
    hf_generation = generator == "hf" or not gpu or not vllm_available()
    # the runs left checkpointing to the plan: always on on a GPU; off on a cpu for the models a cpu trains
    checkpointing = gpu if base.gradient_checkpointing is None else base.gradient_checkpointing
    memory = StepMemory(shape, default_dtype().itemsize, base.micro_batch_size,
                        base.logprob_chunk_size, hf_generation, checkpointing)
    overhead = memory.calibrate(rows)
    # `minigrpo plan`'s trainer term from the shape alone (its cuda context aside: torch does not count it)
    trainer = trainer_gb(Sizes.of(shape), base.lora_rank, base.load_in_4bit, default_dtype().itemsize)
    table = Table(title=f"minigrpo bench --model {preset} (measured; median over steps 2..{steps})")
    for column in ("G", "prompts/step", "max new tokens", "s/step", "generation tokens/s", "sync s",
                   "GB after loading", "peak GB", "reserved GB", "plan: from the other rows", "plan: shape alone"):
        table.add_column(column)
    for i, r in enumerate(rows):
        # calibrated without this row, so the column is a check of the plan on a setting it has not seen
        step = memory.step_gb(r["G"] * r["prompts"], r["prompt tokens"], r["completion tokens"])
        estimate = f"{memory.calibrate(rows[:i] + rows[i + 1:]) + step:.2f}" if len(rows) > 1 else "-"
        table.add_row(str(r["G"]), str(r["prompts"]), str(r["max_new_tokens"]), f"{r['s/step']:.2f}",
                      f"{r['tokens/s']:.0f}", f"{r['sync s']:.3f}", f"{r['loaded GB']:.2f}", f"{r['peak GB']:.2f}",
                      f"{r['reserved GB']:.2f}" if gpu else "-", estimate, f"{trainer + step:.2f}")
    console.print(table)
    if not gpu:
        console.print("On CPU these runs return freed memory to the system at once (LIVE_MEMORY_ENV), so that peak GB "
                      "is live memory as on a GPU; that costs time, so s/step here is slower than a plain run's.",
                      highlight=False)
    if gpu:
        budget, where = torch.cuda.get_device_properties(0).total_memory / 2**30, "this GPU"
    else:
        budget, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, "this machine"
    prompt_tokens = max(128, max(r["prompt tokens"] for r in rows))
    plan = Table(title=f"memory plan: {base.prompts_per_step} prompts of {prompt_tokens} tokens per step, "
                       f"micro-batches of {base.micro_batch_size}; estimated peak GB")
    plan.add_column("G")
    for n in PLAN_LENGTHS:
        plan.add_column(f"{n} new tokens")
    for G in PLAN_GROUPS:
        cells = []
        for n in PLAN_LENGTHS:
            need = overhead + memory.step_gb(G * base.prompts_per_step, prompt_tokens, n)
            cells.append(f"{need:.1f}" if need < 0.9 * budget else f"[red]{need:.1f} (no)[/]")
        plan.add_row(str(G), *cells)
    console.print(plan)
    console.print(f"Fits {where} ({budget:.0f} GB) unless marked no (90% of it, for fragmentation). The estimate "
                  f"is {overhead:.2f} GB measured for the model and the runtime, plus what a step adds, computed from "
                  f"the model's shape: transformers generation's key/value cache for every row, or one micro-batch "
                  f"of training (checkpointed activations and one {memory.chunk}-token chunk of logits), whichever is "
                  f"larger. In the table above, 'from the other rows' is that estimate calibrated without the row it "
                  f"predicts; 'shape alone' is `minigrpo plan`'s trainer and step terms with nothing measured (the "
                  f"runtime, cuda context or python, is not in it).", highlight=False)
    if gpu and not memory.hf_generation:
        console.print(f"with vLLM, give the engine what the trainer leaves: --gpu-memory-utilization about "
                      f"{max(0.1, min(0.9, 1 - max(r['peak GB'] for r in rows) / budget - 0.05)):.2f} "
                      f"at the largest setting measured")
    return rows


PLAN_GROUPS, PLAN_LENGTHS = (4, 8, 16), (256, 512, 1024, 2048)


def peak_agrees(plan, allocated_gb: float, within: float = 0.25) -> tuple[bool, str]:
    """A run's measured peak against the plan's estimate of the same thing, and the line that says so. The run
    logs torch's `max_memory_allocated` (`mem/peak_gb`): no CUDA context, no allocator cache. The plan's peak
    counts the context, so it is taken out; on a small model it alone was a third of the estimate.

    >>> from minigrpo.plan import Plan
    >>> small = Plan("T4", 14.75, "float16", "", "hf", "", trainer_gb=0.9, step_gb=0.3, peak_gb=1.2)
    >>> peak_agrees(small, 0.75)
    (True, "peak allocated memory 0.75 GB within 25% of the plan's 0.70 GB (its 1.20 GB less the CUDA context)")
    >>> peak_agrees(small, 1.2)[0]
    False
    """
    from minigrpo.plan import CUDA_CONTEXT_GB

    estimate = plan.peak_gb - (CUDA_CONTEXT_GB if plan.total_gb else 0.0)
    ok = abs(allocated_gb - estimate) <= within * estimate
    return ok, (f"peak allocated memory {allocated_gb:.2f} GB within {within:.0%} of the plan's {estimate:.2f} GB "
                f"(its {plan.peak_gb:.2f} GB less the CUDA context)")
