"""Command-line options built from TrainConfig's fields: each option's name, type, default, help, panel, bounds
and choices come from the field's one statement in config.py (`knob`), so a flag cannot disagree with the
config. A command takes the fields it shares with `train`:

    @config_flags("model", "lora_rank", defaults={"model": "qwen-1.5b"})
    def plan(gpu: str = typer.Option(None, ...), **settings): ...   # settings: {"model": ..., "lora_rank": ...}
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Literal, get_args, get_origin, get_type_hints

import typer

from minigrpo.config import TrainConfig

_UNSET = object()


def flag_fields() -> list[dataclasses.Field]:
    """The fields a flag sets: every field but the Python-only ones (`config.python_only`)."""
    return [f for f in dataclasses.fields(TrainConfig) if "help" in f.metadata]


def option(f: dataclasses.Field, default=_UNSET, help: str | None = None) -> inspect.Parameter:
    """The typer option of field `f`, as a parameter of the command's signature (named as the field)."""
    meta = f.metadata
    kind = get_type_hints(TrainConfig)[f.name]
    if get_origin(kind) is list and get_origin(get_args(kind)[0]) is Literal:
        kind = list[str]  # typer takes no list of choices; validate checks each value
    shown = meta["shown"] if default is _UNSET or default is None else None  # a command's own value shows itself
    if default is _UNSET:
        default = [] if f.default_factory is list else f.default
    decls = meta["flag"] or ((f"--{f.name.replace('_', '-')}/--no-{f.name.replace('_', '-')}",)
                             if bool in (kind, *get_args(kind)) else ())
    text = (help or meta["help"]) + (f" [default: {shown}]" if shown else "")
    info = typer.Option(default, *decls, help=text, rich_help_panel=meta["panel"], min=meta["min"], max=meta["max"],
                        show_default=not shown)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=kind)


def config_flags(*names: str, defaults: dict | None = None, helps: dict | None = None):
    """Give the command these fields' options (all of them if none are named): a parameter of the command named as
    a field becomes its option where it stands, the others come after its own and arrive in **settings.
    `defaults` and `helps` change a field's default or help for this command alone."""
    defaults, helps = defaults or {}, helps or {}

    def add(command):
        fields = {f.name: f for f in flag_fields() if not names or f.name in names}
        missing = set(names) - set(fields)
        assert not missing, f"no TrainConfig knob named {missing}"  # a programming error, found at import

        def made(name: str) -> inspect.Parameter:
            return option(fields.pop(name), defaults.get(name, _UNSET), helps.get(name))

        own = [made(p.name) if p.name in fields else p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for p in inspect.signature(command, eval_str=True).parameters.values()
               if p.kind is not inspect.Parameter.VAR_KEYWORD]  # typer passes every parameter by name
        signature = inspect.Signature(own + [made(name) for name in list(fields)])
        command.__signature__ = signature
        # typer reads types from the annotations where they exist: the field's type, not the placeholder's
        command.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()
                                   if p.annotation is not inspect.Parameter.empty}
        return command

    return add


def given(ctx: typer.Context) -> dict:
    """The config fields that flags on this command line set (not their defaults), by field name."""
    fields = {f.name for f in flag_fields()}
    return {name: list(value) if isinstance(value, (list, tuple)) else value for name, value in ctx.params.items()
            if name in fields and getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"}


def settings_of(params: dict) -> dict:
    """The config fields among a command's parameters, lists as lists (typer gives tuples)."""
    fields = {f.name for f in flag_fields()}
    return {name: list(value) if isinstance(value, (list, tuple)) else value for name, value in params.items()
            if name in fields}


class Panelled(typer.core.TyperCommand):
    """A command whose plain --help lists its options under their panels (the field's section of the config)."""

    def format_options(self, ctx, formatter) -> None:
        panels: dict[str, list] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                panels.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        for title, records in panels.items():
            with formatter.section(title):
                formatter.write_dl(records)
