"""`minigrpo check-reward`'s gaming probes: three rewards a policy could game (length pays, any number pays, the
format alone pays) are each named with the way to game them, and the built-in tasks' rewards with none."""

import pytest
from typer.testing import CliRunner

from minigrpo.cli.app import app
from minigrpo.gaming import gamed
from minigrpo.tasks import BUILT_IN, Task, get_task

EXAMPLES = [{"prompt": "What is 2 + 3?", "answer": "5", "completion": "<answer>5</answer>", "expected": 1.0},
            {"prompt": "What is 4 + 4?", "answer": "8", "completion": "<answer>8</answer>", "expected": 1.0}]


def right_and_long(completions, answer, **kw):  # length pays: a bonus per character on top of the right answer
    return [float(f">{a}<" in c) + len(c) / 1000 for c, a in zip(completions, answer)]


def any_number(completions, **kw):  # any number pays
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def tags(completions, **kw):  # the format alone pays as much as a right answer
    return [float(c.startswith("<answer>") and c.endswith("</answer>")) for c in completions]


def right(completions, answer, **kw):
    return [float(f"<answer>{a}</answer>" == c.strip()) for c, a in zip(completions, answer)]


@pytest.mark.parametrize("reward, way", [(right_and_long, "the answer buried in filler"),
                                         (any_number, "another prompt's answer"),
                                         (tags, "the format alone (its numbers taken out)")])
def test_a_gameable_reward_is_named_with_the_way_to_game_it(reward, way):
    found = gamed(Task("t", "", lambda split, seed: [], [reward], examples=EXAMPLES))
    assert way in [g.probe for g in found] and all(g.rewards == [reward.__name__] for g in found), found


def test_an_honest_reward_and_every_built_in_task_is_not_gameable_this_way():
    assert gamed(Task("t", "", lambda split, seed: [], [right], examples=EXAMPLES)) == []
    # a format bonus beside the right answer is honest: the format alone earns only the bonus
    assert gamed(Task("t", "", lambda split, seed: [], [right, tags], [1.0, 0.1], examples=EXAMPLES)) == []
    assert {name: [str(g) for g in gamed(get_task(name))] for name in BUILT_IN} == {name: [] for name in BUILT_IN}


def test_check_reward_says_so(tmp_path):
    (tmp_path / "task.py").write_text(
        "from minigrpo.tasks import Task\n"
        "def any_number(completions, **kw):\n"
        "    return [float(any(ch.isdigit() for ch in c)) for c in completions]\n"
        "ROWS = [{'prompt': 'What is 1 + 1?', 'answer': '2'}, {'prompt': 'What is 2 + 2?', 'answer': '4'}]\n"
        f"TASK = Task('numbers', '', lambda split, seed: ROWS, [any_number], examples={EXAMPLES!r})\n")
    result = CliRunner().invoke(app, ["check-reward", "--task", str(tmp_path / "task.py"), "--no-model"])
    flat = " ".join(result.output.split())
    assert result.exit_code == 0, (result.output, result.exception)
    assert "gameable: another prompt's answer is paid 1.00 in total, as much as the right completion" in flat, flat
