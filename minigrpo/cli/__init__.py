"""The `minigrpo` command: one module per group of commands, the Python API underneath.

app.py registers them all (and holds eval, check-reward, graduate, models, tasks); train.py holds `train` and
`sft`, after.py `export` and `plot`, talk.py `sample` and `chat`, machine.py `plan`, `doctor` and `bench`,
doctor.py the doctor's checks, and reference.py writes docs/cli.md from the commands themselves.
"""

from minigrpo.cli.app import app, main

__all__ = ["app", "main"]
