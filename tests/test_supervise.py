"""`minigrpo train` on the command line is watched: a run that ends without finishing says how, where it was,
and how to continue, with a non-zero exit status; Ctrl-C, SIGINT to its pid and SIGTERM still stop it cleanly; it
dies with its watcher, one process writes a run folder, and what it leaves running is named. Real processes and
real signals throughout."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minigrpo.errors import STOPPED_EXIT

REWARDS = '''import os, signal


def hard_exit(completions, completion_ids, **columns):
    if completion_ids and completion_ids[0]:  # a real rollout, not the checks before the model loads
        os._exit(0)
    return [0.0] * len(completions)


def killed(completions, completion_ids, **columns):
    if completion_ids and completion_ids[0]:  # as the out-of-memory killer would, but it is not the kernel
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)


def early_exit(completions, **columns):  # in the checks before any model loads
    os._exit(3)


def leaves_a_helper(completions, completion_ids, **columns):
    import subprocess
    if completion_ids and completion_ids[0] and not getattr(leaves_a_helper, "started", False):
        leaves_a_helper.started = True
        subprocess.Popen(["sleep", "317"])  # inherits the run's output, and outlives it
    return [0.0] * len(completions)
'''
SMALL = ["--no-eval-before-after", "--max-new-tokens", "8", "--prompts-per-step", "2", "-G", "4"]


def start(tmp_path: Path, *flags: str) -> subprocess.Popen:
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    return subprocess.Popen([sys.executable, "-m", "minigrpo.cli", "train", "--out", "run", *SMALL, *flags],
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


def test_a_killed_run_names_the_signal_and_blames_the_oom_killer_only_when_the_kernel_does(tmp_path):
    run = start(tmp_path, "--reward", "my_rewards.py:killed", "--steps", "2")
    out = run.communicate(timeout=600)[0]
    assert run.returncode == 128 + signal.SIGKILL, out
    line = out.strip().splitlines()[-1]
    assert "killed by SIGKILL during step 1 (rollout) from outside (the kernel counted no out-of-memory kill)" in line
    assert "out-of-memory killer:" not in line and line.endswith("minigrpo train --resume run")


def test_os_exit_before_anything_is_saved_names_the_line_to_fix(tmp_path):
    run = start(tmp_path, "--reward", "my_rewards.py:early_exit", "--steps", "2")
    out = run.communicate(timeout=600)[0]
    assert run.returncode == 3, out
    line = out.strip().splitlines()[-1]
    assert "os._exit(3) called at my_rewards.py:17" in line, out
    assert line.endswith("change my_rewards.py:17 to return a value or raise, then run the same command again."), line


def _first_step(run: subprocess.Popen, folder: Path) -> None:
    metrics, deadline = folder / "metrics.jsonl", time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().strip()) and run.poll() is None:
        assert time.monotonic() < deadline, "no step finished"
        time.sleep(0.2)


def _gone(pid: int, seconds: float = 60) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def test_a_killed_command_takes_its_run_along_and_one_process_writes_a_folder(tmp_path):
    """`Popen.kill()` (SIGKILL) reaches the watcher alone: the trainer went on as an orphan, and a `--resume`
    started next wrote the same folder beside it (steps 1, 3, 2, 4...). Now a second process on the folder is
    refused, naming the first, and the trainer dies with its watcher, which frees the folder."""
    run = start(tmp_path, "--steps", "30")
    try:
        _first_step(run, tmp_path / "run")
        holder = (tmp_path / "run" / ".lock").read_text()
        trainer = int(holder.split()[2])
        second = subprocess.run([sys.executable, "-m", "minigrpo.cli", "train", "--resume", "run"], cwd=tmp_path,
                                capture_output=True, text=True, timeout=600)
        assert second.returncode == 1 and f"run is being written by minigrpo process {trainer}" in second.stderr, \
            second.stdout + second.stderr
        assert "Traceback" not in second.stdout + second.stderr
    finally:
        run.kill()
        run.communicate(timeout=60)
    assert _gone(trainer), "the trainer outlived its watcher"
    with open(tmp_path / "run" / ".lock", "r+") as lock:  # the kernel dropped the lock with its process
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_what_a_run_leaves_running_is_named(tmp_path):
    run = start(tmp_path, "--reward", "my_rewards.py:leaves_a_helper", "--steps", "1")
    try:
        assert run.wait(timeout=600) == 0
    finally:  # the helper holds the output pipe open: end it, to read the output
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if cmdline.read_bytes() == b"sleep\x00317\x00":
                    os.kill(int(cmdline.parent.name), signal.SIGKILL)
            except (OSError, ValueError):
                pass
    out = run.communicate(timeout=60)[0]
    left = [line for line in out.splitlines() if "the run left" in line]
    assert left and "running (pid" in left[0] and "sleep 317" in left[0] and "kill " in left[0], out


@pytest.mark.parametrize("how", ["SIGTERM to the watcher", "Ctrl-C (SIGINT to the process group)",
                                 "SIGINT to the watcher (a notebook's stop button)"])
def test_a_stop_request_finishes_the_step_and_saves(tmp_path, how):
    run = start(tmp_path, "--steps", "30")
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().strip()) and run.poll() is None:
        assert time.monotonic() < deadline, "no step finished"
        time.sleep(0.2)
    if how.startswith("SIGTERM"):
        run.send_signal(signal.SIGTERM)  # to the watcher only, as `kill` would
    elif how.startswith("Ctrl-C"):
        os.killpg(run.pid, signal.SIGINT)  # to every process of the group, as a terminal's Ctrl-C does
    else:
        run.send_signal(signal.SIGINT)  # to the watcher only, as a notebook stops a subprocess
    out = run.communicate(timeout=600)[0]
    name = "SIGTERM" if how.startswith("SIGTERM") else "SIGINT"
    # stopped, not finished: its own exit status, no final adapter, and the folder says where and how to finish
    assert run.returncode == STOPPED_EXIT and f"stopped ({name} during step" in out, out
    assert "minigrpo: the run" not in out
    assert list((tmp_path / "run" / "checkpoints").glob("step-*"))
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) < 30
    assert not (tmp_path / "run" / "adapter").exists()
    stop = json.loads((tmp_path / "run" / "stopped.json").read_text())
    assert stop["step"] == steps[-1] and stop["how"].startswith(f"{name} during step {steps[-1]}"), stop
    from minigrpo.trained import adapter_folder

    with pytest.raises(ValueError, match=f"stopped before its end .* at step {steps[-1]} of 30.*--resume"):
        adapter_folder(tmp_path / "run")


def test_a_stopped_run_named_by_every_command_that_reads_its_adapter(tmp_path):
    """eval, sample and export of a stopped run: one line naming the step it stopped at and how to finish it, exit
    status 1, nothing written; graduate notes it and writes the TRL script (the recipe trains from the start)."""
    from typer.testing import CliRunner

    from minigrpo.cli.app import app

    run = start(tmp_path, "--steps", "3")
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().strip()) and run.poll() is None:
        assert time.monotonic() < deadline, "no step finished"
        time.sleep(0.2)
    run.send_signal(signal.SIGTERM)
    out = run.communicate(timeout=600)[0]
    assert run.returncode == STOPPED_EXIT, out
    folder = str(tmp_path / "run")
    for command in (["eval", "--task", "addition", "--adapter", folder], ["sample", "hi", "--adapter", folder],
                    ["export", folder, "--out", str(tmp_path / "exported")]):
        said = " ".join((result := CliRunner().invoke(app, command)).output.split())
        assert result.exit_code == 1 and "stopped before its end (SIGTERM during step" in said, (command, said)
        assert "finish it with minigrpo train --resume run;" in said, said  # the folder as the run was given it
    assert not (tmp_path / "exported").exists()
    graduated = CliRunner().invoke(app, ["graduate", folder, "--out", str(tmp_path / "trl")])  # the recipe goes on
    assert graduated.exit_code == 0 and "stopped before its end" in " ".join(graduated.output.split())
    # resumed to its end, the folder is a finished run's: tests/test_resume.py's SIGTERM test


@pytest.mark.parametrize("status, where, said", [
    (0, {"run": None, "stage": "checking the task and its rewards"},
     "the run ended while checking the task and its rewards with exit status 0 without finishing: os._exit(0). "
     "Nothing was saved; run the same command again."),
    (signal.SIGSEGV, {"step": 4, "stage": "update"}, "the run was killed by SIGSEGV during step 4 (update). "),
])
def test_how_an_ending_is_said(status, where, said):
    from minigrpo.supervise import ending

    assert ending(status << 8 if status == 0 else status, where, 1.0).startswith(said)


def test_every_command_that_runs_user_code_ends_non_zero_and_names_a_hard_exit(tmp_path):
    """`minigrpo eval` with a reward calling os._exit(0) exited 0, printing nothing, writing nothing."""
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    done = subprocess.run([sys.executable, "-m", "minigrpo.cli", "eval", "--task", "addition", "--reward",
                           "my_rewards.py:hard_exit", "--prompts", "1", "--samples", "1", "--max-new-tokens", "4"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("minigrpo: the command `minigrpo eval` ended") and "os._exit(0) called at my_rewards.py:6" \
        in line, done.stderr


BROKEN = '''def wrong_length(completions, **kwargs):
    return [1.0] * (len(completions) + 1)


def nothing(completions, **kwargs):
    return [None] * len(completions)
'''


@pytest.mark.parametrize("reward, code, says", [
    ("wrong_length", 1, "train would stop here, before loading the model"),
    ("nothing", 0, "returned None for every completion"),
])
def test_check_reward_fails_where_train_would_stop(tmp_path, reward, code, says):
    """`check-reward ... && minigrpo train ...` works: it exits non-zero exactly where train stops at once."""
    (tmp_path / "broken.py").write_text(BROKEN)
    done = subprocess.run([sys.executable, "-m", "minigrpo.cli", "check-reward", "--task", "addition", "--reward",
                           f"broken.py:{reward}", "--no-model"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == code and says in done.stdout + done.stderr, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


def test_a_run_whose_lock_file_is_removed_stops_without_writing_more(tmp_path):
    """The lock lives on `.lock`'s file: deleting it (a stale-lock cleanup) let a second `--resume` in beside the
    live run, and both wrote the folder (steps 1, 2, 2). Now the run checks before each write that its lock is
    still the folder's, and stops at once, in one line, writing nothing more."""
    run = start(tmp_path, "--steps", "30")
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().strip()) and run.poll() is None:
        assert time.monotonic() < deadline, "no step finished"
        time.sleep(0.2)
    (tmp_path / "run" / ".lock").unlink()
    logged = len(metrics.read_text().splitlines())
    out = run.communicate(timeout=600)[0]
    assert run.returncode == 1 and ".lock was removed or replaced" in " ".join(out.split()), out
    assert "Traceback" not in out
    assert len(metrics.read_text().splitlines()) <= logged + 1, "at most the step it had begun to write"
    assert not (tmp_path / "run" / "adapter").exists()


def test_a_folder_that_cannot_be_written_is_named_before_any_work(tmp_path, monkeypatch, tiny_model_path):
    """A read-only run folder (tests run as root, for whom every folder is writable: the fact is a stand-in):
    `train --resume` and `eval` of it say so in one line before loading anything (eval used to evaluate for 46 s,
    then fail writing eval.jsonl)."""
    from typer.testing import CliRunner

    import minigrpo.run
    from minigrpo.cli.app import app
    from minigrpo.config import TrainConfig

    folder = tmp_path / "run"
    (folder / "adapter").mkdir(parents=True)
    TrainConfig(steps=2).save(folder / "config.json")
    (folder / "adapter" / "adapter_config.json").write_text("{}")
    real = os.access
    monkeypatch.setattr(minigrpo.run.os, "access", lambda p, mode: False if Path(p) == folder else real(p, mode))
    for command in (["train", "--resume", str(folder)], ["eval", "--task", "addition", "--adapter", str(folder)]):
        result = CliRunner().invoke(app, command)
        said = " ".join(result.output.split())
        assert result.exit_code == 1 and f"{folder} is not writable" in said and "nothing was written" in said, said


def test_the_run_pauses_with_its_watcher_and_stops_when_its_reader_goes_away(tmp_path):
    """SIGSTOP cannot be caught or passed on: the watcher stopped and the run trained on. Now the run stops itself
    while its watcher is stopped, and the watcher's SIGCONT wakes it (states read from /proc, no fixed waits).
    Then `| head -1`: the reader closes the pipe; the run's next print ended it with rich's silent exit status 1.
    Now it says so on stderr, finishes the step and ends as a stopped run."""
    from minigrpo.supervise import process_state

    (tmp_path / "my_rewards.py").write_text(REWARDS)
    run = subprocess.Popen([sys.executable, "-m", "minigrpo.cli", "train", "--out", "run", *SMALL, "--steps", "30"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        for line in run.stdout:  # the first step's line
            if line.startswith("step "):
                break
        trainer = int((tmp_path / "run" / ".lock").read_text().split()[2])

        def until(state_is, what):
            deadline = time.monotonic() + 60
            while not state_is(process_state(trainer)):
                assert time.monotonic() < deadline, what
                time.sleep(0.05)

        os.kill(run.pid, signal.SIGSTOP)
        until(lambda state: state == "T", "the run did not stop with its watcher")
        os.kill(run.pid, signal.SIGCONT)
        until(lambda state: state not in ("T", None), "the run did not go on with its watcher")
        run.stdout.close()  # as `head` does once it has its line
        err = run.stderr.read()
        run.wait(timeout=600)
    finally:
        os.kill(run.pid, signal.SIGCONT) if run.poll() is None else None
    assert run.returncode == STOPPED_EXIT, err
    assert "the output's reader went away" in err and "Traceback" not in err, err
    stop = json.loads((tmp_path / "run" / "stopped.json").read_text())
    assert stop["how"].startswith("the output's reader went away during step"), stop
