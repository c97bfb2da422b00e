"""Held-out rows are never trained on, whatever the task's source: every built-in task, a data file (repeated rows
included), and reasoning-gym's generators; and the specs that could not keep them apart are refused in one line."""

import json

import pytest

from minigrpo.sources.spec import prompt_key
from minigrpo.tasks import BUILT_IN, get_task


def _data_task(path):
    reward = path.parent / "reward.py"
    reward.write_text("def zero(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    return get_task(str(path), [f"{reward}:zero"])


def _apart(task, seed: int = 0) -> tuple[int, int, set]:
    train, test = task.make_data("train", seed), task.make_data("test", seed)
    return len(train), len(test), {prompt_key(r) for r in test} & {prompt_key(r) for r in train}


@pytest.mark.parametrize("name", sorted(set(BUILT_IN) - {"guess"}))
def test_no_held_out_prompt_of_a_built_in_task_is_a_training_prompt(name):
    trained, held_out, both = _apart(get_task(name))
    assert trained and not both, (name, len(both))  # the code task trained on its held-out problem too


def test_the_guessing_games_held_out_games_are_draws_of_their_own():
    """guess opens every game with one of two prompts by design: the secret is the environment's hidden state, which
    no prompt shows, so a prompt cannot be held out; its held-out games are a seed stream of their own."""
    task = get_task("guess")
    train, test = task.make_data("train", 0), task.make_data("test", 0)
    assert len({json.dumps(r["prompt"]) for r in train + test}) <= 2  # one of two openings, whatever the secret
    assert [r["secret"] for r in test] != [r["secret"] for r in train][:len(test)]


def test_a_data_files_repeated_rows_are_kept_to_one_split(tmp_path):
    rows = [{"prompt": f"What is {i % 40} + 1?", "answer": str(i % 40 + 1)} for i in range(120)]  # each thrice
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trained, held_out, both = _apart(_data_task(tmp_path / "rows.jsonl"))
    assert not both and held_out == 12 and trained == 108  # 4 of the 40 prompts held out, each with its repeats


def test_a_data_files_repeats_are_counted_in_the_runs_notes(tmp_path):
    from minigrpo import settle
    from minigrpo.config import TrainConfig

    rows = [{"prompt": f"q{i % 20}", "answer": "1"} for i in range(60)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = _data_task(tmp_path / "rows.jsonl")
    _, note = settle.evaluation(TrainConfig(task=str(tmp_path / "rows.jsonl")), task, task.make_data("train", 0))
    assert note and "40 rows repeat an earlier row's prompt" in note, note


@pytest.mark.parametrize("spec", ["rg:basic_arithmetic:min_terms=2,max_terms=2,size=200",
                                  "rg:basic_arithmetic:min_terms=2,max_terms=2,min_digits=1,max_digits=1,size=200,"
                                  "held_out=0.3"])
def test_no_held_out_question_of_reasoning_gym_is_a_training_one(spec):
    pytest.importorskip("reasoning_gym")
    trained, held_out, both = _apart(get_task(spec))
    assert trained and held_out and not both


@pytest.mark.parametrize("spec, says", [
    ("rg:basic_arithmetic:min_terms=2,max_terms=2,min_digits=1,max_digits=1,size=20,held_out=0.999",
     "keeps every one of the 20 questions drawn for training out of it"),
    ("rg:basic_arithmetic:size=20,size=30", "size is given twice"),
])
def test_a_spec_that_cannot_keep_the_splits_apart_is_one_line(spec, says):
    pytest.importorskip("reasoning_gym")
    from typer.testing import CliRunner

    from minigrpo.cli.app import app

    result = CliRunner().invoke(app, ["train", "--task", spec, "--steps", "1"])
    said = " ".join(result.output.split())
    assert result.exit_code != 0 and says in said and "Traceback" not in said, said
