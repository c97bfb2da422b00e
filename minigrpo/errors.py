"""How a command ends on a user's mistake: one line naming it, exit status 1, no traceback."""

from __future__ import annotations

import functools

import typer
from rich.console import Console
from rich.markup import escape

from minigrpo.scoring import RewardError


STOPPED_EXIT = 75  # a run stopped before its last step, resumable: sysexits' EX_TEMPFAIL ("try again later")


class SetupError(RuntimeError):
    """A run that cannot start as asked, with the fix in its message (the command line prints just that)."""


class Stopped(Exception):
    """A run stopped as asked (SIGINT, SIGTERM, SIGHUP) before its last step: a checkpoint to resume from, no final
    adapter. The command ends with `STOPPED_EXIT`, its message already said."""


def clear_errors(command):
    """A user's mistake (a bad flag value, file, reward, or a machine that cannot run the request) ends the
    command with one line naming it and exit status 1, not a traceback."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        empty = next((name for name, value in kwargs.items() if _is_empty(value)), None)
        if empty:  # a path, a name or a spec left blank ("--out ''", an unset shell variable): never meant
            raise typer.BadParameter(f"{_flag(command, empty)} is empty; give a value (--help says what it takes)")
        try:
            return command(*args, **kwargs)
        except Stopped:
            raise typer.Exit(STOPPED_EXIT) from None
        except Exception as error:
            if isinstance(error, typer.BadParameter) or not is_user_error(error):
                raise
            # the message's own brackets ("minigrpo[reasoning-gym]") are text, not markup
            Console(stderr=True).print(f"[bold red]error[/]: {escape(str(error))}", highlight=False)
            raise typer.Exit(1) from None

    return run


def _is_empty(value) -> bool:
    return any(isinstance(v, str) and not v.strip() for v in (value if isinstance(value, (list, tuple)) else [value]))


def _flag(command, name: str) -> str:
    """How the command line spells parameter `name`: its option's long flag, or its argument's metavar."""
    import inspect

    info = inspect.signature(command).parameters[name].default
    if isinstance(info, typer.models.ArgumentInfo):
        return name.upper()
    return next((d for d in getattr(info, "param_decls", None) or () if d.startswith("--")),
                f"--{name.replace('_', '-')}")


def is_user_error(error: Exception) -> bool:
    from minigrpo.sandbox.runner import SandboxError

    return isinstance(error, (RewardError, ValueError, FileNotFoundError, SetupError, SandboxError))
