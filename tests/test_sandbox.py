"""Hostile programs in the code sandbox: each must score as a failure and leave the machine as it was."""

import os
import time

import pytest

from minigrpo.sandbox import run_tests

TESTS = [([2, 3], 5), ([10, -4], 6), ([0, 0], 0)]
GOOD = "def add(a, b):\n    return a + b\n"


def test_a_correct_program_passes():
    verdict = run_tests(GOOD, "add", TESTS)
    assert (verdict.passed, verdict.total, verdict.reason) == (3, 3, "ok")


def test_a_wrong_program_fails_on_the_right_test():
    verdict = run_tests("def add(a, b):\n    return a + b if a else 1\n", "add", TESTS)
    assert verdict.passed == 2 and verdict.reason == "wrong answer on test 2"


HOSTILE = {
    "infinite loop": "def add(a, b):\n    while True:\n        pass\n",
    "infinite loop at import": "while True:\n    pass\n",
    "fork bomb": "import os\nwhile True:\n    os.fork()\n",
    "fork bomb via subprocess": "import subprocess, sys\nwhile True:\n    subprocess.Popen([sys.executable, '-c', 'pass'])\n",
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
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_programs_fail(name):
    start = time.perf_counter()
    verdict = run_tests(HOSTILE[name], "add", TESTS, timeout=3.0)
    assert verdict.passed < verdict.total, f"{name} scored {verdict}"
    assert time.perf_counter() - start < 10


def test_writing_outside_its_directory_is_refused(tmp_path):
    target = tmp_path / "pwned.txt"
    program = f"open({str(target)!r}, 'w').write('x')\ndef add(a, b):\n    return a + b\n"
    verdict = run_tests(program, "add", TESTS)
    assert verdict.passed == 0 and not target.exists()
    program = f"import os\nos.makedirs({str(tmp_path / 'dir')!r})\ndef add(a, b):\n    return a + b\n"
    assert run_tests(program, "add", TESTS).passed == 0 and not (tmp_path / "dir").exists()


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


def test_no_network():
    program = (
        "import socket\n"
        "def add(a, b):\n"
        "    s = socket.socket()\n    s.settimeout(1)\n    s.connect(('127.0.0.1', 22))\n    return a + b\n"
    )
    assert run_tests(program, "add", TESTS).passed == 0


def test_nothing_is_left_behind():
    before = {p for p in os.listdir("/tmp") if p.startswith("minigrpo-sandbox-")}
    run_tests("import os\nopen('scratch.txt', 'w').write('x')\n" + GOOD, "add", TESTS)
    run_tests(HOSTILE["infinite loop"], "add", TESTS, timeout=1.0)
    after = {p for p in os.listdir("/tmp") if p.startswith("minigrpo-sandbox-")}
    assert after <= before
