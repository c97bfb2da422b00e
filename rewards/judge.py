"""Haiku on a topic, graded by a judge: the base model in memory, against a rubric (`minigrpo/judge/`).

No program can say whether a haiku is good; a judge can say roughly how well it meets a rubric. The judge here
is the model being trained with its adapters off, so it costs no memory; it is weak for a tiny model and
fair for a 1.5B one. A program decides what it can first (`gate`: three lines), so the judge is never asked
about prose, and the score shrinks for replies over 200 characters, so padding a reply does not pay.

>>> three_lines("Write a haiku.", "An old silent pond\\nA frog jumps in\\nSplash! Silence again")
True
>>> three_lines("Write a haiku.", "Frogs are amphibians that live near water.")
False

Use a stronger judge by giving it an endpoint (any OpenAI-compatible server):

    haiku_judge = Judge(RUBRIC, name="haiku_judge", endpoint="http://127.0.0.1:8000/v1", model="qwen2.5-7b-instruct")
"""

from __future__ import annotations

import random

from minigrpo.judge import Judge
from minigrpo.tasks import Task

RUBRIC = """A haiku about the requested topic, in three short lines.
10: three lines, vivid and concrete, clearly about the topic, with a turn or surprise in the last line.
6: three lines about the topic, but flat or wordy.
3: about the topic, but not shaped as a haiku.
0: off topic, or not a poem."""

TOPICS = ["the sea", "autumn leaves", "a city at night", "first snow", "an old cat", "morning coffee",
          "a thunderstorm", "the moon", "a train station", "spring rain", "a library", "the desert",
          "a lighthouse", "fireflies", "a bicycle", "the last bus", "a garden", "a kettle", "fog", "a bridge"]


def three_lines(prompt: str, completion: str) -> bool:
    """The gate before the judge: two to four non-empty lines, none of them long."""
    lines = [line for line in completion.strip().splitlines() if line.strip()]
    return 2 <= len(lines) <= 4 and all(len(line) <= 80 for line in lines)


haiku_judge = Judge(RUBRIC, name="haiku_judge", gate=three_lines, max_chars=200, max_tokens=64)


def make_data(split: str, seed: int) -> list[dict]:
    topics = TOPICS[4:] if split == "train" else TOPICS[:4]  # held-out topics
    rng = random.Random(f"haiku-{split}-{seed}")
    rows = [{"prompt": f"Write a haiku about {topic}. Reply with the three lines only."} for topic in topics]
    return rng.sample(rows * 4, len(rows) * 4)


TASK = Task(
    name="haiku",
    description="haiku on a topic, graded by the base model against a rubric (a judge reward, no checker)",
    make_data=make_data,
    rewards=[haiku_judge],
)
