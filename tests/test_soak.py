"""Soak: hundreds of steps on the tiny model, checkpointing every few steps, stopped again and again at random
moments by SIGTERM (a clean stop) or SIGKILL (anywhere, mid-save included), resumed each time. It must end with
every step logged exactly once and a loadable latest checkpoint. Minutes long: run it with `pytest -m soak`."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from minigrpo import TrainConfig, checkpoint

STEPS = int(os.environ.get("MINIGRPO_SOAK_STEPS", "300"))


@pytest.mark.soak
def test_soak(tmp_path):
    run = tmp_path / "run"
    settings = dict(steps=STEPS, num_generations=2, prompts_per_step=1, max_new_tokens=8, save_every=3, keep=2,
                    sample_every=0, seed=0, output_dir=str(run))
    rng = random.Random(0)
    code = ("import json, sys; from minigrpo import TrainConfig, train; cfg = TrainConfig(**json.loads(sys.argv[1])); "
            "train(cfg, resume=sys.argv[2] == 'resume')")
    starts, terms, kills, began = 0, 0, 0, time.time()
    while not _done(run):
        mode = "resume" if checkpoint.latest(run) else "new"
        if mode == "new":  # killed before its first checkpoint: start over
            shutil.rmtree(run, ignore_errors=True)
        proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(settings), mode],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        starts += 1
        try:
            proc.wait(timeout=rng.uniform(15, 60))  # long enough to load the model and train a few steps
        except subprocess.TimeoutExpired:
            if rng.random() < 0.5:
                proc.send_signal(signal.SIGTERM)
                terms += 1
            else:
                proc.kill()
                kills += 1
            proc.wait()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    latest = checkpoint.latest(run)
    print(f"soak: {STEPS} steps in {time.time() - began:.0f} s, {starts} starts, {terms} SIGTERM, {kills} SIGKILL; "
          f"latest checkpoint {latest.name}")
    assert steps == list(range(1, STEPS + 1)), "every step logged exactly once, in order"
    assert latest.name == f"step-{STEPS:06d}"
    assert not list((run / "checkpoints").glob(".partial-*"))
    TrainConfig.load(run / "config.json")


def _done(run) -> bool:
    latest = checkpoint.latest(run)
    return latest is not None and latest.name == f"step-{STEPS:06d}"
