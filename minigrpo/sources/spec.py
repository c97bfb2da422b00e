"""What the task sources share: the options written after a library task's name on the command line, and the
fixed held-out slice of a list of rows.

    --task rg:chain_sum:min_terms=2,size=500     reasoning-gym       (minigrpo.sources.reasoning_gym)
    --task vf:envs/arith.py:size=200             verifiers           (minigrpo.sources.verifiers)
    --task openenv:http://127.0.0.1:8000:size=8  an OpenEnv server   (minigrpo.sources.openenv)
"""

from __future__ import annotations

import ast
import json
import random


def parse_spec(spec: str) -> tuple[str, dict]:
    """`PREFIX:NAME` or `PREFIX:NAME:key=value,key=value` -> (NAME, options); values read as Python literals.

    >>> parse_spec("rg:chain_sum:min_terms=2,size=500,allow_negation=False,name=x")
    ('chain_sum', {'min_terms': 2, 'size': 500, 'allow_negation': False, 'name': 'x'})
    """
    _, _, rest = spec.partition(":")
    name, _, options = rest.partition(":")
    parsed = {}
    for item in filter(None, options.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--task {spec}: options are key=value, separated by commas ({item!r} is not)")
        if key.strip() in parsed:
            raise ValueError(f"--task {spec}: {key.strip()} is given twice; give it once")
        try:
            parsed[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            parsed[key.strip()] = value.strip()
    return name, parsed


def held_out_size(rows: int) -> int:
    """The one rule of every task source: of `rows` rows, a tenth is held out, at most 200 (none of fewer than
    ten). A list of rows gives up a slice (split_rows); a generator draws that many more from seeds of its own.

    >>> held_out_size(1000), held_out_size(5000), held_out_size(64), held_out_size(9)
    (100, 200, 6, 0)
    """
    return min(200, rows // 10)


def split_rows(rows: list[dict], split: str, seed: int) -> list[dict]:
    """A fixed, seeded held-out slice for "test" (held_out_size's), the rest for "train", split by prompt: rows that
    repeat a prompt all go where its first one goes, so no held-out prompt is ever trained on. (Without repeats,
    the same rows as a split of the rows themselves.)

    >>> rows = [{"prompt": f"q{i % 12}"} for i in range(24)]  # each prompt twice
    >>> test, train = split_rows(rows, "test", 0), split_rows(rows, "train", 0)
    >>> len(test), len(train), {r["prompt"] for r in test} & {r["prompt"] for r in train}
    (2, 22, set())
    """
    keys = [prompt_key(row) for row in rows]
    distinct = list(dict.fromkeys(keys))
    order = list(range(len(distinct)))
    random.Random(seed).shuffle(order)
    held = {distinct[i] for i in order[:held_out_size(len(distinct))]}
    return [row for row, key in zip(rows, keys) if (key in held) == (split == "test")]


def prompt_key(row: dict) -> str:
    """A row's prompt as one string (a chat's messages included), what decides its split."""
    prompt = row.get("prompt", row)
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def repeated_prompts(rows: list[dict]) -> int:
    """How many rows repeat an earlier row's prompt (kept to that prompt's split: `split_rows`)."""
    return len(rows) - len({prompt_key(row) for row in rows})
