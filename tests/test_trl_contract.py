"""minigrpo held to TRL's GRPOTrainer contract: rewards, tools and environments written for TRL run here unchanged
and score what TRL would give them.

TRL's built-in rewards come from the installed `trl`; the other examples are written here in the shapes TRL's
GRPO trainer documentation gives (each names the section it follows).
"""

import asyncio
import json
import math
import re

import pytest
from typer.testing import CliRunner

from minigrpo.cli.app import app
from minigrpo.scoring import score, trainer_state
from minigrpo.tools import ToolCall, run_call

trl_rewards = pytest.importorskip("trl.rewards")


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "400"})
    return result.exit_code, result.output


def chat(text):
    return [{"role": "assistant", "content": text}]


# --- TRL's own rewards, from the installed trl ---------------------------------------------------------------

COMPLETIONS = [chat("<think>\nadd them\n</think>\nThe answer is $\\boxed{4}$"), chat("it is 5 5 5 5 5 5 5"),
               chat("<think>\nhm</think>\n$\\boxed{5}$"), chat("")]
SOLUTIONS = ["$4$", "$4$", "$4$", "$4$"]
IDS = [[1] * 90, [1] * 70, [1] * 120, []]


@pytest.mark.parametrize("make", [
    lambda: trl_rewards.think_format_reward,
    lambda: trl_rewards.accuracy_reward,
    lambda: trl_rewards.reasoning_accuracy_reward,
    lambda: trl_rewards.get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20),
    lambda: trl_rewards.get_repetition_penalty_reward(ngram_size=3, max_penalty=-1.0),
    lambda: trl_rewards.get_cosine_scaled_reward(max_len=100),
], ids=["think_format", "accuracy", "reasoning_accuracy", "soft_overlong", "repetition", "cosine_scaled"])
def test_trls_rewards_score_here_as_they_score_under_trl(make):
    fn = make()
    # what TRL's trainer passes (its _calculate_rewards): the data's columns, the state, two loggers
    under_trl = fn(prompts=[[{"role": "user", "content": "2 + 2?"}]] * 4, completions=COMPLETIONS,
                   completion_ids=IDS, solution=SOLUTIONS, trainer_state=trainer_state(),
                   log_extra=lambda column, values: None, log_metric=lambda name, value: None)
    here = score([fn], [1.0], [[{"role": "user", "content": "2 + 2?"}]] * 4, COMPLETIONS, IDS,
                 [{"prompt": [{"role": "user", "content": "2 + 2?"}], "solution": s} for s in SOLUTIONS], strict=True)
    name = getattr(fn, "__name__", type(fn).__name__)
    expected = [0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in under_trl]
    assert here.totals == pytest.approx(expected), (name, here.values)


# --- "Using a custom reward function": the state, and logging from a reward ------------------------------------

PROGRESS_REWARDS = '''
def paced(completions, trainer_state, log_extra, log_metric, **kwargs):
    # a curriculum: the reward reads how far training has come (TRL's trainer_state)
    log_metric("paced/global_step", trainer_state.global_step)
    lengths = [len(c[-1]["content"] if isinstance(c, list) else c) for c in completions]
    log_extra("length", lengths)
    return [min(n, 10) / 10 for n in lengths]
'''


def test_trainer_state_log_extra_and_log_metric_reach_the_run(tmp_path):
    (tmp_path / "paced.py").write_text(PROGRESS_REWARDS)
    code, output = cli("train", "--reward", f"{tmp_path / 'paced.py'}:paced", "--steps", "2", "-G", "2",
                       "--prompts-per-step", "2", "--max-new-tokens", "8", "--no-eval-before-after",
                       "--out", tmp_path / "run")
    assert code == 0, output
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["paced/global_step"] for m in metrics] == [0, 1]  # optimizer steps done, as TRL's state counts
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert all(s["extra"]["length"] == len(s["completion"]) for s in samples)


# --- "Tools" and "Agent training": async tools, and episodes shaped as TRL's ----------------------------------

async def lookup(gene: str) -> list:
    """Find interactions of a gene.

    Args:
        gene: The gene's name.
    """
    await asyncio.sleep(0)
    return [(gene, "TP53"), (gene, "MDM2")]


def test_an_async_tool_is_awaited():
    result = run_call({"lookup": lookup}, ToolCall("lookup", {"gene": "BRCA1"}))
    assert result.error is None and json.loads(result.content) == [["BRCA1", "TP53"], ["BRCA1", "MDM2"]]
    assert result.value == [("BRCA1", "TP53"), ("BRCA1", "MDM2")]  # what the rewards get: a list, as in TRL


def structure(completions, **kwargs):
    """Rewards a call that got a response and some prose besides (the shape of TRL's agent example)."""
    out = []
    for completion in completions:
        call = any(t["role"] == "assistant" and t.get("tool_calls") for t in completion)
        response = any(t["role"] == "tool" for t in completion)
        prose = any(t["role"] == "assistant" and not t.get("tool_calls") and t["content"].strip() for t in completion)
        out.append((0.1 if prose else 0.05) if call and response else -0.15 if call else 0.0)
    return out


def evidence(completions, answer, **kwargs):
    """+2 when the rows the tool returned agree with the answer, -1.5 otherwise."""
    out = []
    for completion, ans in zip(completions, answer):
        rows = [r for t in completion if t["role"] == "tool" and isinstance(t["content"], list) for r in t["content"]]
        calls = [c for t in completion for c in t.get("tool_calls", [])]
        where = sum(" where " in c["function"]["arguments"].get("gene", "").lower() for c in calls)
        out.append(0.4 * where + (2.0 if bool(rows) == (ans == "yes") else -1.5))
    return out


def test_an_episode_reaches_rewards_as_trls_would(tiny_model_path):
    from minigrpo.episodes import Episode, Limits, _tool_turn
    from minigrpo.model import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path)
    e = Episode(0, [{"role": "assistant", "content": 'Let me look. <tool_call>{"name": "lookup", "arguments": '
                                                     '{"gene": "BRCA1"}}</tool_call>'}], tools=[lookup])
    e.turns = 1
    _tool_turn(e, tokenizer, Limits(max_new_tokens=8))
    e.messages.append({"role": "assistant", "content": "Yes: *yes*."})
    assert e.messages[0]["tool_calls"] == [{"type": "function", "function": {"name": "lookup",
                                                                          "arguments": {"gene": "BRCA1"}}}]
    assert e.messages[1] == {"role": "tool", "name": "lookup", "content": [("BRCA1", "TP53"), ("BRCA1", "MDM2")]}
    # the values TRL gives this episode: a call, its response and prose; rows that agree with "yes"
    assert structure([e.messages]) == [0.1] and evidence([e.messages], ["yes"]) == [2.0]


# --- "Environments": one from the command line, writing its own prompts ---------------------------------------

ENVIRONMENT = '''
import random


class Sums:
    def reset(self, **kwargs):
        self.a, self.b, self.said = random.randint(1, 9), random.randint(1, 9), None
        return f"What is {self.a} + {self.b}? Check it with the tool, then answer."

    def check(self, answer: int) -> str:
        """Check an answer.

        Args:
            answer: The sum you found.
        """
        self.said = answer
        return "right" if answer == self.a + self.b else "wrong"

    def get_reward(self):
        return float(self.said == self.a + self.b)
'''


def test_an_environment_from_the_command_line_writes_its_own_prompts(tmp_path):
    (tmp_path / "sums.py").write_text(ENVIRONMENT)
    code, output = cli("train", "--environment", f"{tmp_path / 'sums.py'}:Sums", "--steps", "1", "-G", "2",
                       "--prompts-per-step", "2", "--max-new-tokens", "8", "--out", tmp_path / "run")
    assert code == 0, output
    assert "no held-out rows, so the before/after evaluation is skipped" in output
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    prompts = [s["prompt"][-1]["content"] for s in samples]
    assert all(re.fullmatch(r"What is \d \+ \d\? Check it with the tool, then answer\.", p) for p in prompts)
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3]  # a group shares its puzzle
    assert all("Sums" in s["reward_parts"] for s in samples)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["task"] == "environment" and config["environment"].endswith("sums.py:Sums")


# --- check-reward says what training would see -----------------------------------------------------------------

CHECKED = '''
def length(completions, completion_ids, **kwargs):
    return [len(ids) / 10 for ids in completion_ids]


def asked(prompts, completions, **kwargs):
    return [float(p[-1]["content"].endswith("?")) for p in prompts]  # chat prompts stay messages
'''


def test_check_reward_gives_no_false_alarm(tmp_path):
    import warnings

    (tmp_path / "checked.py").write_text(CHECKED)
    (tmp_path / "sums.py").write_text(ENVIRONMENT)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}]}) + "\n"
                                                 for q in ("2 + 2?", "3 + 4?", "1 + 1?")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, output = cli("check-reward", "--task", tmp_path / "data.jsonl", "--reward",
                           f"{tmp_path / 'checked.py'}:length", "--reward", f"{tmp_path / 'checked.py'}:asked",
                           "--prompts", "2", "--samples", "2", "--max-new-tokens", "6", "--max-prompt-tokens", "64")
    assert code == 0, output
    assert not [w for w in caught if "reward function" in str(w.message)], [str(w.message) for w in caught]
    assert "raised" not in output and "always zero" not in output and "scored 0" not in output, output
    code, output = cli("check-reward", "--environment", f"{tmp_path / 'sums.py'}:Sums", "--no-model")
    assert code == 0 and "Sums" in output and "raised" not in output and "unusable" not in output, output
