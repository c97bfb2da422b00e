"""Overlong penalty (DAPO): nothing up to a soft limit, then linearly down to -1 at the hard limit.

>>> penalty = overlong_penalty(max_tokens=100, buffer=20)
>>> penalty(completions=["a", "b", "c", "d"], completion_ids=[[0] * 50, [0] * 80, [0] * 90, [0] * 100])
[0.0, 0.0, -0.5, -1.0]
"""

from __future__ import annotations

from typing import Callable


def overlong_penalty(max_tokens: int, buffer: int) -> Callable[..., list[float]]:
    """A reward function: 0 up to `max_tokens - buffer` tokens, falling linearly to -1 at `max_tokens`."""
    if not 0 < buffer <= max_tokens:
        raise ValueError("buffer must be in (0, max_tokens]")
    soft = max_tokens - buffer

    def overlong(completions: list, completion_ids: list[list[int]], **kwargs) -> list[float]:
        return [max(-1.0, min(0.0, (soft - len(ids)) / buffer)) for ids in completion_ids]

    return overlong
