"""The `minigrpo` command: one module per group of commands, the Python API underneath.

app.py registers them all (eval, check-reward, export, graduate, plot, tasks); train.py holds `train` and `sft`,
talk.py `sample` and `chat`, machine.py `plan`, `doctor` and `bench`, doctor.py the doctor's checks, and
reference.py writes docs/cli.md from the commands themselves.
"""

from minigrpo.cli.app import app, main

__all__ = ["app", "main"]
