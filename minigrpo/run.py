"""The run folder: the config verbatim, one metrics line per step, every sample, and the adapter.

    runs/<time>-<model>-<task>/
        config.json      the resolved TrainConfig
        metrics.jsonl    one JSON object per step
        samples.jsonl    every completion with its prompt, reward parts and advantage
        checkpoints/     step-N/: the adapter, optimizer and random state to resume from
        adapter/         PEFT format: PeftModel.from_pretrained(base, "adapter"); written when the run ends
        stopped.json     only while a run stopped before its end: where, and how to finish it
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from minigrpo.config import TrainConfig


LOCK_FILE = ".lock"  # held by the process writing the folder; its text names that process
STOPPED_FILE = "stopped.json"  # a run stopped before its end: where, how, and how to finish it


class RunFolder:
    def __init__(self, path: Path, report_to: list[str] = ()):
        self.path = Path(path)
        self.reporters = [_reporter(name, self.path) for name in report_to]
        self.lock_fd: int | None = None

    def lock(self) -> None:
        """Be the one process writing this folder (a second `--resume` of it, or a run still going after its
        caller gave up on it, is refused in one line naming the other). A POSIX lock: the kernel drops it when its
        process ends, however it ends, and the processes it forks do not hold it."""
        import fcntl

        writable(self.path, "the run folder")
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ValueError(f"{self.path} is being written by {holder}: wait for it to end, or stop it, then run "
                             f"this again (nothing was written)") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"minigrpo process {os.getpid()} (since {time.strftime('%H:%M:%S')})".encode())
        self.lock_fd = fd

    def refuse_if_lock_lost(self) -> None:
        """Still the one writer? The lock lives on `.lock`'s file: if that file was deleted (a stale-lock cleanup)
        or replaced, a second process may hold the folder's new one. Checked before each write; it stops this
        process without writing more, in one line."""
        if self.lock_fd is None:
            return
        held = os.fstat(self.lock_fd)
        try:
            now = os.stat(self.path / LOCK_FILE)
            same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
        except OSError:
            same = False
        if not same:
            raise LockLost(f"{self.path}/{LOCK_FILE} was removed or replaced while this run wrote the folder: "
                           f"another process may be writing it now, so this one stops without writing more "
                           f"(its last checkpoint is kept; leave {LOCK_FILE} alone while a run lives)")

    def unlock(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # closing it drops the lock; the file stays, empty of meaning
            self.lock_fd = None

    @classmethod
    def claim(cls, cfg: TrainConfig) -> "RunFolder":
        """The new run's folder (settle.run_folder names one where --out is not given), checked but not yet
        written: it must not exist, or be empty, and be writable. (A folder with anything in it is someone's:
        nothing is written there.)"""
        path = Path(cfg.output_dir)
        if (path / "config.json").exists():
            raise ValueError(f"--out {path} already holds a run: continue it with --resume, or pick a new "
                             f"folder (nothing was written)")
        usable_or_fail(path, "--out", may_hold_results=False)
        return cls(path, cfg.report_to)

    def start(self, cfg: TrainConfig) -> None:
        self.lock()
        cfg.save(self.path / "config.json")

    def log(self, metrics: dict, samples: list[dict]) -> None:
        self.refuse_if_lock_lost()
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        with open(self.path / "samples.jsonl", "a") as f:
            f.writelines(json.dumps(s, default=str) + "\n" for s in samples)  # a tool's own objects as text
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        for report in self.reporters:
            report(numbers, metrics["step"])

    def save_adapter(self, model) -> Path:
        self.refuse_if_lock_lost()
        out = self.path / "adapter"
        model.save_pretrained(out)
        return out

    def mark_stopped(self, saved_step: int, how: str) -> None:
        """Say in the folder that the run stopped before its end (every command that reads a run folder's adapter
        reads this): the step its last checkpoint holds, and how it stopped."""
        self.refuse_if_lock_lost()
        (self.path / STOPPED_FILE).write_text(json.dumps(
            {"step": saved_step, "how": how, "resume": f"minigrpo train --resume {self.path}"}) + "\n")

    def clear_stopped(self) -> None:
        (self.path / STOPPED_FILE).unlink(missing_ok=True)


def stopped_at(run: Path) -> str | None:
    """Where a run that stopped before its end stopped, and how to finish it (None: it did not stop early)."""
    marker = Path(run) / STOPPED_FILE
    if not marker.exists():
        return None
    stop = json.loads(marker.read_text())
    steps = TrainConfig.load(Path(run) / "config.json").steps
    return (f"{run} stopped before its end ({stop['how']}), at step {stop['step']} of {steps}: finish it with "
            f"{stop['resume']}")


class LockLost(ValueError):
    """This process no longer holds its run folder's lock."""


def writable(path: Path, what: str) -> None:
    """Fail now, in one line, where `path` (or the folder it would be made in) cannot be written: before the work,
    not after it."""
    existing = next(p for p in [Path(path), *Path(path).absolute().parents] if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path} is not writable ({existing}): make it writable, or copy the run to a "
                         f"folder you can write and use that (nothing was written)")


def results_folder(path: Path, flag: str) -> Path:
    """A folder for results (eval.jsonl, an export), made now, before the work."""
    path = Path(path)
    usable_or_fail(path, flag, may_hold_results=True)
    path.mkdir(parents=True, exist_ok=True)
    return path


def usable_or_fail(path: Path, flag: str, may_hold_results: bool) -> None:
    """Fail now, naming the flag, unless `path` is a new or empty folder that can be written (or, for
    results, a run folder or one with evaluations already, which results are appended to): a folder with
    other things in it is someone's."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file; give a folder")
    ours = may_hold_results and ((path / "config.json").exists() or (path / "eval.jsonl").exists())
    if not may_hold_results and (path / "config.json").exists():
        raise ValueError(f"{flag} {path} is a training run's folder; give a new folder (nothing was written)")
    if path.is_dir() and any(path.iterdir()) and not ours:
        raise ValueError(f"{flag} {path} is not empty and not a run folder; pick a "
                         f"new folder (nothing was written)")
    existing = next(p for p in [path, *path.absolute().parents] if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, so no folder can be made there")
    writable(path, flag)


def _reporter(name: str, path: Path):
    """A function(metrics, step) for TensorBoard or Weights & Biases; only ever made when asked for."""
    try:
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=str(path / "tensorboard"))

            def report(metrics, step):
                for key, value in metrics.items():
                    writer.add_scalar(key, value, step)
                writer.flush()

            return report
        import wandb

        wandb.init(project="minigrpo", name=path.name, dir=str(path), resume="allow")
        return lambda metrics, step: wandb.log(metrics, step=step)
    except ImportError as error:
        raise ValueError(f"--report-to {name} needs its package: pip install {name} ({error})") from None
