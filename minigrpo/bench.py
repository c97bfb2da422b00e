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
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from minigrpo.config import TrainConfig


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


def run_variant(settings: dict) -> list[dict]:
    """Train in a fresh process with these settings; its per-step metrics."""
    with tempfile.TemporaryDirectory(prefix="minigrpo-bench-") as tmp:
        cfg = dict(settings, output_dir=str(Path(tmp) / "run"), sample_every=0)
        code = ("import json, sys; from minigrpo import TrainConfig, train; "
                "train(TrainConfig(**json.loads(sys.argv[1])))")
        subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
