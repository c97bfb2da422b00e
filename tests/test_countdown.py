import time

import pytest

from rewards.countdown import countdown_reward, countdown_reward_lenient, evaluate, make_data

NUMS, TARGET = [3, 5, 7], 20


def reward(text: str) -> float:
    return countdown_reward([text], target=[TARGET], nums=[NUMS])[0]


@pytest.mark.parametrize("text, expected", [
    ("<think>7-3=4, 4*5=20</think>\n<answer>(7 - 3) * 5</answer>", 1.0),
    ("<answer> 5 * (7 - 3) = 20 </answer>", 0.1),  # TinyZero's characters have no "="
    ("<answer>(7 - 3) * 5</answer>\nSo that is it.", 0.0),  # TinyZero reads the last line only
    ("<answer>7 * 5 - 3</answer>", 0.1),  # wrong value
    ("<answer>(7 - 3) * 5 + 3 - 3</answer>", 0.1),  # a number reused
    ("<answer>4 * 5</answer>", 0.1),  # numbers that were not given
    ("<answer>(7 - 3) * 5 * 1</answer>", 0.1),  # an extra number
    ("<answer>7 * 3</answer>", 0.1),  # a number missing
    ("<answer></answer>", 0.1),  # an answer in the right place, though empty
    ("<answer>   </answer>", 0.1),
    ("The answer is (7 - 3) * 5", 0.0),  # no tags
    ("<answer>(7 - 3) * 5", 0.0),  # unclosed tag
    ("<answer>(7 - 3) * 5</answer> wait, no: <answer>7 + 3 + 5</answer>", 0.1),  # the last answer counts
    ("<answer>7 + 3 + 5</answer> wait: <answer>(7 - 3) * 5</answer>", 1.0),
    ("<answer>twenty</answer>", 0.1),
])
def test_countdown_reward(text, expected):
    assert reward(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("<answer> 5 * (7 - 3) = 20 </answer>", 1.0),
    ("<answer>(7 - 3) * 5</answer>\nSo that is it.", 1.0),
    ("no answer", 0.0),
])
def test_the_lenient_reward(text, expected):
    assert countdown_reward(["<answer>3*5+7=22</answer>"], target=[22], nums=[NUMS]) == [0.1]  # as TinyZero
    assert countdown_reward_lenient(["<answer>3*5+7=22</answer>"], target=[22], nums=[NUMS]) == [1.0]
    assert countdown_reward_lenient([text], target=[TARGET], nums=[NUMS]) == [expected]


@pytest.mark.parametrize("text", ["<answer>" * 50_000, "<answer>" * 50_000 + "</answer>", "<answer>1</answer>" * 20_000])
def test_many_tags_take_linear_time(text):
    start = time.perf_counter()
    countdown_reward([text], target=[TARGET], nums=[NUMS])
    countdown_reward_lenient([text], target=[TARGET], nums=[NUMS])
    assert time.perf_counter() - start < 0.5


def test_division_and_float_tolerance():
    assert countdown_reward(["<answer>(1 + 2) / 3 * 6</answer>"], target=[6], nums=[[1, 2, 3, 6]]) == [1.0]
    assert countdown_reward(["<answer>7 / 3 * 3</answer>"], target=[7], nums=[[7, 3, 3]]) == [1.0]


@pytest.mark.parametrize("hostile", [
    "9**9**9",
    "9 ** 999999",
    "1" * 5000,
    "__import__('os').system('echo hacked')",
    "(" * 5000 + "1" + ")" * 5000,
    "()" * 100000,
    "[x for x in range(10**9)]",
    "lambda: 1",
    "2 * " * 3000 + "2",
    "1e308 * 1e308",
    "1 / 0",
])
def test_hostile_answers_are_safe_and_fast(hostile):
    start = time.perf_counter()
    value = reward(f"<answer>{hostile}</answer>")
    assert time.perf_counter() - start < 0.5
    assert value <= 0.1


def test_evaluate_reports_the_numbers_used():
    assert evaluate("(7 - 3) * 5") == (20.0, [3, 5, 7])
    assert evaluate("-3 + 5") == (2.0, [3, 5])
    assert evaluate("7 % 3") is None


def test_generated_problems_are_solvable_and_seeded():
    rows = make_data("train", seed=1)
    assert rows[:5] == make_data("train", seed=1)[:5]
    assert rows[0] != make_data("train", seed=2)[0]
    for row in rows[:200]:
        assert 3 <= len(row["nums"]) <= 4 and all(1 <= n <= 99 for n in row["nums"])
        assert str(row["target"]) in row["prompt"] and "<answer>" in row["prompt"]
