"""Data files: rows read from .jsonl, .json, .csv or .parquet, each checked for a prompt the model can be given;
any fault is one line naming the file, the line or row, and what is wrong with it."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def read_rows(path: Path) -> list[dict]:
    """Rows of a data file; a malformed line or a row without a usable `prompt` is an error that names it."""
    return read_rows_and_places(path)[0]


def read_rows_and_places(path: Path, prompts: bool = True) -> tuple[list[dict], list[str]]:
    """The rows, and where each is in the file ("line 7" of a .jsonl, "row 7" otherwise), for messages; each
    checked for a usable `prompt` unless not `prompts` (data of another shape: SFT's `messages`)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; --task takes a data file ({', '.join(DATA_SUFFIXES)})")
    if path.suffix in (".jsonl", ".json", ".csv"):
        text = _text_of(path)
    if path.suffix == ".jsonl":
        rows, places = [], []
        for number, line in enumerate(text.split("\n"), start=1):  # "\n" only: U+2028 may sit inside a string
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}, line {number}: not valid JSON ({error.msg}): {line[:80]!r}") from None
            places.append(f"line {number}")
    elif path.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}, line {error.lineno}: not valid JSON ({error.msg})") from None
    elif path.suffix == ".csv":
        rows = list(csv.DictReader(io.StringIO(text, newline="")))
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"{path}: unknown data format; use one of {', '.join(DATA_SUFFIXES)}")
    if path.suffix != ".jsonl":
        places = [f"row {i}" for i in range(1, len(rows) + 1)] if isinstance(rows, list) else []
    if prompts:
        refuse_bad_rows(rows, str(path), places)
    elif not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{path}: expected a list of objects, one per example")
    return rows, places


def _text_of(path: Path) -> str:
    """The file as UTF-8 (a byte-order mark is fine); anything else is an error naming the first bad line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise ValueError(f"{path}, line {line}: not UTF-8 text (byte {data[error.start]:#04x}); save the file as "
                         f"UTF-8") from None


def refuse_bad_rows(rows, source: str, places: list[str] | None = None) -> None:
    """Every row an object with a `prompt` that is text or a list of chat messages."""
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{source}: no rows (expected a list of objects with a 'prompt' field)")
    for i, row in enumerate(rows):
        where = places[i] if places else f"row {i + 1}"
        if not isinstance(row, dict):
            raise ValueError(f"{source}, {where}: a row must be an object with a 'prompt' field, not "
                             f"{type(row).__name__} {json.dumps(row, default=str)[:60]}")
        if "prompt" not in row:
            raise ValueError(f"{source}, {where}: no 'prompt' column (it has {sorted(row)})")
        problem = prompt_problem(row["prompt"])
        if problem:
            raise ValueError(f"{source}, {where}: {problem}")


def prompt_problem(prompt) -> str | None:
    """Why `prompt` is not one the model can be given, or None.

    >>> prompt_problem([{"role": "user", "content": "hi"}]) is None
    True
    >>> prompt_problem(5)
    "'prompt' is int 5; it must be text, or a list of chat messages with 'role' and 'content' text"
    """
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return None
    shown = json.dumps(prompt, default=str)
    what = "null" if prompt is None else f"{type(prompt).__name__} {shown[:60]}{'...' if len(shown) > 60 else ''}"
    return f"'prompt' is {what}; it must be text, or a list of chat messages with 'role' and 'content' text"
