"""Tasks from reasoning-gym (the installed library, not a stand-in): its prompts, its own scoring, held-out rows
never trained on, and the task from the command line, in check-reward, eval and graduate."""

import json
import sys

import pytest
from typer.testing import CliRunner

from minigrpo import settle
from minigrpo.cli.app import app
from minigrpo.config import TrainConfig
from minigrpo.scoring import score
from minigrpo.tasks import get_task

rg = pytest.importorskip("reasoning_gym")

SMALL = "rg:basic_arithmetic:min_terms=2,max_terms=2,min_digits=1,max_digits=2,size=200"


def said(result) -> str:
    return " ".join(result.output.split())


def test_the_generators_questions_and_its_own_scoring():
    task = get_task(SMALL)
    train, test = task.make_data("train", 0), task.make_data("test", 0)
    assert len(train) == 200 and 0 < len(test) <= 20  # a tenth drawn from another seed, less repeats
    reference = rg.create_dataset("basic_arithmetic", size=200, seed=0, min_terms=2, max_terms=2, min_digits=1,
                                  max_digits=2)
    assert [r["prompt"][-1]["content"] for r in train] == [e["question"] for e in reference]
    assert train[0]["prompt"][0] == {"role": "system", "content": rg.utils.SYSTEM_PROMPTS["default"]}
    # held out: another seed, and nothing that was also drawn for training
    assert not {r["prompt"][-1]["content"] for r in test} & {r["prompt"][-1]["content"] for r in train}
    rows = train[:3]
    completions = [f"Thinking... <answer>{rows[0]['answer']}</answer>", "<answer>-999999</answer>",
                   f"it is {rows[2]['answer']}"]
    result = score(task.rewards, task.weights, [r["prompt"] for r in rows], completions, [[]] * 3, rows)
    expected = [reference.score_answer(a, reference[i]) for i, a in enumerate([rows[0]["answer"], "-999999", None])]
    assert result.values["rg_basic_arithmetic"] == expected == [1.0, 0.0, 0.0]
    assert result.values["answer_format"] == [1.0, 1.0, 0.0]


def test_worked_exchanges_and_the_system_prompt_are_options():
    task = get_task(SMALL + ",system_prompt=direct,shots=2")
    prompt = task.make_data("train", 0)[0]["prompt"]
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert prompt[0]["content"] == rg.utils.SYSTEM_PROMPTS["direct"] and prompt[2]["content"].startswith("<answer>")


def test_partial_false_pays_only_full_credit():
    """reasoning-gym's generic rule pays an answer that merely contains the right one; partial=False does not."""
    rows = get_task(SMALL).make_data("train", 0)[:1]
    right = rows[0]["answer"]
    padded = [f"<answer>{right}</answer>", f"<answer>9{right}</answer>"]
    values = {}
    for spec in (SMALL, SMALL + ",partial=False"):
        task = get_task(spec)
        values[spec] = score(task.rewards, task.weights, [rows[0]["prompt"]] * 2, padded, [[]] * 2,
                             rows * 2).values["rg_basic_arithmetic"]
    assert values[SMALL] == [1.0, len(right) / (len(right) + 1)]
    assert values[SMALL + ",partial=False"] == [1.0, 0.0]


def test_partial_credit_with_the_format_is_not_solved():
    """A four-digit answer inside five is paid 0.8, and with the format's 0.2 totals 1.0: counted as solved under a
    threshold of 1.0, it would lift pass@1; an rg task's own threshold is its full score with the format."""
    task = get_task(SMALL)
    row = next(r for r in task.make_data("train", 0) if len(r["answer"]) == 4)
    completions = [f"<answer>{row['answer']}</answer>", f"<answer>{row['answer']}0</answer>"]
    totals = score(task.rewards, task.weights, [row["prompt"]] * 2, completions, [[]] * 2, [row] * 2).totals
    assert totals[1] == pytest.approx(1.0)
    solved = settle.solved_reward(TrainConfig(task=SMALL), task)
    assert [t >= solved for t in totals] == [True, False]
    assert settle.solved_reward(TrainConfig(task=SMALL, solved_reward=0.5), task) == 0.5  # the run's own, where set


def test_a_small_question_space_is_split_by_question():
    """Two one-digit terms make some two hundred questions: a thousand training rows draw nearly all of them and
    the held-out draw finds none left; held_out=0.3 holds out about 30% of the questions instead, each once, none
    of them trained on or shown as a worked exchange, each scored against its own entry."""
    one_digit = "rg:chain_sum:min_terms=2,max_terms=2,max_digits=1"
    assert get_task(one_digit).make_data("test", 0) == []
    task = get_task(one_digit + ",held_out=0.3,shots=2")
    train, test = task.make_data("train", 0), task.make_data("test", 0)
    question = lambda row: row["prompt"][-1]["content"]  # noqa: E731
    trained, held = {question(r) for r in train}, [question(r) for r in test]
    shown = {m["content"] for m in train[0]["prompt"][:-1] if m["role"] == "user"}
    assert len(shown) == 2 and len(held) == len(set(held)) >= 50
    assert not set(held) & (trained | shown) and 0.2 < len(held) / len(trained | set(held)) < 0.4
    rows = [train[-1], test[-1]]
    result = score(task.rewards, task.weights, [r["prompt"] for r in rows],
                   [f"<answer>{r['answer']}</answer>" for r in rows], [[]] * 2, rows)
    assert result.values["rg_chain_sum"] == [1.0, 1.0]


@pytest.mark.parametrize("spec, says", [
    ("rg:basic_arithmetc", "reasoning-gym has no generator 'basic_arithmetc'; did you mean basic_arithmetic"),
    ("rg:chain_sum:min_terms=0", "rg:chain_sum: reasoning-gym refused the options"),
    ("rg:chain_sum:system_prompt=loud", "system_prompt='loud' is none of reasoning-gym's"),
    ("rg:chain_sum:min_terms", "options are key=value"),
    ("rg:chain_sum:size=0", "rg:chain_sum: size=0 must be a whole number, at least 1"),
    ("rg:chain_sum:seed=abc", "rg:chain_sum: seed='abc' must be a whole number"),
    ("rg:chain_sum:partial=no", "rg:chain_sum: partial='no' must be True or False"),
    ("rg:chain_sum:held_out=1", "rg:chain_sum: held_out=1 must be a share of the questions, between 0 and 1"),
])
def test_bad_names_and_options_are_one_line(spec, says, tmp_path):
    result = CliRunner().invoke(app, ["train", "--task", spec, "--out", str(tmp_path / "run")])
    assert result.exit_code == 1 and says in said(result) and "Traceback" not in result.output, result.output


def test_without_the_library_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    result = CliRunner().invoke(app, ["train", "--task", "rg:chain_sum", "--out", str(tmp_path / "run")])
    assert result.exit_code == 1 and "pip install 'minigrpo[reasoning-gym]'" in said(result), result.output


def test_trains_checks_and_evaluates_from_the_command_line(tmp_path):
    runner = CliRunner()
    checked = runner.invoke(app, ["check-reward", "--task", SMALL, "--no-model"])
    assert checked.exit_code == 0 and "rg_basic_arithmetic" in checked.output and "raised" not in checked.output
    trained = runner.invoke(app, ["train", "--task", SMALL, "--steps", "1", "-G", "2", "--prompts-per-step", "2",
                                  "--max-new-tokens", "16", "--eval-prompts", "4", "--out", str(tmp_path / "run")])
    assert trained.exit_code == 0 and "held-out, 4 prompts never trained on" in said(trained), trained.output
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/rg_basic_arithmetic/mean" in metrics and "reward/answer_format/mean" in metrics
    evaluated = runner.invoke(app, ["eval", "--task", SMALL, "--adapter", str(tmp_path / "run" / "adapter"),
                                    "--prompts", "4", "--samples", "2", "--max-new-tokens", "16"])
    assert evaluated.exit_code == 0 and "pass@k" in evaluated.output, evaluated.output


def test_a_reasoning_gym_task_graduates_to_trl(one_trl_step):
    printed = one_trl_step("--task", SMALL, "-G", "2", "--prompts-per-step", "2", "--max-new-tokens", "8")
    assert "rewards/rg_basic_arithmetic/mean" in printed
