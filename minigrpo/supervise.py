"""`minigrpo train` on the command line: the training runs in a child process, and this one watches it.

A run can end in ways nothing inside it can report: a tool, reward or environment calling `os._exit(0)` (the
exit status says success), the kernel's out-of-memory killer (the shell prints only `Killed`), a crash in
native code. The watcher forks before anything is loaded (the child shares its pages, so it costs no memory),
waits, and when the child ends without the command's end marker it says in one line what happened, the step
and stage the run was in, and how to continue, with a non-zero exit status.

The child reports where it is through a pipe (`progress`); Ctrl-C reaches it as before (the terminal signals
the whole process group; the watcher ignores it), and SIGTERM or SIGHUP sent to the watcher are passed on, so
both still finish the step, save a checkpoint and say how to resume. The Python API and the notebooks train
in their own process, unwatched.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

_channel = {"fd": -1, "pid": 0}  # set in the watched child only


def progress(**fields) -> None:
    """Tell the watcher where the run is (run=folder, step=N, stage=name); nothing when unwatched."""
    if _channel["fd"] < 0 or os.getpid() != _channel["pid"]:  # not in forked helpers of the child
        return
    try:
        os.write(_channel["fd"], (json.dumps(fields) + "\n").encode())
    except OSError:
        pass  # the watcher is gone: the run goes on


def watch(argv: list[str]) -> int | None:
    """In the command-line process: fork; the child returns None and runs the command, reporting through
    `progress` (and `finished()` at the end); this process waits and returns the exit status to use. Off
    Linux (no fork on Windows; macOS's system libraries are not safe to fork) the command runs unwatched."""
    if not sys.platform.startswith("linux"):
        return None
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_fd)
        _channel.update(fd=write_fd, pid=os.getpid())
        _name_hard_exits()
        return None
    os.close(write_fd)
    seen: list[dict] = []
    reader = threading.Thread(target=_read_lines, args=(read_fd, seen), daemon=True)
    reader.start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal sends Ctrl-C to the child as well
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: os.kill(child, signum))
    _, status, usage = os.wait4(child, 0)  # retried after each passed-on signal
    reader.join(timeout=2.0)  # a helper the child forked may still hold the pipe open
    where = {k: v for fields in list(seen) for k, v in fields.items()}
    if "finished" in where:
        return os.waitstatus_to_exitcode(status)
    print(f"minigrpo: {ending(status, where, usage.ru_maxrss / 2**20)}", file=sys.stderr, flush=True)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else (code or 1)


def finished() -> None:
    """The command's end marker: it returned, failed with its own message, or was stopped as asked."""
    progress(finished=True)


def ending(status: int, where: dict, peak_gb: float) -> str:
    """One line: how the run ended, where it was, and how to go on.

    >>> ending(9, {"run": "runs/a", "step": 3, "stage": "update"}, 11.5).split(": ")[0]
    'the run was killed by SIGKILL during step 3 (update), most likely by the out-of-memory killer'
    """
    code = os.waitstatus_to_exitcode(status)
    at = f"during step {where['step']} ({where.get('stage', 'starting')})" if "step" in where else \
        f"while {where.get('stage', 'starting')}"
    if code < 0:
        name = signal.Signals(-code).name
        what = f"the run was killed by {name} {at}"
        if name == "SIGKILL":
            what += (f", most likely by the out-of-memory killer: host RAM {host_ram_gb():.1f} GB, the run's peak "
                     f"{peak_gb:.1f} GB (lower --prompts-per-step or -G, or --max-new-tokens; `minigrpo plan` sizes them)")
    else:
        caller = f" called at {where['exit_from']}" if "exit_from" in where else ""
        what = f"the run ended {at} with exit status {code} without finishing: os._exit({code}){caller}"
    return f"{what}. {resume_hint(where.get('run'))}"


def resume_hint(run: str | None) -> str:
    if not run or not (Path(run) / "config.json").exists():
        return "Nothing was saved; run the same command again."
    saved = sorted(Path(run).glob("checkpoints/step-*"))
    since = f"from {saved[-1].name}" if saved else "from step 0 (no checkpoint was saved yet)"
    return f"Continue {since} with: minigrpo train --resume {run}"


def host_ram_gb() -> float:
    """The machine's memory, or the container's limit where one is set (Colab, Docker)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        total = min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        pass
    return total / 2**30


def _name_hard_exits() -> None:
    """`os._exit` skips every handler, so a user's call to it would end the run with no trace: record where
    it was called from before it runs (only in this process; forked helpers exit as they always do)."""
    real_exit = os._exit

    def named_exit(status: int) -> None:
        caller = sys._getframe(1)
        path = caller.f_code.co_filename
        inside = os.path.abspath(path).startswith(os.getcwd() + os.sep)
        progress(exit_from=f"{os.path.relpath(path) if inside else path}:{caller.f_lineno}")
        real_exit(status)

    os._exit = named_exit


def _read_lines(fd: int, into: list[dict]) -> None:
    with os.fdopen(fd, "rb") as pipe:
        for line in pipe:
            try:
                into.append(json.loads(line))
            except ValueError:
                pass
