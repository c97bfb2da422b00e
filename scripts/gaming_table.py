"""The gaming detectors (minigrpo/hacking.py) replayed on finished runs: which fired, at which step, and the
furthest each detector's number went, as the markdown table of docs/results.md.

    python scripts/gaming_table.py runs/a runs/b ...             # the table
    python scripts/gaming_table.py runs/a --keep tests/data/gaming_runs   # and a copy of each run's logs

A run is named by its folder's name (a symbolic link names it otherwise).

A run is replayed exactly as it was watched: the same metrics, samples and evaluations, step by step, so a run
made before the detectors existed is measured as if they had been on. `--keep` copies what a replay reads
(config.json, metrics.jsonl, eval.jsonl, and samples.jsonl gzipped, without the advantages) for
tests/test_gaming_runs.py.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

from minigrpo import hacking, settle
from minigrpo.config import TrainConfig
from minigrpo.tasks import get_task

KEPT = ("step", "prompt", "completion", "reward", "reward_parts")
# how far each detector's number went, and which way is toward firing
FURTHEST = {"length": max, "one_answer": max, "dominance": max, "format_only": max, "spread": min, "held_out": min}


def replayed(folder: Path) -> dict:
    """One run, replayed: what fired and the furthest each number went."""
    cfg = TrainConfig.load(folder / "config.json")
    task = settle.run_task(get_task(cfg.task, cfg.rewards, extra_tools=cfg.tools, environment=cfg.environment), cfg)
    watch, found, steps = hacking.replay(folder, task)
    values: dict[str, list[float]] = {}
    for metrics in steps[2 * hacking.WINDOW - 1:]:  # from the first step a detector may fire
        for key, value in metrics.items():
            if key.startswith("hacking/") and not key.endswith("/fired"):
                values.setdefault(key.split("/")[1], []).append(value)
    evals = {e["step"]: e for e in hacking.read_lines(folder / "eval.jsonl")}
    first, last = (evals[min(evals)], evals[max(evals)]) if evals else (None, None)
    return {"run": folder.name, "task": cfg.task, "rewards": ", ".join(task.reward_names), "steps": len(watch.points),
            "pass@1": f"{first['pass@1']:.2f} -> {last['pass@1']:.2f}" if first else "",
            "fired": [(f.detector, f.step) for f in found],
            "furthest": {name: FURTHEST[name](v) for name, v in values.items()}}


def keep(folder: Path, into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "eval.jsonl"):
        if (folder / name).exists():
            shutil.copy(folder / name, into / name)
    config = json.loads((folder / "config.json").read_text())
    config["output_dir"] = f"runs/{into.name}"  # where it ran is no business of the copy's
    (into / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with gzip.open(into / "samples.jsonl.gz", "wt") as f:
        for sample in hacking.read_lines(folder / "samples.jsonl"):
            if "hacking" not in sample:
                f.write(json.dumps({k: sample[k] for k in KEPT if k in sample}, default=str) + "\n")


def table(rows: list[dict]) -> str:
    names = [n for n in hacking.NAMES if any(n in r["furthest"] for r in rows)]
    lines = ["| run | rewards | steps | held-out pass@1 | fired (step) | " + " | ".join(names) + " |",
             "|---|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        fired = ", ".join(f"{d} ({s})" for d, s in r["fired"]) or "none"
        cells = [f"{r['furthest'][n]:.2f}" if n in r["furthest"] else "" for n in names]
        lines.append(f"| {r['run']} | {r['rewards']} | {r['steps']} | {r['pass@1']} | {fired} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (metrics.jsonl, samples.jsonl, eval.jsonl)")
    parser.add_argument("--keep", type=Path, help="copy each run's logs into KEEP/<run name>")
    args = parser.parse_args()
    rows = []
    for folder in args.runs:
        rows.append(replayed(folder))
        if args.keep:
            keep(folder, args.keep / folder.name)
    print(table(rows))


if __name__ == "__main__":
    main()
