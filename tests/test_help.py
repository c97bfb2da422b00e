"""Every command's --help reads as written: no text eaten as markup, every option with a value shows its
default once, and no line is left dangling (" .")."""

import click
import pytest
import typer.main
from typer.testing import CliRunner

from minigrpo.cli.app import app

COMMAND = typer.main.get_command(app)


def commands(group=COMMAND, path=()):
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from commands(command, path + (name,))
        else:
            yield path + (name,), command


@pytest.mark.parametrize("path, command", list(commands()), ids=lambda x: " ".join(x) if isinstance(x, tuple) else "")
def test_help_shows_every_default(path, command):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = result.output
    assert not any(line.rstrip().endswith(" .") for line in text.splitlines()), text
    assert "\x1b" not in text  # no control characters where the output is not a terminal
    ctx, missing = click.Context(command, info_name=path[-1]), []
    for param in command.params:
        if getattr(param, "param_type_name", "") != "option" or param.is_flag or param.name == "help":
            continue
        _, described = param.get_help_record(ctx)  # what --help prints for it
        if "[default:" not in described and "[required]" not in described:
            missing.append(f"{param.opts[0]}: {described}")
        if described.count("[default:") > 1:  # the help's own and click's, as a list option's shows both
            missing.append(f"{param.opts[0]} says its default twice: {described}")
    assert not missing, missing


def test_models_fits_an_80_column_terminal():
    """Each preset's hub id (to copy) and sizes whole, on a terminal of 80 columns."""
    from minigrpo.presets import PRESETS

    result = CliRunner().invoke(app, ["models"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(map(len, lines)) <= 80, result.output
    for name, preset in PRESETS.items():
        row = next(line for line in lines if line.split() and line.split()[0] == name)
        assert f"{preset.learning_rate:g}" in row.split() and preset.hub_id in row.split(), row
        assert f"{preset.num_generations} x {preset.prompts_per_step}, {preset.max_new_tokens}" in row, row


def test_each_setting_is_stated_once():
    """Every TrainConfig field is an option of train built from the field (its default and help), or says why no
    flag sets it; and a choice's allowed values are listed in config.py alone (its Literal), in no other file's
    code or text."""
    import dataclasses
    from pathlib import Path
    from typing import Literal, get_args

    import minigrpo.config as config

    options = {p.name: p for p in COMMAND.commands["train"].params}
    for f in dataclasses.fields(config.TrainConfig):
        if "help" not in f.metadata:
            assert f.metadata.get("why") and f.name not in options, f.name  # Python-only, on purpose
            continue
        default = [] if f.default_factory is list else None if f.name == "task" else f.default
        given = options[f.name].default
        assert (list(given) if isinstance(given, tuple) else given) == default, f.name
        assert options[f.name].help.startswith(f.metadata["help"]), f.name

    kinds = [get_args(v) for v in vars(config).values() if getattr(v, "__origin__", None) is Literal]
    root = Path(config.__file__).parent
    for path in [p for p in root.rglob("*.py") if p.name != "config.py"] + [*root.parent.glob("docs/*.md")]:
        text = path.read_text()
        for values in (v for v in kinds if len(v) > 2):
            listed = [", ".join(values[:-1]) + f" or {values[-1]}", " | ".join(values),
                      ", ".join(f'"{v}"' for v in values)]
            assert not any(way in text for way in listed), (path.name, values)


def test_one_thing_has_one_flag_in_every_command():
    """Options that say the same thing (the same help's first sentence) are spelled the same in every command, and a
    renamed flag's old spelling is told the new one, in one line, with a failing exit status."""
    import subprocess
    import sys

    from minigrpo.cli.app import RENAMED

    spellings: dict[str, set[str]] = {}
    for path, command in commands():
        for param in command.params:
            if getattr(param, "param_type_name", "") == "option" and param.help:
                meaning = param.help.split(". ")[0].split(" [default")[0].rstrip(".").lower()
                spellings.setdefault(meaning, set()).add(param.opts[0])
                assert param.opts[0] not in RENAMED, (path, param.opts)
    assert not {m: s for m, s in spellings.items() if len(s) > 1}, {m: s for m, s in spellings.items() if len(s) > 1}
    assert {spellings[m].pop() for m in ("run folder", "completions per prompt (g); a group of one has no spread")} \
        == {"--out", "--num-generations"}

    done = subprocess.run([sys.executable, "-m", "minigrpo.cli", "train", "--output-dir=runs/x"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == ("error: --output-dir is now --out (one name for one thing "
                                                            "in every command)"), done.stderr
