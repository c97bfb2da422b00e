"""Result cards: does a setting learn a task, over several seeds, beside TRL on the same budget
(`minigrpo bench learn`).

Each seed trains in a fresh process and is evaluated on held-out rows never trained on, before, every
`--eval-every` steps and after; `--with-trl` trains the same task, rewards, model, LoRA, group size, prompts per
step, steps and sampling through TRL's GRPOTrainer (the script `minigrpo graduate` writes, on the cpu) and
evaluates its checkpoints with minigrpo's own evaluator on the same rows. The card is one JSON file and one
markdown row per trainer: the task, the model, the settings that differ from the defaults, a hash of the full
config, the seeds, the hardware, time, each seed's before and after, and the mean and standard error over
seeds of before, after and the paired gain. `minigrpo bench tables` writes docs/results.md's table from cards.

Time is counted two ways: `train_s`, the sum of the optimizer steps' seconds (generation, scoring, update, sync;
no evaluation, no loading), the same clock for both trainers; and `wall_s`, the whole process.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import platform
import re
import statistics
import time
from pathlib import Path

from minigrpo.bench.steps import run_child
from minigrpo.config import TrainConfig
from minigrpo.plot import read_jsonl

CARD_VERSION = 1
TRAINERS = ("minigrpo", "TRL GRPOTrainer")
NOT_SETTINGS = ("output_dir", "seed", "preset", "sample_every", "save_every", "eval_every", "eval_prompts",
                "eval_samples", "eval_before_after", "keep")  # the bench's own, or the record's: not the recipe
TABLE_START, TABLE_END = "<!-- cards: start -->", "<!-- cards: end -->"


def learn(task: str, seeds: list[int], settings: dict, eval_every: int, out: Path, with_trl: bool = False,
          emit=print) -> dict:
    """Train `task` under each seed (and through TRL), evaluate, and write the card into `out`, again after
    each run, so a card stopped part-way keeps what it measured: the same command with the seeds still to run
    adds them to it. Returns the card."""
    if not seeds or len(set(seeds)) < len(seeds):
        raise ValueError(f"--seed {seeds}: give at least one seed, each once")
    from minigrpo.tasks import get_task

    cfg = TrainConfig(task=task, **settings)  # a bad setting or task stops here, before anything runs
    get_task(task, cfg.rewards, extra_tools=cfg.tools, environment=cfg.environment)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{task}-{cfg.model}").strip("-")
    out = Path(out)
    path = out / f"{slug}.json"
    card = {"card": CARD_VERSION, "task": task, "model": cfg.model, "steps": cfg.steps,
            "settings": changed_settings(cfg), "config_hash": config_hash(cfg), "seeds": [],
            "eval": {"every": eval_every, "prompts": cfg.eval_prompts, "samples": cfg.eval_samples if eval_every else 0},
            "hardware": hardware(), "versions": stack_versions(), "date": datetime.date.today().isoformat(),
            "trainers": {}}
    card = added_to(json.loads(path.read_text()), card, path) if path.exists() else card
    todo = [(seed, trainer) for seed in seeds for trainer in TRAINERS[:2 if with_trl else 1]]
    for seed, trainer in todo:  # seed by seed, so a card stopped part-way compares like with like
        done = [r["seed"] for r in card["trainers"].get(trainer, {}).get("runs", [])]
        folder = out / "runs" / slug / f"{'minigrpo' if trainer == 'minigrpo' else 'trl'}-seed{seed}"
        if seed in done or folder.exists():  # another card's runs are never written over
            raise ValueError(f"{path if seed in done else folder}: seed {seed} of {trainer} is there already; give "
                             f"the seeds still to run, or another --out")
    for seed, trainer in todo:
        folder = out / "runs" / slug / f"{'minigrpo' if trainer == 'minigrpo' else 'trl'}-seed{seed}"
        run_settings = dict(settings, task=task, seed=seed, eval_every=eval_every, output_dir=str(folder))
        run = (train_minigrpo if trainer == "minigrpo" else train_trl)(run_settings)
        run.update(seed=seed, folder=str(folder.relative_to(out)))  # relative: a card moves with its runs
        emit(f"{task} seed {seed}, {trainer}: pass@1 {run['before']['pass@1']:.3f} -> "
             f"{run['after']['pass@1']:.3f}, reward {run['before']['reward']:.3f} -> {run['after']['reward']:.3f}; "
             f"{run['train_s']:.0f} s training, {run['wall_s']:.0f} s in all")
        runs = card["trainers"].setdefault(trainer, {"runs": []})["runs"]
        runs.append(run)
        card["trainers"][trainer]["summary"] = summarize(runs)
        card["seeds"] = sorted({r["seed"] for result in card["trainers"].values() for r in result["runs"]})
        card["trainers"] = {t: card["trainers"][t] for t in TRAINERS if t in card["trainers"]}
        path.write_text(json.dumps(card, indent=1) + "\n")
        path.with_suffix(".md").write_text(table([card]) + "\n")
    return card


def added_to(earlier: dict, new: dict, path: Path) -> dict:
    """The card in `path`, to which the new runs are added: only runs of one recipe, evaluation and machine
    share a card; anything else is refused, naming what differs."""
    if not isinstance(earlier, dict) or earlier.get("card") != CARD_VERSION:
        raise ValueError(f"{path} is not a result card of this version; give another --out")
    differs = [what for what in ("task", "eval") if earlier.get(what) != new[what]]
    if earlier.get("config_hash") != new["config_hash"]:
        differs.append(f"config (hash {earlier.get('config_hash')} there, {new['config_hash']} here)")
    if earlier["hardware"] != new["hardware"]:
        differs.append(f"machine ({describe_hardware(earlier['hardware'])} there, "
                       f"{describe_hardware(new['hardware'])} here)")
    if differs:
        raise ValueError(f"{path} holds a card with another {' and '.join(differs)}: its seeds and these would not "
                         f"be one sample; give another --out")
    return earlier


def changed_settings(cfg: TrainConfig) -> dict:
    """The card's recipe: every field that differs from what `--model` and `--task` alone would give."""
    plain = dataclasses.asdict(TrainConfig(model=cfg.model, task=cfg.task))
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_SETTINGS and plain[k] != v}


def config_hash(cfg: TrainConfig) -> str:
    """The full config's fingerprint, less the seed and where it writes: two cards with one hash ran one recipe."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("output_dir", "seed", "preset")}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def hardware() -> dict:
    """The machine a card's time came from: the GPU's name, or the CPU's model, flags that change speed, threads."""
    import torch

    if torch.cuda.is_available():
        return {"gpu": torch.cuda.get_device_name(0), "cpu": None, "threads": torch.get_num_threads()}
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    flag_line = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
    flags = set(flag_line.group(1).split()) if flag_line else set()
    isa = [f for f in ("avx512_bf16", "amx_bf16") if f in flags] or (["avx512f"] if "avx512f" in flags else
                                                                    ["avx2"] if "avx2" in flags else [])
    from minigrpo.hardware import cpu_has_bf16

    if isa and isa[0].endswith("_bf16") and not cpu_has_bf16():  # torch capped (ONEDNN_MAX_CPU_ISA=AVX2 ...)
        isa = ["capped at avx2"]
    return {"gpu": None, "cpu": (name.group(1).strip() if name else platform.processor()) or "unknown cpu",
            "cpu_flags": isa, "threads": torch.get_num_threads()}


def describe_hardware(hw: dict) -> str:
    """'AMD EPYC (avx2), 2 threads' or the GPU's name."""
    if hw.get("gpu"):
        return hw["gpu"]
    flags = f" ({', '.join(hw['cpu_flags'])})" if hw.get("cpu_flags") else ""
    return f"{hw['cpu']}{flags}, {hw['threads']} threads"


def stack_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("minigrpo", "torch", "transformers", "peft", "trl"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


# --- one run of each trainer, each in a fresh process ---------------------------------------------------------

def train_minigrpo(settings: dict) -> dict:
    """minigrpo's `train` with these settings; its own evaluations (eval.jsonl) and step times (metrics.jsonl)."""
    folder = Path(settings["output_dir"])
    start = time.perf_counter()
    run_child("import json, sys; from minigrpo import TrainConfig, train; train(TrainConfig(**json.loads(sys.argv[1])))",
              [json.dumps(dict(settings, sample_every=0))])
    wall = time.perf_counter() - start
    steps = [m for m in read_jsonl(folder / "metrics.jsonl") if "time/step" in m]
    return run_record(read_jsonl(folder / "eval.jsonl"), clock(steps), wall, folder)


def train_trl(settings: dict) -> dict:
    """TRL's GRPOTrainer on the same settings (graduate's mapping, on the cpu), a checkpoint at each evaluation
    step; then every checkpoint, and the base model, evaluated by minigrpo's evaluator in a second process."""
    folder = Path(settings["output_dir"])
    start = time.perf_counter()
    run_child("import json, sys; from minigrpo.bench.learn import _trl_child; _trl_child(json.loads(sys.argv[1]))",
              [json.dumps(settings)])
    wall = time.perf_counter() - start
    run_child("import sys; from minigrpo.bench.learn import _evaluate_checkpoints; _evaluate_checkpoints(sys.argv[1])",
              [str(folder)])
    steps = read_jsonl(folder / "steps.jsonl")
    return run_record(read_jsonl(folder / "eval.jsonl"), clock(steps), wall, folder)


def _trl_child(settings: dict) -> None:
    from transformers import TrainerCallback

    from minigrpo.bench.trl import graduated_trainer

    cfg = TrainConfig(**settings)
    folder = Path(cfg.output_dir)
    folder.mkdir(parents=True, exist_ok=False)  # a fresh folder: nothing of an earlier run mixed in
    cfg.save(folder / "config.json")  # the evaluator loads the base as the minigrpo run does
    every = cfg.eval_every or cfg.steps  # a checkpoint at each evaluation step, all kept
    trainer = graduated_trainer(dataclasses.replace(cfg, save_every=every, keep=cfg.steps), folder, cpu=True)

    class Clock(TrainerCallback):  # the optimizer step's own seconds, as minigrpo's time/step
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            with open(folder / "steps.jsonl", "a") as f:
                f.write(json.dumps({"step": state.global_step, "time/step": time.perf_counter() - self.start}) + "\n")

    trainer.add_callback(Clock())
    trainer.train()
    last = folder / "trl" / f"checkpoint-{cfg.steps}"
    if not last.exists():  # the trainer saves every `every` steps; the final adapter is evaluated too
        trainer.save_model(str(last))


def _evaluate_checkpoints(folder: str) -> None:
    """The base model (step 0) and each of TRL's checkpoints, through the evaluator minigrpo's runs use."""
    from minigrpo.evaluate import Evaluator
    from minigrpo.generate.hf import HFGenerator
    from minigrpo.model import seed_everything
    from minigrpo.trained import load_trained
    from minigrpo.tasks import get_task

    folder = Path(folder)
    cfg = TrainConfig.load(folder / "config.json")
    task = get_task(cfg.task, cfg.rewards, cfg.tools, environment=cfg.environment)
    checkpoints = sorted((folder / "trl").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    for step, adapter in [(0, None)] + [(int(p.name.split("-")[1]), p) for p in checkpoints]:
        seed_everything(cfg.seed)  # as minigrpo's own run seeds before its evaluations
        policy, tokenizer, _ = load_trained(adapter, cfg.model, dtype=cfg.dtype, bf16_base=cfg.bf16_base,
                                            load_in_4bit=cfg.load_in_4bit)
        evaluate = Evaluator(cfg, task, tokenizer, HFGenerator(policy, tokenizer), folder)
        evaluate(step, with_samples=bool(cfg.eval_every))


def clock(steps: list[dict]) -> list[tuple[int, float]]:
    """(step, seconds of training up to and including it)."""
    total, out = 0.0, []
    for m in sorted(steps, key=lambda m: m["step"]):
        total += m["time/step"]
        out.append((m["step"], total))
    return out


def run_record(evals: list[dict], steps_clock: list[tuple[int, float]], wall: float, folder: Path) -> dict:
    """One run's before, after and curve, from its evaluations (keyed by step) and its clock."""
    at = dict(steps_clock)
    evals = sorted((e for e in evals if e.get("step") is not None), key=lambda e: e["step"])
    if len(evals) < 2:
        raise RuntimeError(f"the run in {folder} has {len(evals)} evaluation(s); a card needs one before and one after")
    curve = [{"step": e["step"], "train_s": round(at.get(e["step"], 0.0), 2), "pass@1": e["pass@1"],
              "reward": e["reward/mean"]} for e in evals]
    def point(e: dict) -> dict:  # with the share of prompts given the commonest answer, where the task has answers
        share = {"top_answer": e["greedy/top_answer_share"]} if "greedy/top_answer_share" in e else {}
        return {"pass@1": e["pass@1"], "reward": e["reward/mean"], **share}

    return {"before": point(evals[0]), "after": point(evals[-1]), "curve": curve,
            "train_s": round(steps_clock[-1][1] if steps_clock else 0.0, 1), "wall_s": round(wall, 1)}


# --- summaries and tables ----------------------------------------------------------------------------------------

def mean_se(values: list[float]) -> dict:
    """Mean and standard error (None for one value).

    >>> mean_se([0.5, 0.7, 0.9])
    {'mean': 0.7, 'se': 0.1155}
    """
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return {"mean": round(statistics.fmean(values), 4), "se": None if se is None else round(se, 4)}


def summarize(runs: list[dict]) -> dict:
    """Over seeds: before, after and the paired gain (after - before, seed by seed) of pass@1 and reward."""
    out = {}
    for key in ("pass@1", "reward"):
        out[key] = {"before": mean_se([r["before"][key] for r in runs]),
                    "after": mean_se([r["after"][key] for r in runs]),
                    "gain": mean_se([r["after"][key] - r["before"][key] for r in runs])}
    if all("top_answer" in r["after"] for r in runs):
        out["top_answer"] = {"after": mean_se([r["after"]["top_answer"] for r in runs])}
    out["train_s"] = mean_se([r["train_s"] for r in runs])
    return out


def _pm(x: dict, scale: float = 100.0, sign: bool = False) -> str:
    """A mean ± se in points: '+31.2 ± 2.1' (no ± with one seed)."""
    text = f"{x['mean'] * scale:{'+' if sign else ''}.1f}"
    return text + (f" ± {x['se'] * scale:.1f}" if x["se"] is not None else "")


HEADER = ("| task | model | trainer | seeds | steps | pass@1 before | pass@1 after | gain (points) | "
          "one answer after | reward before → after | training s / seed | hardware |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def table(cards: list[dict]) -> str:
    """The results table: one row per card and trainer, pass@1 in points (mean ± standard error over seeds);
    "one answer after", the share of held-out prompts given the trained model's commonest answer: a model that
    answers everything alike scores that answer's share of the rows, which is no skill."""
    rows = [HEADER]
    for card in cards:
        for trainer, result in card["trainers"].items():
            s = result["summary"]
            rows.append(f"| {card['task']} | {card['model']} | {trainer} | {len(result['runs'])} | {card['steps']} | "
                        f"{_pm(s['pass@1']['before'])} | {_pm(s['pass@1']['after'])} | "
                        f"{_pm(s['pass@1']['gain'], sign=True)} | "
                        f"{_pm(s['top_answer']['after']) if 'top_answer' in s else '-'} | "
                        f"{s['reward']['before']['mean']:.3f} → "
                        f"{s['reward']['after']['mean']:.3f} | {s['train_s']['mean']:.0f} | "
                        f"{describe_hardware(card['hardware'])} |")
    return "\n".join(rows)


def read_cards(folder: Path) -> list[dict]:
    """The cards in a folder, by file name; a JSON file that is not a card is an error naming it."""
    if not Path(folder).is_dir():
        raise ValueError(f"{folder} is not a folder of result cards (bench learn --out's)")
    cards = []
    for path in sorted(Path(folder).glob("*.json")):
        card = json.loads(path.read_text())
        if not isinstance(card, dict) or card.get("card") != CARD_VERSION:
            raise ValueError(f"{path} is not a result card of this version (its 'card' field is not {CARD_VERSION})")
        cards.append(card)
    if not cards:
        raise ValueError(f"{folder} holds no result cards (NAME.json, written by bench learn)")
    return cards


def write_tables(folder: Path, page: Path) -> str:
    """Put the cards' table between the page's markers (the rest of the page as it was); returns the table."""
    if not Path(page).is_file():
        raise ValueError(f"--page {page}: no such file; give a markdown page with the cards markers")
    text = Path(page).read_text()
    if TABLE_START not in text or TABLE_END not in text:
        raise ValueError(f"{page} has no {TABLE_START} ... {TABLE_END} markers to put the table between")
    block = table(read_cards(folder))
    head, rest = text.split(TABLE_START, 1)
    Path(page).write_text(f"{head}{TABLE_START}\n{block}\n{TABLE_END}{rest.split(TABLE_END, 1)[1]}")
    return block
