"""Running model-written code where it cannot touch the tests, the machine, or the verdict.

Tests are data, not code: a function name and a list of (arguments, expected result) pairs. The program
runs in a child process that receives only the arguments; it sends back what the function returned, and
the parent, which alone holds the expected results, decides. So a program that exits early, patches the
assertions, or prints "all tests passed" gains nothing: no results, or wrong ones, score as a failure.

The child is an isolated interpreter (`python -I -S`: no site-packages, no user paths) in a fresh empty
directory, with a scrubbed environment, a wall-clock timeout, and limits on cpu time, memory, file size
and processes; where the kernel allows it (as root), it also gets a new, empty network namespace. Inside
the child, an audit hook (which the program cannot remove) refuses sockets, subprocesses, forks, ctypes,
and any file access outside its directory other than reading Python's own library. The whole process
group is killed when the child ends or times out, and the directory is removed.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass

HARNESS = r"""
import json, os, sys
job = json.loads(sys.stdin.read())
sys.stdin.close()
results = os.fdopen(int(job["fd"]), "w")
root = os.path.realpath(os.getcwd())
readable = tuple({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix) + tuple(sys.path) if p})
NO_IMPORT = {"_posixsubprocess", "_ctypes", "ctypes", "_socket", "socket", "_multiprocessing", "multiprocessing",
             "_signal", "signal", "pty", "resource", "mmap", "_winapi", "fcntl"}
BLOCKED = ("socket.", "subprocess.", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
           "os.kill", "os.killpg", "ctypes.", "pty.", "signal.pthread_kill", "os.putenv", "os.unsetenv", "sys.addaudithook")
def guard(event, args):
    if event == "import" and args[0].partition(".")[0] in NO_IMPORT:
        raise ImportError(f"sandbox: importing {args[0]} is not allowed")
    if event.startswith(BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event in ("open", "os.listdir", "os.scandir", "os.mkdir", "os.remove", "os.rename", "os.rmdir", "os.chmod",
                 "os.chown", "os.truncate", "os.symlink", "os.link", "os.utime", "shutil.rmtree"):
        path = args[0]
        if isinstance(path, int):
            return
        path = os.path.realpath(os.fsdecode(path))
        inside = path == root or path.startswith(root + os.sep)
        mode = args[1] if event == "open" and len(args) > 1 and isinstance(args[1], str) else ""
        reading = event in ("open", "os.listdir", "os.scandir") and not any(c in mode for c in "wax+")
        if event == "open" and len(args) > 2 and isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR):
            reading = False
        if not inside and not (reading and path.startswith(readable)):
            raise PermissionError(f"sandbox: {event} {path} is outside the sandbox")
sys.addaudithook(guard)
namespace = {"__name__": "solution"}
outputs = []
try:
    exec(compile(job["program"], "solution.py", "exec"), namespace)
    fn = namespace[job["function"]]
    for args in job["inputs"]:
        try:
            outputs.append({"value": fn(*args)})
        except BaseException as error:
            outputs.append({"error": type(error).__name__})
except BaseException as error:
    outputs = {"error": f"{type(error).__name__}: {error}"[:300]}
results.write(json.dumps(outputs, default=repr))
results.close()
os._exit(0)
"""


@dataclass
class Verdict:
    passed: int  # tests whose result equals the expected one
    total: int
    reason: str  # "ok", or why the program scored less: "timeout", "crashed: ...", "wrong answer on test 2"

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def run_tests(program: str, function: str, tests: list[tuple[list, object]], *, timeout: float = 5.0,
              memory_mb: int = 512, cpu_seconds: int = 5) -> Verdict:
    """Run `function` of `program` on each test's arguments in a sandboxed child; compare here."""
    if os.name != "posix":
        raise RuntimeError("the code sandbox needs Linux or macOS (process limits, process groups); "
                           "run code tasks there, or under WSL on Windows")
    workdir = tempfile.mkdtemp(prefix="minigrpo-sandbox-")
    read_fd, write_fd = os.pipe()
    received: list[bytes] = []
    job = json.dumps({"program": program, "function": function, "inputs": [args for args, _ in tests],
                      "fd": write_fd})
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", HARNESS], cwd=workdir, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(write_fd,), start_new_session=True,
            preexec_fn=lambda: _confine(memory_mb, cpu_seconds),
        )
        os.close(write_fd)
        write_fd = -1
        reader = threading.Thread(target=_read_all, args=(read_fd, received), daemon=True)
        reader.start()  # read while the child runs, so a large result cannot block it on a full pipe
        try:
            child.stdin.write(job.encode())
            child.stdin.close()
        except BrokenPipeError:
            pass
        try:
            child.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(child)
        reader.join(timeout=1.0)
        raw = b"".join(received)
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(workdir, ignore_errors=True)
    if timed_out:
        return Verdict(0, len(tests), "timeout")
    try:
        outputs = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return Verdict(0, len(tests), "no results (the program exited or crashed before the tests ran)")
    if isinstance(outputs, dict) or not isinstance(outputs, list) or len(outputs) != len(tests):
        detail = outputs.get("error", "") if isinstance(outputs, dict) else "malformed results"
        return Verdict(0, len(tests), f"crashed: {detail}")
    passed, first_wrong = 0, None
    for i, ((_, expected), out) in enumerate(zip(tests, outputs)):
        if isinstance(out, dict) and "value" in out and _same(out["value"], expected):
            passed += 1
        elif first_wrong is None:
            first_wrong = i
    return Verdict(passed, len(tests), "ok" if first_wrong is None else f"wrong answer on test {first_wrong}")


def _same(got, expected) -> bool:
    # results cross a JSON boundary: compare as JSON does (tuples are lists), floats with a tolerance
    if isinstance(expected, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return abs(got - expected) <= 1e-6 * max(1.0, abs(expected))
    return json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)


def _read_all(fd: int, into: list[bytes], limit: int = 1 << 20) -> None:
    size = 0
    while size < limit:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        into.append(chunk)
        size += len(chunk)


def _confine(memory_mb: int, cpu_seconds: int) -> None:
    """Runs in the child between fork and exec."""
    import resource  # POSIX only, like the rest of the confinement

    limits = {resource.RLIMIT_CPU: cpu_seconds, resource.RLIMIT_AS: memory_mb << 20,
              resource.RLIMIT_FSIZE: 1 << 20, resource.RLIMIT_NPROC: 64, resource.RLIMIT_CORE: 0}
    for kind, value in limits.items():
        resource.setrlimit(kind, (value, value))
    if os.geteuid() == 0:
        try:  # an empty network namespace: no interfaces, no network at all
            ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET
        except Exception:
            pass  # the audit hook still refuses sockets


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()
