"""Every number option of the commands that only plan, measure or sample, walked from typer's own parameter list (a
new option is covered without being listed): 0, -1, a huge value and a wrong type each either start the work (here
stopped where it would begin) or end in an error naming the flag, with a non-zero status and nothing written;
never a traceback. The values the probe found wrong (a "-8 GB card" planned with exit 0, zero rows decoded) are
refused by name."""

import os

import pytest
import typer
from typer.testing import CliRunner

from minigrpo.cli.app import app


class Reached(Exception):
    """The command accepted its flags and began its work."""


def _stop_work(monkeypatch):
    import minigrpo.bench.decode
    import minigrpo.bench.learn
    import minigrpo.bench.steps
    import minigrpo.evaluate
    import importlib

    import minigrpo.rehearse

    def reached(*args, **kwargs):
        raise Reached

    import minigrpo.bench.trl
    import minigrpo.check
    import minigrpo.model
    import minigrpo.sandbox.runner
    import minigrpo.sft

    for module, name in [(minigrpo.bench.decode, "bench_decode"), (minigrpo.bench.steps, "bench_model"),
                         (minigrpo.bench.steps, "compare"), (minigrpo.bench.learn, "learn"),
                         (minigrpo.bench.trl, "compare_with_trl"), (minigrpo.sandbox.runner, "overhead"),
                         (minigrpo.evaluate, "sample_completions"), (minigrpo.rehearse, "rehearse"),
                         (minigrpo.model, "load_trained"), (minigrpo.check, "check_task"), (minigrpo.sft, "sft"),
                         (importlib.import_module("minigrpo.train"), "train")]:  # the package's `train` is the function
        monkeypatch.setattr(module, name, reached)


# each command with the arguments it needs besides the option walked (a data file: the test writes it)
COMMANDS = [["plan"], ["bench", "decode"], ["bench", "model"], ["bench", "learn"], ["bench", "trl"],
            ["bench", "compare"], ["bench", "sandbox"], ["sample", "hi"], ["train"], ["eval", "--task", "addition"],
            ["check-reward", "--task", "addition"], ["sft", "--task", "rows.jsonl", "--out", "warm"]]
WORDS = {"hi", "--task", "addition", "rows.jsonl", "--out", "warm"}


def _number_options(path: list[str]):
    """The command's options that take an int or a float, as typer built them (its own parameter list)."""
    from typer._click.core import Context  # typer's own click

    command = typer.main.get_command(app)
    for name in path:
        command = command.get_command(Context(command), name)
    for param in command.params:
        if param.param_type_name == "option" and not param.is_flag and param.bare_type() in ("int", "float"):
            yield param.opts[0]


CASES = [(path, flag, value) for path in COMMANDS for flag in _number_options([p for p in path if p not in WORDS])
         for value in ("0", "-1", "1e30", "many")]


@pytest.mark.parametrize("path, flag, value", CASES, ids=[f"{' '.join(p)} {f} {v}" for p, f, v in CASES])
def test_every_number_option_is_refused_by_name_or_starts_the_work(path, flag, value, monkeypatch, tmp_path):
    _stop_work(monkeypatch)
    monkeypatch.chdir(tmp_path)
    if "rows.jsonl" in path:
        (tmp_path / "rows.jsonl").write_text('{"prompt": "What is 1 + 1?", "completion": "2"}\n')
    before = set(os.listdir(tmp_path))
    args = [*path, flag, value] + (["--gpu", "t4"] if path == ["plan"] and flag != "--gpu-memory" else [])
    result = CliRunner().invoke(app, args)
    if isinstance(result.exception, Reached) or result.exit_code == 0:
        assert value not in ("-1", "many"), f"{' '.join(args)} was taken"
        return
    assert result.exit_code in (1, 2), (args, result.output, result.exception)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    named = (flag, flag.lstrip("-"), flag.lstrip("-").replace("-", "_"))  # the flag, or its config field
    assert any(name in result.output for name in named), (args, result.output)
    assert set(os.listdir(tmp_path)) == before, "nothing written"


@pytest.mark.parametrize("args", [["bench", "decode", "--rows", "0"], ["bench", "decode", "--rows", "-3"],
                                  ["sample", "hi", "--samples", "0"], ["plan", "--gpu-memory", "-8"],
                                  ["plan", "--gpu-memory", "0"]])
def test_the_probes_nonsense_is_refused(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and "Traceback" not in result.output, (args, result.output)


def test_a_flag_named_as_elsewhere_is_matched_to_ours():
    """`--lr` (every other trainer's name) was "No such option"; now it names --learning-rate, before any work."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "minigrpo.cli", "train", "--lr", "1e-4"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "no such option --lr: did you mean --learning-rate?" in done.stderr, done.stderr
