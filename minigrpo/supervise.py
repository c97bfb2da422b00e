"""`minigrpo train` (and every command that runs a user's code) on the command line: the work runs in a child
process, and this one watches it.

A run can end in ways nothing inside it can report: a tool, reward or environment calling `os._exit(0)` (the
exit status says success), the kernel's out-of-memory killer (the shell prints only `Killed`), a crash in
native code. The watcher forks before anything is loaded (the child shares its pages, so it costs no memory),
waits, and when the child ends without the command's end marker it says in one line what happened, the step
and stage the run was in, and how to continue, with a non-zero exit status.

The child reports where it is through a pipe (`progress`). It runs in a process group of its own, so every
signal reaches it once, through the watcher: Ctrl-C at a terminal, SIGINT sent to the command's pid (a
notebook's stop button, `Popen.send_signal`), SIGTERM and SIGHUP all finish the step, save a checkpoint and say
how to resume; Ctrl-Z stops both and `fg` continues both, and so do SIGSTOP and SIGCONT sent to the watcher. The child dies with its watcher (a script's
`Popen.kill()` kills the watcher alone), and each run folder is written by one process at a time (`run.py`'s
lock). Where the run leaves processes behind (a reward's forked helper still holding the terminal's output),
the watcher names them. The Python API and the notebooks train in their own process, unwatched.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # prctl(2)
# the commands that run rewards, tools or environments: each is watched (chat reads the terminal: not it)
WATCHED = ("train", "eval", "check-reward", "sample", "sft")

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
    watcher, kills_before = os.getpid(), oom_kills()
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # what the run's helpers leave behind becomes ours to name
    child = os.fork()
    if child == 0:
        os.close(read_fd)
        os.setpgid(0, 0)  # out of the terminal's group: signals come through the watcher, once
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the run dies with its watcher
        if os.getppid() != watcher:  # it died before the line above
            os._exit(1)
        _channel.update(fd=write_fd, pid=os.getpid())
        _name_hard_exits()
        threading.Thread(target=_pause_with, args=(watcher,), daemon=True).start()
        return None
    os.close(write_fd)
    seen: list[dict] = []
    reader = threading.Thread(target=_read_lines, args=(read_fd, seen), daemon=True)
    reader.start()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: _pass_on(child, signum))
    signal.signal(signal.SIGTSTP, lambda signum, frame: _stop_both(child))
    signal.signal(signal.SIGCONT, lambda signum, frame: _pass_on(child, signal.SIGCONT))  # after a SIGSTOP
    # polled, not a blocking wait: a SIGCONT after a SIGSTOP restarts a blocking wait4 inside the kernel, so its
    # handler (which wakes the run) would wait for the next other signal
    while not (ended := os.wait4(child, os.WNOHANG))[0]:
        time.sleep(0.1)
    _, status, usage = ended
    reader.join(timeout=2.0)  # a helper the child forked may still hold the pipe open
    where = {k: v for fields in list(seen) for k, v in fields.items()}
    left = left_behind(watcher)
    if left:
        print(f"minigrpo: {left}", file=sys.stderr, flush=True)
    if "finished" in where:
        return os.waitstatus_to_exitcode(status)
    oom = oom_kills() > kills_before if kills_before is not None else None
    who = "run" if argv[1] == "train" else f"command `minigrpo {argv[1]}`"
    print(f"minigrpo: {ending(status, where, usage.ru_maxrss / 2**20, oom, who)}", file=sys.stderr, flush=True)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else (code or 1)


def _pass_on(child: int, signum: int) -> None:
    try:
        os.kill(child, signum)
    except ProcessLookupError:
        pass


def _stop_both(child: int) -> None:
    """Ctrl-Z: the run stops with its watcher, and continues with it (`fg` sends the watcher SIGCONT)."""
    _pass_on(child, signal.SIGSTOP)
    signal.signal(signal.SIGTSTP, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTSTP)  # stops here until continued
    signal.signal(signal.SIGTSTP, lambda signum, frame: _stop_both(child))
    _pass_on(child, signal.SIGCONT)


def _pause_with(watcher: int) -> None:
    """In the run: SIGSTOP to the watcher (which no process can catch or pass on) stops the run too. The run looks
    at its watcher twice a second and stops itself while the watcher is stopped; the watcher's SIGCONT wakes it."""
    while True:
        time.sleep(0.5)
        if process_state(watcher) == "T":
            os.kill(os.getpid(), signal.SIGSTOP)


def process_state(pid: int) -> str | None:
    """A process's state letter from /proc (R, S, T for stopped, Z...), or None where it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def die_with_parent() -> None:
    """For a child between fork and exec (subprocess's preexec_fn): the kernel kills it when the process that
    started it ends, however that ends, so a benchmark killed from outside leaves no training run behind."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _prctl(option: int, value: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux's libc: the watcher works, less thoroughly
        pass


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed since boot (None where it does not say)."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def left_behind(watcher: int) -> str | None:
    """The run's processes still running after it ended (orphans come to the watcher, a subreaper), named."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == watcher and fields[0] != "Z":  # its parent is the watcher, and it is not a zombie
            found.append(f"pid {stat.parent.name}: {cmdline[:80] or '?'}")
    if not found:
        return None
    pids = " ".join(f.split(":")[0].removeprefix("pid ") for f in found)
    return (f"the run left {len(found)} process{'es' * (len(found) > 1)} running ({'; '.join(found)}); they may "
            f"hold this command's output open (a `| tee` waits for them): kill {pids}")


def finished() -> None:
    """The command's end marker: it returned, failed with its own message, or was stopped as asked."""
    progress(finished=True)


def ending(status: int, where: dict, peak_gb: float, oom: bool | None = None, who: str = "run") -> str:
    """One line: how the run (or `who`, another command) ended, where it was, and how to go on. `oom`: whether the
    kernel counted an out-of-memory kill meanwhile (None: it does not say).

    >>> ending(9, {"run": "runs/a", "step": 3, "stage": "update"}, 11.5, oom=True).split(": ")[0]
    'the run was killed by SIGKILL during step 3 (update), by the out-of-memory killer'
    >>> ending(9, {"run": "runs/a", "step": 3, "stage": "update"}, 1.7, oom=False).split(". ")[0]
    'the run was killed by SIGKILL during step 3 (update) from outside (the kernel counted no out-of-memory kill)'
    """
    code = os.waitstatus_to_exitcode(status)
    at = f"during step {where['step']} ({where.get('stage', 'starting')})" if "step" in where else \
        f"while {where.get('stage', 'starting')}" if "stage" in where or who == "run" else "before it finished"
    if code < 0:
        name = signal.Signals(-code).name
        what = f"the {who} was killed by {name} {at}"
        if name == "SIGKILL" and oom is not False:
            what += (f", {'by' if oom else 'most likely by'} the out-of-memory killer: host RAM {host_ram_gb():.1f} "
                     f"GB, the run's peak {peak_gb:.1f} GB (lower --prompts-per-step or -G, or --max-new-tokens; "
                     f"`minigrpo plan` sizes them)")
        elif name == "SIGKILL":
            what += " from outside (the kernel counted no out-of-memory kill)"
    else:
        caller = f" called at {where['exit_from']}" if "exit_from" in where else ""
        what = f"the {who} ended {at} with exit status {code} without finishing: os._exit({code}){caller}"
        if caller and not _saved(where.get("run")):  # before anything was saved, the fix is the caller's line
            return (f"{what}. os._exit ends the whole process: change {where['exit_from']} to return a value or "
                    f"raise, then run the same command again.")
    return f"{what}. {resume_hint(where.get('run'))}"


def _saved(run: str | None) -> bool:
    return bool(run) and (Path(run) / "config.json").exists()


def resume_hint(run: str | None) -> str:
    if not _saved(run):
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
