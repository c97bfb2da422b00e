"""`minigrpo plot runs/<run>`: the curves of a run as PNG files, with matplotlib.

One figure with a panel per figure of merit: reward (and each reward part), the share of groups whose
rewards differ, held-out evaluation when the run has one, KL, completion length, and seconds per step; a dashed
red line marks each step where a gaming detector fired.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """The records of a log; a half-written line (a run killed mid-write) is left out."""
    records = []
    for line in path.read_text(errors="replace").split("\n") if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return records


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").exists():
        raise ValueError(f"{run_dir} is not a run folder (it has no config.json)")
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if not m.get("skipped")]
    if not metrics:
        raise ValueError(f"{run_dir} has no metrics to plot")
    evals = [e for e in read_jsonl(run_dir / "eval.jsonl") if e.get("step") is not None]
    steps = [m["step"] for m in metrics]
    parts = sorted({k for m in metrics for k in m if k.startswith("reward/") and k.endswith("/mean")
                    and k != "reward/mean"})
    panels = [
        ("reward (train)", [("reward/mean", "total")] + [(k, k[len("reward/"):-len("/mean")]) for k in parts]),
        ("share of groups with reward spread", [("frac_groups_reward_differs", "spread")]),
        ("KL to the reference", [("kl", "kl")]),
        ("completion length (tokens)", [("completion_len/mean", "mean"), ("completion_len/max", "max")]),
        ("seconds per step", [("time/step", "step"), ("time/generate", "generate"), ("time/train", "train")]),
    ]
    n = len(panels) + bool(evals)
    fig, axes = plt.subplots(n, 1, figsize=(8, 2.4 * n), sharex=True)
    if evals:
        ax = axes[0]
        for key, label in (("reward/mean", "mean reward"), ("pass@1", "pass@1 (greedy)")):
            ys = [e[key] for e in evals]
            errs = [e.get(key + "/stderr" if key == "pass@1" else "reward/stderr", 0) for e in evals]
            ax.errorbar([e["step"] for e in evals], ys, yerr=errs, marker="o", capsize=3, label=label)
        n = max(e["samples_per_prompt"] for e in evals)
        for key in (f"sampled/pass@{n}", f"sampled/maj@{n}"):  # where the full evaluations report them
            have = [e for e in evals if key in e]
            if have and n > 1:
                ax.errorbar([e["step"] for e in have], [e[key] for e in have], yerr=[e[key + "/stderr"] for e in have],
                            marker="s", capsize=3, linestyle="--", label=f"{key.split('/')[1]} (sampled)")
        ax.set_title(f"held-out evaluation ({evals[0]['prompts']} prompts, "
                     f"{f'{n} samples each' if n else 'greedy'})")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax, (title, series) in zip(axes[bool(evals):], panels):
        for key, label in series:
            ys = [m.get(key) for m in metrics]
            if any(y is not None for y in ys):
                ax.plot(steps, [float("nan") if y is None else y for y in ys], label=label)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
    mark_gaming(axes, metrics)
    axes[-1].set_xlabel("step")
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    fig.suptitle(f"{config.get('model', '')} on {config.get('task', '')}: {run_dir.name}", fontsize=10)
    fig.tight_layout()
    out = png_path(out, run_dir, "curves.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def mark_gaming(axes, metrics: list[dict]) -> None:
    """A dashed red line on every panel at each step where a gaming detector fired (minigrpo/hacking.py), named on
    the top panel."""
    for m in metrics:
        for name in sorted(k.split("/")[1] for k in m if k.startswith("hacking/") and k.endswith("/fired")):
            for ax in axes:
                ax.axvline(m["step"], color="tab:red", linestyle="--", linewidth=1)
            axes[0].annotate(f"gamed? {name}", (m["step"], 1), xycoords=("data", "axes fraction"), color="tab:red",
                             fontsize=7, rotation=90, va="top", ha="right")


def png_path(out: Path | None, beside: Path, name: str) -> Path:
    """Where the picture goes: `out` itself, inside `out` where it is a folder (or written as one, `out/`), or
    `name` in `beside`; a path without a suffix gets .png, so the path said is the path written.

    >>> import tempfile; folder = Path(tempfile.mkdtemp())
    >>> png_path(folder, Path("run"), "curves.png") == folder / "curves.png", png_path(None, Path("run"), "c.png")
    (True, PosixPath('run/c.png'))
    >>> png_path(Path("figures/curves"), Path("run"), "c.png")
    PosixPath('figures/curves.png')
    """
    if out is None:
        return Path(beside) / name
    if Path(out).is_dir() or str(out).endswith("/"):
        Path(out).mkdir(parents=True, exist_ok=True)
        return Path(out) / name
    return Path(out) if Path(out).suffix else Path(out).with_suffix(".png")


def read_card(path: Path) -> dict:
    """A result card (`bench learn`'s NAME.json), or one line naming the file and what is wrong with it."""
    text = Path(path).read_text(errors="replace") if Path(path).is_file() else None
    if text is None:
        raise ValueError(f"{path}: no such file; give a result card (bench learn's NAME.json) or a run folder")
    if not text.strip():
        raise ValueError(f"{path} is empty: not a result card (bench learn writes them)")
    try:
        card = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error.msg}, line {error.lineno}): not a result card") from None
    missing = [key for key in ("trainers", "eval", "model", "task", "steps", "seeds") if
               not isinstance(card, dict) or key not in card]
    if missing:
        raise ValueError(f"{path} is not a result card (bench learn writes them): it has no {', '.join(missing)}")
    return card


def plot_card(card_path: Path, out: Path | None = None) -> Path:
    """A result card's held-out pass@1 against seconds of training, a line per seed, a colour per trainer
    (`minigrpo bench learn --eval-every N` gives each line its points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    card = read_card(Path(card_path))
    fig, ax = plt.subplots(figsize=(7, 4))
    for colour, (trainer, result) in zip(("tab:blue", "tab:orange", "tab:green"), card["trainers"].items()):
        for i, run in enumerate(result["runs"]):
            curve = run["curve"]
            ax.plot([p["train_s"] for p in curve], [p["pass@1"] for p in curve], marker="o", color=colour, alpha=0.8,
                    label=trainer if i == 0 else None)
    ax.set_xlabel("seconds of training (generation, scoring and update; evaluation left out)")
    ax.set_ylabel(f"held-out pass@1 ({card['eval']['prompts']} prompts, greedy)")
    ax.set_title(f"{card['model']} on {card['task']}: {card['steps']} steps, seeds {card['seeds']}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = png_path(out, Path(card_path).parent, Path(card_path).with_suffix(".png").name)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
