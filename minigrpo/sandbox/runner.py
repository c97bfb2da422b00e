"""Running model-written code where it cannot touch the tests, the machine, or the verdict.

Tests are data, not code: a function name and a list of (arguments, expected result) pairs. The program
runs in a child process that receives only the arguments; it sends back what the function returned, and
the parent, which alone holds the expected results, decides. So a program that exits early, patches the
assertions, or prints "all tests passed" gains nothing: no results, or wrong ones, score as a failure.

The child (`minigrpo/sandbox/confine.py`) is an isolated interpreter (`python -I -S`: no site-packages) with a
scrubbed environment, confined by the kernel: rlimits, new user/pid/network namespaces, a root of its own
(the standard library and shared libraries read-only and an empty folder: nothing else exists for it, not even
for `stat`), Landlock for the filesystem and seccomp for system calls (what each does: the package's docstring). The
parent kills its process group at the wall-clock timeout, and the folder is removed.

The child's first line on the result pipe reports its layers, written before the program runs, so nothing
the program writes can pass for it; what follows is the program's results, and anything malformed there (not
a list, nested too deep, a number too long to read or compare) is that program's failure, scored 0.

The filesystem layer (Landlock) and a process layer (a pid namespace or seccomp) are required: where the
kernel lacks them, `run_tests` raises `SandboxError` rather than run the program, unless the user allowed
it (`--allow-unconfined-code`, which sets MINIGRPO_ALLOW_UNCONFINED_CODE=1). `layers()` says what this
machine has; `minigrpo doctor` and the start of a run that uses the sandbox print it.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CHILD = str(Path(__file__).with_name("confine.py"))
REQUIRED = ["filesystem", "processes", "network"]
ALLOW_ENV = "MINIGRPO_ALLOW_UNCONFINED_CODE"
DISK_MB = 64  # the program's folder: a tmpfs of this size


class SandboxError(RuntimeError):
    """The machine cannot confine model-written code as required; the message says what is missing."""

    fatal = True  # not the reward's fault: scoring lets it stop the run instead of scoring 0


@dataclass
class Verdict:
    passed: int  # tests whose result equals the expected one
    total: int
    reason: str  # "ok", or why the program scored less: "timeout", "crashed: ...", "wrong answer on test 2"

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def run_tests(program: str, function: str, tests: list[tuple[list, object]], *, timeout: float = 5.0,
              memory_mb: int = 512, cpu_seconds: int = 5, second_layer: bool = True) -> Verdict:
    """Run `function` of `program` on each test's arguments in a sandboxed child; compare here.
    (`second_layer=False` leaves out the interpreter's audit hook: the tests use it to show that the
    kernel alone holds.)"""
    require = [] if allow_unconfined() else REQUIRED
    job = {"program": program, "function": function, "inputs": [args for args, _ in tests],
           "memory_mb": memory_mb, "cpu_seconds": cpu_seconds, "disk_mb": DISK_MB, "require": require,
           "guard": second_layer}
    raw, timed_out = _run_child(job, timeout)
    report, body = _report(raw)
    if report and report["missing"]:
        raise SandboxError(_refusal(report["layers"], report["missing"]))
    if timed_out:
        return Verdict(0, len(tests), "timeout")
    if report is None:
        return Verdict(0, len(tests), "no results (the sandbox could not start the program)")
    try:
        return _verdict(json.loads(body), tests)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return Verdict(0, len(tests), "no results (the program exited or crashed before the tests ran)")
    except (ValueError, RecursionError, OverflowError, TypeError) as error:  # too deep, too long a number
        return Verdict(0, len(tests), f"malformed results ({type(error).__name__})")


def _report(raw: bytes) -> tuple[dict | None, bytes]:
    """The harness's layers report (its first line, written before the program ran) and what follows."""
    line, _, body = raw.partition(b"\n")
    try:
        report = json.loads(line)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None, body
    ok = isinstance(report, dict) and isinstance(report.get("layers"), dict) and isinstance(report.get("missing"), list)
    return (report if ok else None), body


def _verdict(outputs, tests: list) -> Verdict:
    if not isinstance(outputs, list) or len(outputs) != len(tests):
        detail = outputs.get("error", "") if isinstance(outputs, dict) else "malformed results"
        return Verdict(0, len(tests), f"crashed: {str(detail)[:300]}")
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


def _run_child(job: dict, timeout: float) -> tuple[bytes, bool]:
    """Start the confined child in a fresh folder, hand it the job, collect what it writes to its result
    pipe; kill its process group at the end. Returns (raw results, timed out)."""
    if sys.platform != "linux":
        raise SandboxError("the code sandbox needs Linux (namespaces, Landlock, seccomp); "
                           "run code tasks there, or under WSL 2 on Windows")
    workdir = tempfile.mkdtemp(prefix="minigrpo-sandbox-")
    read_fd, write_fd = os.pipe()
    received: list[bytes] = []
    child = None
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        child = subprocess.Popen(
            [sys.executable, "-I", "-S", CHILD], cwd=workdir, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(write_fd,), start_new_session=True)
        child_fd, write_fd = write_fd, -1  # the child holds it under the same number; ours closes
        os.close(child_fd)
        reader = threading.Thread(target=_read_all, args=(read_fd, received), daemon=True)
        reader.start()  # read while the child runs, so a large result cannot block it on a full pipe
        try:
            child.stdin.write(json.dumps({**job, "fd": child_fd}).encode())
            child.stdin.close()
        except BrokenPipeError:
            pass
        try:
            child.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(child)
        child = None  # reaped: its pid may now name another process
        reader.join(timeout=1.0)
    finally:  # also when the caller is interrupted mid-wait (a reward's time limit, Ctrl-C)
        if child is not None:
            _kill_group(child)
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
    return b"".join(received), timed_out


def allow_unconfined() -> bool:
    return os.environ.get(ALLOW_ENV) == "1"


@functools.cache
def layers() -> dict:
    """What the kernel gives the sandbox's child on this machine, as the child itself found it:
    {"namespaces": "user+pid+net+ipc+uts", "landlock": ABI version or 0, "seccomp": bool, "missing": [...]}."""
    probe = {"probe": True, "memory_mb": 512, "cpu_seconds": 5, "disk_mb": DISK_MB, "require": REQUIRED}
    report, _ = _report(_run_child(probe, 10.0)[0])
    if report is None:
        return {"namespaces": "", "landlock": 0, "seccomp": False, "missing": list(REQUIRED)}
    return {**report["layers"], "missing": report["missing"]}


def describe(found: dict) -> str:
    """One line: the layers active, and what is missing."""
    parts = [f"namespaces {found['namespaces']}" if found["namespaces"] else "no namespaces",
             f"landlock ABI {found['landlock']}" if found["landlock"] else "no landlock",
             "seccomp" if found["seccomp"] else "no seccomp", found.get("folder") or "folder on disk",
             "rlimits", "wall-clock kill"]
    missing = f"; missing: {', '.join(found['missing'])}" if found["missing"] else ""
    return f"code sandbox: {', '.join(parts)}{missing}"


def announce(say) -> None:
    """At the start of a run that uses the sandbox: say which layers are active; refuse when a required
    one is missing and the user has not allowed it."""
    found = layers()
    say(describe(found))
    if found["missing"] and not allow_unconfined():
        raise SandboxError(_refusal(found, found["missing"]))


def _refusal(found: dict, missing: list[str]) -> str:
    return (f"this machine cannot confine model-written code: no {' or '.join(missing)} layer "
            f"({describe({**found, 'missing': missing})}). Run it on a Linux kernel with user namespaces and "
            f"Landlock (5.13+), or pass --allow-unconfined-code to run it with only what this machine has")


def _kill_group(child: subprocess.Popen, patience: float = 5.0) -> None:
    """Kill the child's process group and return once none of it is left: the program's process (pid 1 of
    its namespace, a grandchild here) takes a moment to go, its namespaces torn down after it."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        try:
            os.killpg(child.pid, 0)  # anyone left in the group? (the group's id stays taken while it has members)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.005)


def overhead(runs: int = 40) -> dict:
    """Milliseconds per program (median of `runs`, in turns): a bare `python -I -S` running one program on
    three tests, and the sandbox running the same, with every layer this machine has."""
    program, tests = "def add(a, b):\n    return a + b\n", [([2, 3], 5), ([10, -4], 6), ([0, 0], 0)]
    bare_code = program + "import json\nprint(json.dumps([add(*args) for args, _ in %r]))\n" % tests
    bare, boxed = [], []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", "-c", bare_code], capture_output=True, check=True)
        bare.append(time.perf_counter() - start)
        start = time.perf_counter()
        if run_tests(program, "add", tests).reason != "ok":
            raise SandboxError("the sandbox failed a correct program while measuring")
        boxed.append(time.perf_counter() - start)
    return {"bare_ms": 1000 * statistics.median(bare), "sandbox_ms": 1000 * statistics.median(boxed)}
