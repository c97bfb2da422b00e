"""Hostile programs in the code sandbox: each must score as a failure and leave the machine as it was.

The escapes run twice: with the interpreter's audit hook (as in training) and without it, to show that the
kernel alone holds. `test_as_an_unprivileged_user` runs them again as user nobody when the suite runs as root.
"""

import hashlib
import http.server
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
from pathlib import Path

import pytest

from minigrpo.sandbox import runner as sandbox
from minigrpo.sandbox.confine import missing
from minigrpo.sandbox.runner import describe, layers, run_tests

TESTS = [([2, 3], 5), ([10, -4], 6), ([0, 0], 0)]
GOOD = "def add(a, b):\n    return a + b\n"
LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"


def test_a_correct_program_passes():
    verdict = run_tests(GOOD, "add", TESTS)
    assert (verdict.passed, verdict.total, verdict.reason) == (3, 3, "ok")


def test_a_wrong_program_fails_on_the_right_test():
    verdict = run_tests("def add(a, b):\n    return a + b if a else 1\n", "add", TESTS)
    assert verdict.passed == 2 and verdict.reason == "wrong answer on test 2"


def test_the_standard_library_works_inside():
    program = ("import math, collections, itertools, re, functools, heapq, json, random, string, decimal, fractions\n"
               "import datetime, hashlib, statistics, bisect, typing, dataclasses, zlib, array, struct, threading\n"
               "def add(a, b):\n    random.seed(a); hashlib.sha256(b'x'); zlib.compress(b'x')\n"
               "    t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
               "    open('scratch.txt', 'w').write(str(a + b))\n    return int(open('scratch.txt').read())\n")
    assert run_tests(program, "add", TESTS).reason == "ok"


HOSTILE = {
    "infinite loop": "def add(a, b):\n    while True:\n        pass\n",
    "infinite loop at import": "while True:\n    pass\n",
    "fork bomb": "import os\nwhile True:\n    os.fork()\n",
    "fork bomb via subprocess": "import subprocess, sys\nwhile True:\n    subprocess.Popen([sys.executable, '-c', 'pass'])\n",
    "thread bomb": "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()\n",
    "huge allocation": "x = bytearray(8 * 1024 ** 3)\ndef add(a, b):\n    return a + b\n",
    "exit before the tests": "import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b\n",
    "hard exit before the tests": "import os\nos._exit(0)\n",
    "fake success message": "print('all tests passed')\nprint('OK: 3/3')\ndef add(a, b):\n    return 0\n",
    "always-equal object": "class Eq:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Eq()\n",
    # the program does not know the expected results, so the most it can do is claim success
    "patch the harness's json": (
        "import json\njson.dumps = lambda obj, **kw: '{\"passed\": 3, \"total\": 3, \"reason\": \"ok\"}'\n"
        "def add(a, b):\n    return None\n"),
    "patch the harness's assertions": (
        "import builtins\nbuiltins.AssertionError = type('Never', (Exception,), {})\n"
        "import sys\nsys.modules['__main__'].outputs = [{'value': True}] * 3\n"
        "def add(a, b):\n    return True\n"),
    "write fake results to the result pipe": (
        "import os\nfor fd in range(3, 20):\n    try:\n        os.write(fd, b'[{\"value\": 1}, {\"value\": 1}, {\"value\": 1}]')\n"
        "    except OSError:\n        pass\nos._exit(0)\n"),
    "raise everywhere": "def add(a, b):\n    raise SystemExit(0)\n",
    "fill the disk": "for i in range(1000):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_programs_fail(name, machine):
    start = time.perf_counter()
    verdict = run_tests(HOSTILE[name], "add", TESTS, timeout=3.0)
    assert verdict.passed < verdict.total, f"{name} scored {verdict}"
    assert time.perf_counter() - start < 10


# Each escape is the body of `attempt()`; the program answers "blocked" when the attempt raised OSError
# (ctypes calls raise it themselves on -1). {out} is a folder outside holding canary.txt, {lib} a file of
# Python's own library, {port} a real server on 127.0.0.1, {pid} this test process, {canary} a process
# outside.
ESCAPES = {
    "write outside": "open('{out}/pwned', 'w').write('x')",
    "rebind the audit hook's state, then write outside": (
        "import sys\nm = sys.modules['__main__']\nfor k in list(vars(m)):\n"
        "    if not k.startswith('__'):\n        setattr(m, k, None)\nopen('{out}/pwned', 'w').write('x')"),
    "os.rename out of the folder": "open('a', 'w').write('x')\nos.rename('a', '{out}/pwned')",
    "os.rename into the folder": "os.rename('{out}/canary.txt', 'stolen')",
    "os.link into the folder, then append": "os.link('{out}/canary.txt', 'l')\nopen('l', 'a').write('x')",
    "os.symlink out, then write": "os.symlink('{out}/pwned', 's')\nopen('s', 'w').write('x')",
    "os.symlink out, then read": "os.symlink('/etc/passwd', 's')\nopen('s').read()",
    "dir_fd read of /etc/passwd": "d = os.open('/etc', os.O_PATH)\nos.read(os.open('passwd', os.O_RDONLY, dir_fd=d), 9)",
    "dir_fd write outside": "d = os.open('{out}', os.O_PATH)\nos.open('pwned', os.O_WRONLY | os.O_CREAT, dir_fd=d)",
    "O_TRUNC with a read-only mode": "os.open('{lib}', os.O_RDONLY | os.O_TRUNC)",
    "O_APPEND on the standard library": "os.write(os.open('{lib}', os.O_WRONLY | os.O_APPEND), b'#')",
    "O_RDWR on the standard library": "os.open('{lib}', os.O_RDWR)",
    "O_CREAT | O_EXCL outside": "os.open('{out}/pwned', os.O_WRONLY | os.O_CREAT | os.O_EXCL)",
    "truncate outside by path": "os.truncate('{out}/canary.txt', 0)",
    "delete outside": "os.remove('{out}/canary.txt')",
    "mkdir outside": "os.mkdir('{out}/dir')",
    "chmod outside": "os.chmod('{out}/canary.txt', 0o777)",
    "utime outside": "os.utime('{out}/canary.txt', (0, 0))",
    "setxattr outside": "os.setxattr('{out}/canary.txt', 'user.pwned', b'x')",
    "read /etc/passwd": "open('/etc/passwd').read()",
    "list the root folder": "os.listdir('/')",
    "read site-packages (where tests may live)": f"open({str(Path(sandbox.__file__))!r}).read()",
    "/proc/self/environ": "open('/proc/self/environ').read()",
    "/proc/self/mem": "open('/proc/self/mem', 'r+b')",
    "/proc/1/root": "os.listdir('/proc/1/root')",
    "/proc/self/fd links": "os.readlink('/proc/self/fd/0')",
    "/dev/shm": "open('/dev/shm/pwned', 'w')",
    "stray file descriptors": (
        "import stat\nfor fd in range(3, 256):\n    try:\n        mode = os.fstat(fd).st_mode\n"
        "    except OSError:\n        continue\n    if not stat.S_ISFIFO(mode):\n        break\nelse:\n"
        "    raise PermissionError('only the result pipe')"),
    "fork": "os.fork()",
    "fork through ctypes": LIBC + "if libc.syscall(57) == -1: raise OSError",
    "clone through ctypes": LIBC + "if libc.syscall(56, 17, 0, 0, 0, 0) == -1: raise OSError",
    "posix_spawn": "os.posix_spawn('/bin/sh', ['sh', '-c', 'touch {out}/pwned'], {{}})",
    "subprocess": "import subprocess\nsubprocess.run(['/bin/sh', '-c', 'touch {out}/pwned'])",
    "execve": "os.execv('/bin/sh', ['sh', '-c', 'touch {out}/pwned'])",
    "setsid (leave the process group)": "os.setsid()",
    "setpgid": "os.setpgid(0, 0)",
    "ptrace this test": LIBC + "if libc.ptrace(16, {pid}, 0, 0) == -1: raise OSError",
    "unshare a user namespace": LIBC + "if libc.unshare(0x10000000) == -1: raise OSError",
    "mount": LIBC + "if libc.mount(b'none', b'.', b'tmpfs', 0, None) == -1: raise OSError",
    "io_uring": LIBC + "if libc.syscall(425, 8, ctypes.create_string_buffer(120)) == -1: raise OSError",
    "kill every process": "import signal\nos.kill(-1, signal.SIGKILL)",
    "kill a process outside": "os.kill({canary}, 9)",
    "kill this test's process group": "os.killpg({pgid}, 0)",
    "connect to a server on 127.0.0.1": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
    "socket through _socket": "import _socket\n_socket.socket().connect(('127.0.0.1', {port}))",
    "socket through ctypes": LIBC + "if libc.syscall(41, 2, 1, 0) == -1: raise OSError",
    "abstract unix socket": "import _socket\n_socket.socket(_socket.AF_UNIX).connect('\\0minigrpo')",
    # metadata: outside the program's own root nothing exists, not even for stat or inotify
    "stat a file outside": "os.stat('{out}/canary.txt')",
    "stat this test's /proc entry": "os.stat('/proc/{pid}')",
    "list /proc": "os.listdir('/proc')",
    "stat site-packages": f"os.stat({str(Path(sandbox.__file__).parent)!r})",
    "inotify on a folder outside": (
        LIBC + "fd = libc.inotify_init1(0)\nif fd < 0: raise OSError\n"
        "if libc.inotify_add_watch(fd, b'{out}', 0xfff) < 0: raise OSError"),
    "symlink race to /etc/passwd": (
        "import threading\nopen('inside.txt', 'w').write('fine')\nstop = []\n"
        "def flip():\n    while not stop:\n        for target in ('inside.txt', '/etc/passwd'):\n"
        "            try:\n                os.remove('link')\n            except OSError:\n                pass\n"
        "            os.symlink(target, 'link')\nthreading.Thread(target=flip).start()\nseen = ''\n"
        "for _ in range(3000):\n    try:\n        seen += open('link').read()\n    except OSError:\n        pass\n"
        "stop.append(1)\nif 'root:' not in seen:\n    raise PermissionError('never read it')"),
}

PROGRAM = """import os
def attempt():
{body}
def add(a, b):
    try:
        attempt()
    except (OSError, ImportError):
        return "blocked"
    return "escaped"
"""


@pytest.fixture(scope="module")
def listener():
    """A real HTTP server on 127.0.0.1 that counts the connections it gets."""
    hits = []

    class Count(http.server.BaseHTTPRequestHandler):
        def setup(self):
            hits.append(1)
            super().setup()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Count)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1], hits
    server.shutdown()


@pytest.fixture
def machine(tmp_path, listener):
    """Facts about the machine before a hostile program runs; checked unchanged after it."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "canary.txt").write_text("canary")
    lib = Path(sysconfig.get_paths()["stdlib"]) / "this.py"
    canary = subprocess.Popen(["sleep", "120"])
    facts = {"out": out, "lib": lib, "port": listener[0], "pid": os.getpid(), "pgid": os.getpgid(0),
             "canary": canary.pid}
    before = _snapshot(out, lib)
    backup = lib.read_bytes()
    yield facts
    try:
        assert canary.poll() is None, "a process outside the sandbox was killed"
        assert _snapshot(out, lib) == before, "the filesystem outside the sandbox changed"
        assert not listener[1], "the server on 127.0.0.1 was reached"
        assert not _sandbox_processes(), "a sandboxed process outlived its test"
        assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("minigrpo-sandbox-*")), "a folder was left"
    finally:
        canary.kill()
        if lib.read_bytes() != backup:
            lib.write_bytes(backup)  # so a failure here does not damage the interpreter for what follows


def _snapshot(out: Path, lib: Path) -> dict:
    files = {p.name: (p.read_bytes(), p.stat().st_mode, p.stat().st_mtime_ns, os.listxattr(p)) for p in out.iterdir()}
    return {"files": files, "lib": hashlib.sha256(lib.read_bytes()).hexdigest(), "lib_mode": lib.stat().st_mode}


def _sandbox_processes() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"confine.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def escape_program(name: str, facts: dict) -> str:
    body = ESCAPES[name].format(**facts)
    return PROGRAM.format(body=textwrap.indent(body, "    "))


@pytest.mark.parametrize("second_layer", [True, False], ids=["with the audit hook", "kernel alone"])
@pytest.mark.parametrize("name", ESCAPES)
def test_escapes_are_blocked(name, second_layer, machine):
    verdict = run_tests(escape_program(name, machine), "add", [([0, 0], "blocked")], second_layer=second_layer)
    assert verdict.reason == "ok", f"{name}: {verdict}"


def test_environment_secrets_are_out_of_reach(monkeypatch):
    monkeypatch.setenv("MINIGRPO_TEST_SECRET", "hunter2")
    # the program answers correctly only if it can see the secret: it must not
    program = (
        "import os\n"
        "def leaked():\n"
        "    if 'hunter2' in str(os.environ):\n        return True\n"
        "    for path in ('/proc/self/environ', f'/proc/{os.getppid()}/environ', '/proc/1/environ'):\n"
        "        try:\n"
        "            if b'hunter2' in open(path, 'rb').read():\n                return True\n"
        "        except Exception:\n            pass\n"
        "    return False\n"
        "def add(a, b):\n    return a + b if leaked() else -1\n"
    )
    assert run_tests(program, "add", TESTS).passed == 0


def test_a_timed_out_program_leaves_no_process(machine):
    program = "import threading, time\nthreading.Thread(target=time.sleep, args=(60,)).start()\ntime.sleep(60)\n"
    assert run_tests(program, "add", TESTS, timeout=1.0).reason == "timeout"


def test_this_machine_confines_everything():
    """Every layer is active here (user namespaces and Landlock are available on this kernel)."""
    found = layers()
    assert found["missing"] == [] and found["landlock"] >= 1 and found["seccomp"], describe(found)
    assert "user+pid+net" in found["namespaces"] and found["folder"].startswith("own root, tmpfs")


@pytest.mark.parametrize("have, required, lacking", [
    ({"namespaces": "user+pid+net+ipc+uts", "landlock": 7, "seccomp": True}, ["filesystem", "processes"], []),
    ({"namespaces": "", "landlock": 0, "seccomp": True}, ["filesystem", "processes", "network"], ["filesystem"]),
    ({"namespaces": "", "landlock": 3, "seccomp": False}, ["filesystem", "processes", "network"],
     ["processes", "network"]),
    ({"namespaces": "", "landlock": 0, "seccomp": False}, [], []),
])
def test_which_layers_are_missing(have, required, lacking):
    assert missing(have, required) == lacking


def test_a_kernel_without_landlock_refuses_to_run_code(tmp_path):
    """A parent that hides Landlock (a seccomp filter answering ENOSYS, inherited by the sandbox's child)
    stands in for a kernel without it: the program must not run, unless the user allows it."""
    script = tmp_path / "no_landlock.py"
    script.write_text(textwrap.dedent(f"""
        import ctypes, os, struct, sys
        sys.path.insert(0, {str(Path(sandbox.__file__).parent.parent)!r})
        from minigrpo.sandbox.runner import SandboxError, run_tests
        # nr >= 444 and not >= 447 -> ENOSYS (the three Landlock calls); everything else allowed
        prog = [(0x20, 0, 0, 0), (0x35, 0, 2, 444), (0x35, 1, 0, 447), (0x06, 0, 0, 0x00050000 | 38),
                (0x06, 0, 0, 0x7FFF0000)]
        code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in prog))
        libc = ctypes.CDLL(None)
        libc.prctl(38, 1, 0, 0, 0)
        assert libc.prctl(22, 2, ctypes.c_char_p(struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(code))), 0, 0) == 0
        try:
            print("ran", run_tests("def f():\\n    return 1\\n", "f", [([], 1)]).reason)
        except SandboxError as error:
            print("refused", error)
    """))
    env = {k: v for k, v in os.environ.items() if k != sandbox.ALLOW_ENV}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.startswith("refused") and "no filesystem layer" in out.stdout, out.stdout + out.stderr
    assert "--allow-unconfined-code" in out.stdout and "no landlock" in out.stdout
    env[sandbox.ALLOW_ENV] = "1"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "ran ok", out.stdout + out.stderr


@pytest.fixture
def nobody_folder():
    """A folder user nobody can reach (pytest's own are private to root)."""
    import tempfile
    folder = Path(tempfile.mkdtemp(prefix="minigrpo-nobody-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def _python_for_nobody() -> str | None:
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        candidate = candidate and os.path.realpath(candidate)  # the sandbox starts sys.executable itself
        if candidate and subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                                         candidate, "-c", "import os, sys; sys.exit(not os.access(sys.executable, os.X_OK))"],
                                        capture_output=True).returncode == 0:
            return candidate
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="the suite already runs as an unprivileged user")
def test_as_an_unprivileged_user(nobody_folder, listener, request):
    """The same escapes, with the kernel alone, as user nobody (the suite runs as root in CI)."""
    python = _python_for_nobody() if shutil.which("setpriv") else None
    if python is None:
        pytest.skip("no Python interpreter that user nobody can run")
    tmp_path = nobody_folder
    code = tmp_path / "code"
    code.mkdir()
    for name in ("runner.py", "confine.py", "syscalls.json"):
        shutil.copy(Path(sandbox.__file__).with_name(name), code / name)
    out = tmp_path / "outside"
    out.mkdir()
    (out / "canary.txt").write_text("canary")
    for path in (tmp_path, code, out, out / "canary.txt"):
        path.chmod(0o777 if path.is_dir() else 0o666)  # nobody could write here; only the sandbox stops it
    # a process of nobody's own, which nobody could kill without the sandbox
    canary = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "120"])
    facts = {"out": out, "lib": Path(sysconfig.get_paths()["stdlib"]) / "this.py", "port": listener[0],
             "pid": os.getpid(), "pgid": os.getpgid(0), "canary": canary.pid}
    jobs = {name: escape_program(name, facts) for name in ESCAPES if "test's process group" not in name}
    (code / "jobs.json").write_text(json.dumps(jobs))
    driver = ("import json, sys\nsys.path.insert(0, sys.argv[1])\nimport runner as sandbox\n"
              "jobs = json.load(open(sys.argv[1] + '/jobs.json'))\n"
              "print(json.dumps({'layers': sandbox.describe(sandbox.layers()), 'results': {n: sandbox.run_tests("
              "p, 'add', [([0, 0], 'blocked')], second_layer=False).reason for n, p in jobs.items()}}))\n")
    run = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I", "-c",
                          driver, str(code)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    alive = canary.poll() is None
    canary.kill()
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout)
    assert alive and not listener[1], "a process was killed or the server reached"
    request.config.sandbox_layers_as_nobody = [report["layers"]]
    escaped = {n: r for n, r in report["results"].items() if r != "ok"}
    assert not escaped, escaped
    assert [p.name for p in out.iterdir()] == ["canary.txt"] and (out / "canary.txt").read_text() == "canary"
    assert stat.S_IMODE((out / "canary.txt").stat().st_mode) == 0o666


def test_a_run_of_the_code_task_says_its_layers_and_refuses_without_them(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from minigrpo.cli.app import app

    monkeypatch.delenv(sandbox.ALLOW_ENV, raising=False)
    lacking = {"namespaces": "", "landlock": 0, "seccomp": True, "folder": "", "missing": ["filesystem"]}
    monkeypatch.setattr(sandbox, "layers", lambda: lacking)
    result = CliRunner().invoke(app, ["train", "--task", "code", "--out", str(tmp_path / "run")])
    assert result.exit_code == 1 and "no filesystem layer" in result.output, result.output
    assert "--allow-unconfined-code" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run").exists()  # refused before anything was written
    said = []
    from minigrpo.tasks import refuse_unconfined_code, get_task

    refuse_unconfined_code(get_task("code"), True, said.append)  # allowed: it says what there is and goes on
    assert said == [describe(lacking)] and os.environ[sandbox.ALLOW_ENV] == "1"
    monkeypatch.delenv(sandbox.ALLOW_ENV)


# Replies a program writes to its own result pipe (it finds the descriptor by trying them): none may stop the
# run or pass for a verdict. Each scores 0, named.
FORGED = {
    "the start-up probe's reply, saying a layer is missing": (
        '{"layers": {"namespaces": "", "landlock": 0, "seccomp": false, "folder": ""}, "missing": ["filesystem"]}'),
    "the probe's reply, then a newline and passing results": (
        '{"layers": {"namespaces": "", "landlock": 0, "seccomp": false, "folder": ""}, "missing": []}\\n'
        '[{"value": 5}, {"value": 6}, {"value": 0}]'),
    "a result nested 300,000 deep": '[' * 300000 + ']' * 300000,
    "a 5,000-digit integer": '[{"value": 1' + '0' * 5000 + '}, {"value": 6}, {"value": 0}]',
}
FORGE = """import os, stat
def add(a, b):
    for fd in range(3, 64):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, {reply!r}.encode())
        except OSError:
            pass
    os._exit(0)
"""


@pytest.mark.parametrize("name", FORGED)
def test_forged_replies_score_zero_and_stop_nothing(name, machine):
    verdict = run_tests(FORGE.format(reply=FORGED[name]), "add", TESTS)
    assert verdict.passed == 0, f"{name}: {verdict}"


@pytest.mark.parametrize("value, expected", [("10 ** 400", 1.5), ("10 ** 400", 2), ("float('nan')", 1.0)])
def test_malformed_values_are_a_verdict_not_an_error(value, expected):
    verdict = run_tests(f"def f():\n    return {value}\n", "f", [([], expected)])
    assert verdict.passed == 0 and verdict.reason != "ok", verdict
