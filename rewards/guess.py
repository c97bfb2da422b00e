"""Guess a number from 1 to 9 over several turns, told "higher" or "lower" after each wrong guess.

A multi-turn game with feedback, in the environment contract (`minigrpo/episodes.py`): the environment
holds the secret and answers each of the model's turns as the user (`respond`); the episode ends at the
right number or at --max-turns. A turn's guess is its first number. The reward reads the transcript: 1.0
when the model's last turn guesses the secret; short of that, up to 0.5 for how close its last guess came,
so a model that follows the hints earns more than one that guesses blindly, and a tiny model that only
learns to answer with a number still sees a gradient (four turns of halving find any secret from 1 to 9).

Each prompt opens with one worked game (5, "Higher.", 7, "Lower.", 6, found): a small model asked for "one
number" otherwise writes prose, runs into the turn's token limit (which ends the episode) and never hears a
hint; shown a game, it answers with bare numbers, so its episodes have the turns in which hints can be followed.

>>> guess_reward([[{"role": "assistant", "content": "5"}, {"role": "user", "content": "Higher."},
...                {"role": "assistant", "content": "Is it 7?"}]], secret=[7])
[1.0]
>>> guess_reward([[{"role": "assistant", "content": "5"}, {"role": "user", "content": "Higher."}]], secret=[7])
[0.375]
>>> guess_reward([[{"role": "assistant", "content": "I think 1000."}], "no idea"], secret=[7, 7])
[0.0, 0.0]
>>> game = Hints(); game.reset(secret=7)
>>> game.respond("My guess is 4."), game.respond("9"), game.respond("no idea"), game.respond("7")
('Higher.', 'Lower.', 'Say one number from 1 to 9.', None)

A turn's guess is its first number, so listing several is no way round the hints (a model under RL soon
tries that where the last number counts):

>>> game.respond("5, 6, 7"), guess_reward([[{"role": "assistant", "content": "5, 6, 7"}]], secret=[7])
('Higher.', [0.375])
"""

from __future__ import annotations

import random
import re

from minigrpo.scoring import text_of
from minigrpo.tasks import Task

NUMBER = re.compile(r"\d+")


class Hints:
    """The secret, and the hint after each guess."""

    def reset(self, secret: int, **row) -> None:
        self.secret = secret

    def respond(self, message: str) -> str | None:
        found = NUMBER.findall(message)
        if not found:
            return "Say one number from 1 to 9."
        guess = int(found[0])
        if guess == self.secret:
            return None  # found: the episode ends
        return "Higher." if guess < self.secret else "Lower."


def last_guess(episode) -> str | None:
    """The guess of the model's last turn: its first number."""
    turns = [m for m in episode if m["role"] == "assistant"] if isinstance(episode, list) else []
    found = NUMBER.findall(text_of(turns[-1:]) if turns else text_of(episode))
    return str(int(found[0])) if found else None


def guess_reward(completions: list, secret: list[int], **kwargs) -> list[float]:
    """1.0 when the model's last turn guesses the secret; else 0.5 x (1 - distance / 8) for a last guess from
    1 to 9, and 0.0 without one."""
    scores = []
    for episode, x in zip(completions, secret):
        guess = int(last_guess(episode) or 0)
        scores.append(1.0 if guess == x else 0.5 * (1 - abs(guess - x) / 8) if 1 <= guess <= 9 else 0.0)
    return scores


PHRASINGS = ["I am thinking of a number from 1 to 9. Guess it: answer with one number, and I will say higher or "
             "lower.", "Guess my number (1 to 9). Reply with a single number each turn."]

# the game every prompt opens with: bare numbers, each following the hint before it (the secret was 6)
WORKED = [{"role": "user", "content": PHRASINGS[0]}, {"role": "assistant", "content": "5"},
          {"role": "user", "content": "Higher."}, {"role": "assistant", "content": "7"},
          {"role": "user", "content": "Lower."}, {"role": "assistant", "content": "6"}]


def make_data(split: str, seed: int) -> list[dict]:
    rng = random.Random(f"guess-{split}-{seed}")
    rows = []
    for _ in range(200 if split == "train" else 64):
        ask = {"role": "user", "content": f"Right, it was {WORKED[-1]['content']}. A new game. {rng.choice(PHRASINGS)}"}
        rows.append({"prompt": [*WORKED, ask], "secret": rng.randint(1, 9)})
    return rows


TASK = Task(
    name="guess",
    description="multi-turn: guess a number from 1 to 9 told higher or lower (an environment that talks)",
    make_data=make_data,
    rewards=[guess_reward],
    answer=last_guess,
    environment=Hints,
    examples=[{"prompt": "Guess my number (1 to 9).", "secret": 3, "expected": 1.0,
               "completion": [{"role": "assistant", "content": "5"}, {"role": "user", "content": "Lower."},
                              {"role": "assistant", "content": "3"}]}],
)
