"""The reward contract: per-sample and batch forms, None, parts, async, and errors that name the culprit."""

import asyncio
import json

import pytest

from minigrpo import per_sample
from minigrpo.scoring import RewardError, Scores, score
from minigrpo.data import read_rows
from minigrpo.tasks import get_task, load_reward

ROWS = [{"prompt": "p1", "answer": "a"}, {"prompt": "p2", "answer": "b"}]


def contains_answer(prompts, completions, answer, **kwargs):
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]


def test_batch_rewards_weights_and_none():
    def only_first(prompts, completions, **kwargs):
        return [0.5, None]

    s = score([contains_answer, only_first], [1.0, 2.0], ["p1", "p2"], ["xa", "zz"], [[], []], ROWS)
    assert s.totals == [2.0, 0.0]
    assert s.values == {"contains_answer": [1.0, 0.0], "only_first": [0.5, None]}


def test_per_sample_rewards_with_parts():
    @per_sample
    def shaped(completion: str, answer: str, **example) -> dict:
        return {"right": float(answer in completion), "short": 0.1 if len(completion) < 3 else 0.0}

    s = score([shaped], [1.0], ["p1", "p2"], ["xa", "long b"], [[], []], ROWS)
    assert s.totals == pytest.approx([1.1, 1.0])
    assert s.parts == {"shaped/right": [1.0, 1.0], "shaped/short": [0.1, 0.0]}


def test_chat_completions_reach_per_sample_rewards_as_text():
    @per_sample
    def says_hi(completion: str, **example) -> float:
        return float(completion == "hi")

    chat = [[{"role": "assistant", "content": "hi"}], [{"role": "assistant", "content": "no"}]]
    assert score([says_hi], [1.0], [[], []], chat, [[], []], ROWS).totals == [1.0, 0.0]


def test_async_rewards_are_awaited():
    async def slow(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        return [len(c) for c in completions]

    assert score([slow], [1.0], ["p1", "p2"], ["ab", "c"], [[], []], ROWS).totals == [2.0, 1.0]


def test_a_raising_reward_scores_zero_only_where_it_fails_and_is_counted():
    def fragile(prompts, completions, **kwargs):
        return [1.0 / len(c) for c in completions]  # raises on the empty completion

    with pytest.warns(UserWarning, match="fragile raised ZeroDivisionError"):
        s = score([fragile], [1.0], ["p1", "p2"], ["ab", ""], [[], []], ROWS)
    assert s.totals == [0.5, 0.0] and s.errors == {"fragile": 1}
    with pytest.raises(RewardError, match="fragile raised ZeroDivisionError"):
        score([fragile], [1.0], ["p1", "p2"], ["ab", ""], [[], []], ROWS, strict=True)


@pytest.mark.parametrize("returned, message", [
    ([1.0], "returned 1 values for 2 completions"),
    (None, "returned NoneType"),
    ([1.0, "yes"], "'yes' for completion 1"),
    ([1.0, float("nan")], "nan for completion 1"),
    ([float("inf"), 1.0], "inf for completion 0"),
])
def test_broken_contracts_name_the_function_and_why(returned, message):
    def broken(prompts, completions, **kwargs):
        return returned

    with pytest.raises(RewardError, match="broken") as error:
        score([broken], [1.0], ["p1", "p2"], ["a", "b"], [[], []], ROWS)
    assert message in str(error.value)


def test_a_missing_column_is_named():
    def needs_target(prompts, completions, target, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match=r"needs_target needs the column\(s\) \['target'\]"):
        score([needs_target], [1.0], ["p1", "p2"], ["a", "b"], [[], []], ROWS)


def test_data_files_and_their_errors(tmp_path):
    good = tmp_path / "data.jsonl"
    good.write_text('{"prompt": "hi", "answer": "a"}\n\n{"prompt": "yo", "answer": "b"}\n')
    assert [r["answer"] for r in read_rows(good)] == ["a", "b"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"prompt": "yo", \n')
    with pytest.raises(ValueError, match="bad.jsonl, line 2: not valid JSON"):
        read_rows(bad)
    no_prompt = tmp_path / "np.jsonl"
    no_prompt.write_text('{"prompt": "hi"}\n{"question": "yo"}\n')
    with pytest.raises(ValueError, match=r"np.jsonl, line 2: no 'prompt' column \(it has \['question'\]\)"):
        read_rows(no_prompt)
    as_csv = tmp_path / "d.csv"
    as_csv.write_text("prompt,answer\nhi,a\n")
    assert read_rows(as_csv) == [{"prompt": "hi", "answer": "a"}]
    as_json = tmp_path / "d.json"
    as_json.write_text(json.dumps([{"prompt": "hi"}]))
    assert read_rows(as_json) == [{"prompt": "hi"}]


def test_tasks_from_files_and_rewards_from_files(tmp_path):
    (tmp_path / "my_reward.py").write_text(
        "from minigrpo import per_sample\n\n@per_sample\ndef polite(completion, **example):\n"
        "    return 1.0 if 'please' in completion else 0.0\n")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"ask {i}"}) + "\n" for i in range(20)))
    task = get_task(str(data), [f"{tmp_path / 'my_reward.py'}:polite"])
    assert task.reward_names == ["polite"] and task.weights == [1.0]
    train, test = task.make_data("train", 0), task.make_data("test", 0)
    assert len(train) == 18 and len(test) == 2 and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    with pytest.raises(ValueError, match="has no reward function"):
        get_task(str(data))
    with pytest.raises(ValueError, match="must be file.py:function"):
        load_reward("nothing")
    assert load_reward("rewards.format:format_reward")(completions=["<answer>1</answer>"]) == [0.5]


def test_check_reward_reports_the_share_of_groups_grpo_can_learn_from():
    from minigrpo.check import learnable_share
    from minigrpo.tasks import Task

    def exact(completions, answer, **kw):
        return [float(c == a) for c, a in zip(completions, answer)]

    task = Task("t", "", lambda split, seed: [], [exact])
    rows = [{"prompt": "p", "answer": "x"}] * 2 + [{"prompt": "q", "answer": "y"}] * 2 \
        + [{"prompt": "r", "answer": "z"}] * 2 + [{"prompt": "s", "answer": "w"}] * 2
    share, warning = learnable_share(task, rows, ["x", "no", "no", "no", "no", "no", "no", "no"], group_size=2)
    assert share == 0.25 and warning is None  # one group of four has spread: enough to say nothing
    share, warning = learnable_share(task, rows, ["no"] * 8, group_size=2)
    assert share == 0.0 and "every completion scored 0" in warning and "too hard" in warning
    share, warning = learnable_share(task, rows, ["x", "x", "no", "no", "z", "z", "w", "w"], group_size=2)
    assert share == 0.0 and "scored the same" in warning  # all-right or all-wrong groups: nothing to compare


def test_a_reward_can_mark_a_completion_it_could_not_score():
    import warnings

    def picky(completions, **kw):
        return [1.0 if c == "ok" else ValueError(f"cannot read {c!r}") for c in completions]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = score([picky], [1.0], ["p", "p"], ["ok", "??"], [[], []], [{"prompt": "p"}] * 2)
    assert result.totals == [1.0, 0.0] and result.errors == {"picky": 1}
    assert "could not score 1 of 2" in str(caught[0].message) and "cannot read" in str(caught[0].message)
    with pytest.raises(RewardError, match="could not score a completion"):
        score([picky], [1.0], ["p", "p"], ["ok", "??"], [[], []], [{"prompt": "p"}] * 2, strict=True)


def test_groups_are_picked_and_joined_field_by_field():
    """Filtering groups and refilling them go over every field of a batch by how it follows its completions (per
    prompt, per completion, columns, summed, pooled), so a field added later cannot be forgotten in one of them."""
    import dataclasses

    from minigrpo.rollout import Groups

    def batch(tag: str, prompts: int, G: int = 2) -> Groups:
        n = prompts * G
        return Groups([{"prompt": f"{tag}{i}"} for i in range(prompts)], [[i] for i in range(prompts)],
                      [[i] for i in range(n)], [f"{tag}{i}" for i in range(n)], [False] * n, None,
                      Scores([float(i) for i in range(n)], {"r": [1.0] * n}, {}, {"r": 1}, {"seen": list(range(n))},
                             {"judge/s": [0.5]}), 1.0, 2.0, None, {"turns": 3})

    both = batch("a", 2) + batch("b", 1)
    assert both.completions == ["a0", "a1", "a2", "a3", "b0", "b1"] and both.sampler_logps is None
    assert [r["prompt"] for r in both.rows] == ["a0", "a1", "b0"] and both.generate_s == 2.0
    assert both.scores.errors == {"r": 2} and both.scores.metrics == {"judge/s": [0.5, 0.5]}
    assert both.scores.extra == {"seen": [0, 1, 2, 3, 0, 1]} and both.episode_stats == {"turns": 6}
    kept = both.select([0, 2], 2)
    assert kept.completions == ["a0", "a1", "b0", "b1"] and kept.scores.totals == [0.0, 1.0, 0.0, 1.0]
    assert [r["prompt"] for r in kept.rows] == ["a0", "b0"] and kept.scores.extra == {"seen": [0, 1, 0, 1]}
    assert all("along" in f.metadata for kind in (Groups, Scores) for f in dataclasses.fields(kind))
