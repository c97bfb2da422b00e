"""`minigrpo train` on the command line is watched: a run that ends without finishing says how, where it was,
and how to continue, with a non-zero exit status; Ctrl-C and SIGTERM still stop it cleanly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REWARDS = '''import os, signal


def hard_exit(completions, completion_ids, **columns):
    if completion_ids and completion_ids[0]:  # a real rollout, not the checks before the model loads
        os._exit(0)
    return [0.0] * len(completions)


def killed(completions, completion_ids, **columns):
    if completion_ids and completion_ids[0]:  # as the out-of-memory killer would
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)
'''
SMALL = ["--no-eval-before-after", "--max-new-tokens", "8", "--prompts-per-step", "2", "-G", "4"]


def start(tmp_path: Path, *flags: str) -> subprocess.Popen:
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    return subprocess.Popen([sys.executable, "-m", "minigrpo.cli", "train", "--output-dir", "run", *SMALL, *flags],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # a process group of its own, as a terminal gives it


def test_a_reward_calling_os_exit_ends_the_run_named_and_non_zero(tmp_path):
    run = start(tmp_path, "--reward", "my_rewards.py:hard_exit", "--steps", "2")
    out = run.communicate(timeout=600)[0]
    assert run.returncode == 1, out
    line = out.strip().splitlines()[-1]
    assert line.startswith("minigrpo: the run ended during step 1 (rollout) with exit status 0 without finishing"), out
    assert "os._exit(0) called at my_rewards.py:6" in line
    assert line.endswith("Continue from step 0 (no checkpoint was saved yet) with: minigrpo train --resume run")


def test_a_killed_run_names_the_signal_and_the_likely_killer(tmp_path):
    run = start(tmp_path, "--reward", "my_rewards.py:killed", "--steps", "2")
    out = run.communicate(timeout=600)[0]
    assert run.returncode == 128 + signal.SIGKILL, out
    line = out.strip().splitlines()[-1]
    assert "killed by SIGKILL during step 1 (rollout), most likely by the out-of-memory killer: host RAM" in line
    assert "the run's peak" in line and line.endswith("minigrpo train --resume run")


@pytest.mark.parametrize("how", ["SIGTERM to the watcher", "Ctrl-C (SIGINT to the process group)"])
def test_a_stop_request_finishes_the_step_and_saves(tmp_path, how):
    run = start(tmp_path, "--steps", "30")
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().strip()) and run.poll() is None:
        assert time.monotonic() < deadline, "no step finished"
        time.sleep(0.2)
    if how.startswith("SIGTERM"):
        run.send_signal(signal.SIGTERM)  # to the watcher only, as `kill` would
    else:
        os.killpg(run.pid, signal.SIGINT)  # to every process of the group, as a terminal's Ctrl-C does
    out = run.communicate(timeout=600)[0]
    name = "SIGTERM" if how.startswith("SIGTERM") else "SIGINT"
    assert run.returncode == 0 and "stopped after step" in out and f"({name})" in out, out
    assert "minigrpo: the run" not in out
    assert list((tmp_path / "run" / "checkpoints").glob("step-*"))
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 30


@pytest.mark.parametrize("status, where, said", [
    (0, {"run": None, "stage": "checking the task and its rewards"},
     "the run ended while checking the task and its rewards with exit status 0 without finishing: os._exit(0). "
     "Nothing was saved; run the same command again."),
    (signal.SIGSEGV, {"step": 4, "stage": "update"}, "the run was killed by SIGSEGV during step 4 (update). "),
])
def test_how_an_ending_is_said(status, where, said):
    from minigrpo.supervise import ending

    assert ending(status << 8 if status == 0 else status, where, 1.0).startswith(said)
