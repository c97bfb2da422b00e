"""Rewards without a checker: a model grades each completion against a rubric the user writes.

rubric.py holds the judges (`Judge`: the base model in memory or an OpenAI-compatible endpoint; `RewardModel`);
client.py the endpoint's client, where every wait has a deadline.

    from minigrpo.judge import Judge
"""

from minigrpo.judge.rubric import Judge, RewardModel

__all__ = ["Judge", "RewardModel"]
