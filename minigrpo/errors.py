"""How a command ends on a user's mistake: one line naming it, exit status 1, no traceback."""

from __future__ import annotations

import functools

import typer
from rich.console import Console
from rich.markup import escape

from minigrpo.scoring import RewardError


STOPPED_EXIT = 75  # a run stopped before its last step, resumable: sysexits' EX_TEMPFAIL ("try again later")


class Stopped(Exception):
    """A run stopped as asked (SIGINT, SIGTERM, SIGHUP) before its last step: a checkpoint to resume from, no final
    adapter. The command ends with `STOPPED_EXIT`, its message already said."""


def clear_errors(command):
    """A user's mistake (a bad flag value, file, reward, or a machine that cannot run the request) ends the
    command with one line naming it and exit status 1, not a traceback."""
    @functools.wraps(command)
    def run(*args, **kwargs):
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


def is_user_error(error: Exception) -> bool:
    from minigrpo.sandbox.runner import SandboxError
    from minigrpo.startup import SetupError  # imported only here: it brings torch

    return isinstance(error, (RewardError, ValueError, FileNotFoundError, SetupError, SandboxError))
