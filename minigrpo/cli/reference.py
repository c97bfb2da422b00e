"""docs/cli.md, written from the command line itself: every command, its options, their defaults and help.

    python -m minigrpo.cli.reference > docs/cli.md      # tests/test_docs.py fails while the file is stale
"""

from __future__ import annotations

import typer

HEADER = """# Command-line reference

Generated from the `minigrpo` command itself (`python -m minigrpo.cli.reference > docs/cli.md`); a test fails
when it is stale. `minigrpo COMMAND --help` prints the same.
"""


def render() -> str:
    from minigrpo.cli.app import app

    root = typer.main.get_command(app)
    parts = [HEADER]
    for path, command in commands(root):
        parts.append(section(path, command))
    return "\n".join(parts)


def commands(group, prefix: str = "minigrpo") -> list[tuple[str, object]]:
    """Every command under `group` (typer's click objects), depth first, in the order `--help` lists them."""
    out = []
    for name in group.list_commands(None):
        command = group.get_command(None, name)
        if command is None or command.hidden:
            continue
        path = f"{prefix} {name}"
        if hasattr(command, "list_commands"):  # a group of its own (bench)
            out += commands(command, path)
        else:
            out.append((path, command))
    return out


def section(path: str, command) -> str:
    lines = [f"## `{path}`", "", " ".join((command.help or "").split()), ""]
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    options = [p for p in command.params if p.param_type_name == "option" and not p.hidden]
    for argument in arguments:
        lines.append(f"Argument `{argument.name.upper()}`: {' '.join((getattr(argument, 'help', '') or '').split())}")
        lines.append("")
    if options:
        lines += ["| option | default | what it does |", "|---|---|---|"]
        for option in options:
            names = ", ".join(f"`{name}`" for name in [*option.opts, *option.secondary_opts])
            text, said = split_default(option.help or "")
            allowed = choices_of(option)
            if allowed:
                text = text.rstrip().rstrip(".") + f". One of: {', '.join(f'`{c}`' for c in allowed)}."
            lines.append(f"| {names} | {cell(said) if said else default_of(option)} | {cell(text)} |")
        lines.append("")
    return "\n".join(lines)


def split_default(text: str) -> tuple[str, str | None]:
    """A help text's own "[default: ...]", taken out of it.

    >>> split_default("Prompts per step. [default: from the model preset]")
    ('Prompts per step.', 'from the model preset')
    """
    body = text.rstrip().rstrip(".")
    start = body.rfind("[default:")
    if start < 0 or not body.endswith("]"):
        return text, None
    return body[:start].strip(), body[start + 9:-1].strip()


def choices_of(option) -> tuple[str, ...]:
    """The values a choice option allows, from its Literal type (config.py states each once)."""
    from typing import Literal, get_args, get_origin

    from minigrpo.config import choices

    kind = option.type_descriptor.annotation
    return choices(kind) if Literal in (get_origin(kind), *map(get_origin, get_args(kind))) else ()


def default_of(option) -> str:
    """The default of an option whose help does not say it: its value."""
    if option.required:
        return "required"
    if option.is_flag:
        return "on" if option.default else "off"
    value = option.default
    if value in (None, (), []):
        return "none"
    return f"`{value}`"


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


if __name__ == "__main__":
    print(render(), end="")
