"""Every option and argument of every command, walked from typer's own command tree (a new command or option is
covered without being listed): each number gets 0, -1, a huge value and a wrong type; each string (a path, a
name, a choice) gets an empty value and a path that does not exist. Each either starts the work (here stopped
where a model would load or a benchmark's child would start) or ends in an error naming the flag or the value,
with a non-zero status and nothing written; never a traceback. The values the probe found wrong (a "-8 GB card"
planned with exit 0, zero rows decoded) are refused by name."""

import importlib
from pathlib import Path

import pytest
import typer
from typer._click.core import Context  # typer's own click
from typer.testing import CliRunner

from minigrpo.cli.app import app
from minigrpo.config import TrainConfig

# a value that kills a helper thread (a timer told to wait 1e30 s) is a traceback too
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


class Reached(Exception):
    """The command accepted its flags and began its work."""


# where each command's work begins: a model loads, an engine starts, a benchmark's child process runs
WORK = [("minigrpo.model", "load_base"), ("minigrpo.trained", "load_base"), ("minigrpo.startup", "load_for_training"),
        ("minigrpo.train", "load_for_training"),
        ("minigrpo.bench.decode", "bench_decode"), ("minigrpo.bench.decode", "bench_real"),
        ("minigrpo.bench.steps", "run_child"), ("minigrpo.bench.learn", "train_minigrpo"),
        ("minigrpo.bench.learn", "train_trl"), ("minigrpo.bench.trl", "compare_with_trl"),
        ("minigrpo.bench.parts", "dtype_speed"), ("minigrpo.bench.parts", "memory_scaling"),
        ("minigrpo.sandbox.runner", "overhead"), ("minigrpo.rehearse", "rehearse"), ("minigrpo.cli.doctor", "run_doctor")]

# what a command needs besides the parameter walked, in the folder the test makes (run/: a run with an adapter)
NEEDS = {"graduate": ["run", "--out", "grad"], "export": ["run", "--out", "exported"], "plot": ["run"],
         "eval": ["--task", "addition"], "check-reward": ["--task", "addition"], "sample": ["hi"],
         "sft": ["--task", "rows.jsonl", "--out", "warm"], "bench compare": ["--variant", "a"],
         "bench tables": ["cards"]}
# values that name something made (a new folder) or are text, not something read: a missing path may be meant
NOT_READ = {"--out", "--variant", "PROMPT"}
SIGNED = {"--reward-weight", "--solved-reward"}  # rewards may be negative (a penalty): -1 is meant


def _stop_work(monkeypatch):
    def reached(*args, **kwargs):
        raise Reached

    for module, name in WORK:
        monkeypatch.setattr(importlib.import_module(module), name, reached)


def _commands(command=None, path=()):
    command = command or typer.main.get_command(app)
    if not hasattr(command, "commands"):
        yield list(path), command
        return
    for name in command.list_commands(Context(command)):
        yield from _commands(command.get_command(Context(command), name), (*path, name))


def _parameters(kinds):
    """(command path, the parameter's name on the command line, whether it is an argument) of each parameter
    whose type is one of `kinds` (typer's own description of it)."""
    for path, command in _commands():
        for param in command.params:
            if getattr(param, "is_flag", False) or param.name in ("help",):
                continue
            kind = param.bare_type()
            if kind in kinds or ("str" in kinds and "Literal" in str(kind)):
                yield path, (param.opts[0] if param.param_type_name == "option" else param.name.upper())


def _args(path: list[str], name: str, value: str) -> list[str]:
    """The command line: the command's needs, with the walked parameter's value in place of its own."""
    needs = list(NEEDS.get(" ".join(path), []))
    if name.startswith("--"):
        if name in needs:
            del needs[needs.index(name):needs.index(name) + 2]
        card = ["--gpu", "t4"] if path == ["plan"] and name not in ("--gpu", "--gpu-memory") else []  # not this machine
        return [*path, *needs, name, value, *card]
    positional = [a for i, a in enumerate(needs) if not a.startswith("--") and (i == 0 or not needs[i - 1].startswith("--"))]
    return [*path, value, *[a for a in needs if a not in positional]]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A working folder with what the commands need: a data file, a run with an adapter, a folder of cards."""
    _stop_work(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "What is 1 + 1?", "completion": "2"}\n')
    (tmp_path / "run" / "adapter").mkdir(parents=True)
    (tmp_path / "run" / "adapter" / "adapter_config.json").write_text("{}")
    TrainConfig().save(tmp_path / "run" / "config.json")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    (tmp_path / "cards").mkdir()
    return tmp_path


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def _refused_by_name(args, result, named, folder, before):
    assert result.exit_code in (1, 2), (args, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)
    assert "Traceback" not in result.output
    assert any(name in result.output for name in named), (args, result.output)
    assert _files(folder) == before, (args, "wrote", _files(folder) - before)


NUMBERS = [(path, flag, value) for path, flag in _parameters({"int", "float", "list[int]", "list[float]"})
           for value in ("0", "-1", "1e30", "many")]


@pytest.mark.parametrize("path, flag, value", NUMBERS, ids=[f"{' '.join(p)} {f} {v}" for p, f, v in NUMBERS])
def test_every_number_option_is_refused_by_name_or_starts_the_work(path, flag, value, folder):
    args, before = _args(path, flag, value), _files(folder)
    result = CliRunner().invoke(app, args)
    if isinstance(result.exception, Reached) or result.exit_code == 0:
        assert value != "many" and (value != "-1" or flag in SIGNED), f"{' '.join(args)} was taken"
        return
    _refused_by_name(args, result, (flag, flag.lstrip("-"), flag.lstrip("-").replace("-", "_")), folder, before)


STRINGS = [(path, name, value) for path, name in _parameters({"str", "list[str]"}) for value in ("", "no/such/thing")]


@pytest.mark.parametrize("path, name, value", STRINGS, ids=[f"{' '.join(p)} {n} {v!r}" for p, n, v in STRINGS])
def test_every_string_is_refused_when_empty_or_missing(path, name, value, folder):
    """An empty value is never meant; a path that does not exist is refused by name, unless the value names a
    folder to make or is text."""
    args, before = _args(path, name, value), _files(folder)
    result = CliRunner().invoke(app, args)
    if value and name in NOT_READ and (isinstance(result.exception, Reached) or result.exit_code == 0):
        return
    assert not isinstance(result.exception, Reached), f"{' '.join(args)} started the work"
    named = (name, name.lstrip("-").replace("-", "_")) + ((value,) if value else ())
    _refused_by_name(args, result, named, folder, before)


@pytest.mark.parametrize("args", [["bench", "decode", "--rows", "0"], ["bench", "decode", "--rows", "-3"],
                                  ["sample", "hi", "--samples", "0"], ["plan", "--gpu-memory", "-8"],
                                  ["plan", "--gpu-memory", "0"]])
def test_the_probes_nonsense_is_refused(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and "Traceback" not in result.output, (args, result.output)


def test_the_walk_covers_every_command():
    """Each command is walked, or has no option to walk (a command added with none is listed here)."""
    walked = {" ".join(p) for p, _, _ in NUMBERS + STRINGS}
    assert {" ".join(p) for p, _ in _commands()} - walked == {"models", "tasks", "bench dtype", "bench memory"}


def test_a_flag_named_as_elsewhere_is_matched_to_ours():
    """`--lr` (every other trainer's name) was "No such option"; now it names --learning-rate, before any work."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "minigrpo.cli", "train", "--lr", "1e-4"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "no such option --lr: did you mean --learning-rate?" in done.stderr, done.stderr
