"""What the task sources share: the options written after a library task's name on the command line, and the
fixed held-out slice of a list of rows.

    --task rg:chain_sum:min_terms=2,size=500     reasoning-gym       (minigrpo.sources.reasoning_gym)
    --task vf:envs/arith.py:size=200             verifiers           (minigrpo.sources.verifiers)
    --task openenv:http://127.0.0.1:8000:size=8  an OpenEnv server   (minigrpo.sources.openenv)
"""

from __future__ import annotations

import ast
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
    """A fixed, seeded held-out slice for "test" (held_out_size's); the rest for "train"."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_test = held_out_size(len(rows))
    chosen = order[:n_test] if split == "test" else order[n_test:]
    return [rows[i] for i in sorted(chosen)]
