"""The episode loop: model turns and tool results alternating, batched turn by turn, ended by an answer, the
turn limit or the token budget; its tokens continue the context exactly as the chat template renders it."""

import pytest
import torch

from minigrpo.episodes import Limits, run_episodes
from minigrpo.generate import Rollout
from minigrpo.model import load_tokenizer
from minigrpo.tools import render

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


class Scripted:
    """Stands in for the model where a test needs given replies (the tiny model never writes a tool call):
    at its k-th call every row gets the k-th scripted text, ended by the end-of-turn token unless `cut`.
    It records what it was asked to continue."""

    def __init__(self, tokenizer, turns: list[str], cut: bool = False):
        self.tokenizer, self.turns, self.cut, self.asked = tokenizer, turns, cut, []

    def generate(self, prompt_ids, sampling):
        self.asked.append(([list(p) for p in prompt_ids], sampling))
        ids = self.tokenizer(self.turns[len(self.asked) - 1], add_special_tokens=False).input_ids
        ids = ids[:sampling.max_new_tokens] if self.cut else ids + [self.tokenizer.eos_token_id]
        rows = len(prompt_ids) * sampling.n
        return Rollout([list(ids) for _ in range(rows)], [self.cut] * rows, [[-0.5] * len(ids) for _ in range(rows)])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return load_tokenizer(tiny_model_path)


def prompt(tokenizer, question="What is 2 + 40?"):
    messages = [{"role": "user", "content": question}]
    return messages, tokenizer(render(tokenizer, messages, [add]), add_special_tokens=False).input_ids


def test_a_tool_call_then_an_answer(tokenizer):
    messages, ids = prompt(tokenizer)
    model = Scripted(tokenizer, [CALL, "It is 42."])
    (e, f) = run_episodes(model, tokenizer, [add], [ids], 2, Limits(max_new_tokens=64))
    assert [m["role"] for m in e.messages] == ["assistant", "tool", "assistant"]
    assert e.messages[1]["content"] == "42" and e.messages[2]["content"] == "It is 42."
    assert (e.turns, e.tool_calls, e.tool_errors, e.cut, e.truncated) == (2, 1, {}, None, False)
    # batched turn by turn: the first turn one prefill per prompt, then each live episode on its own row
    (first, s1), (second, s2) = model.asked
    assert (first, s1.n) == ([ids], 2) and s2.n == 1 and len(second) == 2
    # the second turn continues exactly what the template renders for the whole conversation so far
    assert tokenizer.decode(second[0]) == render(tokenizer, messages + e.messages[:2], [add])
    # model tokens are marked, the tool's are not; the sampler's log-probs line up with the tokens
    call_ids = tokenizer(CALL, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    answer = tokenizer("It is 42.", add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    tool_len = len(e.ids) - len(call_ids) - len(answer)
    assert e.ids[:len(call_ids)] == call_ids and e.ids[-len(answer):] == answer and tool_len > 0
    assert e.mask == [True] * len(call_ids) + [False] * tool_len + [True] * len(answer)
    assert e.logps == [-0.5] * len(call_ids) + [0.0] * tool_len + [-0.5] * len(answer)
    assert f.ids == e.ids and f.group == 0


def test_the_turn_limit_ends_an_episode_that_keeps_calling(tokenizer):
    _, ids = prompt(tokenizer)
    (e,) = run_episodes(Scripted(tokenizer, [CALL, CALL, CALL]), tokenizer, [add], [ids], 1,
                        Limits(max_new_tokens=64, max_turns=2))
    assert (e.turns, e.tool_calls, e.cut, e.truncated) == (2, 1, "turns", True)
    assert e.mask[-1] is True, "it ends on the model's turn: the unanswered call's result is not appended"


def test_the_token_budget_ends_an_episode(tokenizer):
    _, ids = prompt(tokenizer)
    call_len = len(tokenizer(CALL, add_special_tokens=False).input_ids) + 1
    (e,) = run_episodes(Scripted(tokenizer, [CALL, "It is 42."]), tokenizer, [add], [ids], 1,
                        Limits(max_new_tokens=64, max_episode_tokens=call_len + 3))
    assert (e.turns, e.cut) == (1, "tokens") and len(e.ids) <= call_len + 3
    model = Scripted(tokenizer, ["a very long reply that runs past its limit"], cut=True)
    (e,) = run_episodes(model, tokenizer, [add], [ids], 1, Limits(max_new_tokens=4))
    assert (e.turns, e.cut, len(e.ids)) == (1, "tokens", 4)


def test_failed_calls_are_counted_and_answered(tokenizer):
    _, ids = prompt(tokenizer)
    bad = '<tool_call>{"name": "sub", "arguments": {}}</tool_call> <tool_call>{"name": "add"}</tool_call>'
    (e,) = run_episodes(Scripted(tokenizer, [bad, "Sorry."]), tokenizer, [add], [ids], 1, Limits(max_new_tokens=64))
    assert e.tool_calls == 2 and e.tool_errors == {"unknown": 1, "arguments": 1}
    assert e.messages[1]["content"].startswith("error: unknown tool 'sub'") and e.turns == 2


def test_episodes_with_the_real_model_and_generator(tiny_model_path, tokenizer):
    from minigrpo.config import TrainConfig
    from minigrpo.generate.hf import HFGenerator
    from minigrpo.model import load_policy

    torch.manual_seed(0)
    policy = load_policy(TrainConfig(lora_rank=4, load_in_4bit=False, dtype="float32"), tiny_model_path, torch.float32)
    _, a = prompt(tokenizer)
    _, b = prompt(tokenizer, "Use the add tool to add 3 and 4.")
    episodes = run_episodes(HFGenerator(policy, tokenizer, report_logprobs=True), tokenizer, [add], [a, b], 3,
                            Limits(max_new_tokens=12, max_turns=2, max_episode_tokens=40))
    assert [e.group for e in episodes] == [0, 0, 0, 1, 1, 1]
    for e in episodes:
        assert e.done and 1 <= e.turns <= 2 and len(e.ids) <= 40
        assert len(e.ids) == len(e.mask) == len(e.logps) and all(lp <= 0 for lp in e.logps)
        assert e.mask[0] and sum(e.mask) >= 1


TASK_FILE = '''
from minigrpo.tasks import Task


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def rows(split, seed):
    return [{"prompt": f"Use the add tool: what is {a} + {b}?", "answer": a + b} for a in range(10) for b in range(3)]


def correct(prompts, completions, answer, **columns):
    return [float(str(x) in c[-1]["content"]) for c, x in zip(completions, answer)]


TASK = Task("sums", "sums with a tool", rows, [correct], tools=[add])
'''


def test_a_step_trains_on_episodes_and_counts_only_the_models_tokens(tiny_model_path, tokenizer, tmp_path):
    """The rollout, the micro-batches and the update of one step, on episodes with a real tool call (scripted
    replies: the tiny model does not call tools by itself)."""
    from minigrpo.config import TrainConfig
    from minigrpo.model import load_policy, lora_parameters
    from minigrpo.rollout import collect
    from minigrpo.state import PromptPool, RunState
    from minigrpo.tasks import get_task
    from minigrpo.loss import Objective
    from minigrpo.update import micro_batches, policy_update

    (tmp_path / "sums.py").write_text(TASK_FILE)
    task = get_task(str(tmp_path / "sums.py"))
    cfg = TrainConfig(task=str(tmp_path / "sums.py"), num_generations=2, prompts_per_step=2, max_new_tokens=64,
                      max_episode_tokens=256, micro_batch_size=2)
    model = Scripted(tokenizer, [CALL, "It is 42.", "It is 42."])
    run = RunState(None, tokenizer, model, None, None, None, PromptPool(task.make_data("train", 0), seed=0), None)
    batch, info = collect(cfg, run, task)
    assert info["episode/turns"] == 2 and info["episode/tool_calls"] == 1 and info["episode/tool_errors"] == 0
    assert info["tokens_generated"] == sum(map(sum, batch.model_masks)) < sum(map(len, batch.completion_ids))
    assert all(c[1] == {"role": "tool", "name": "add", "content": "42"} for c in batch.completions)
    torch.manual_seed(0)
    policy = load_policy(TrainConfig(lora_rank=4, load_in_4bit=False, dtype="float32"), tiny_model_path, torch.float32)
    mb = micro_batches(cfg, batch, tokenizer.pad_token_id, "cpu")
    assert mb.full_mask.sum().item() == info["tokens_generated"]
    optimizer = torch.optim.SGD(lora_parameters(policy), lr=0.1)
    # every row's episode is the same script, so opposite advantages within a group would cancel exactly
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0])
    before = [p.detach().clone() for p in lora_parameters(policy)]
    update = policy_update(cfg, Objective.of(cfg), policy, mb, rewards - 0.5, optimizer,
                           torch.amp.GradScaler("cpu", enabled=False))
    assert update.grad_norm > 0 and any(not torch.equal(a, b) for a, b in zip(before, lora_parameters(policy)))


def test_train_end_to_end_with_the_tasks_tools_and_a_tool_flag(tmp_path):
    import json

    from typer.testing import CliRunner

    from minigrpo.cli.app import app

    (tmp_path / "sums.py").write_text(TASK_FILE)
    (tmp_path / "more.py").write_text('def double(x: int) -> int:\n    """Twice x.\n\n    Args:\n        x: A number.\n'
                                      '    """\n    return 2 * x\n')
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "--task", str(tmp_path / "sums.py"), "--tool", f"{tmp_path / 'more.py'}:double", "--steps", "2",
        "-G", "2", "--prompts-per-step", "2", "--max-new-tokens", "12", "--max-turns", "2", "--sample-every", "1",
        "--eval-prompts", "4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output, "the precheck gives the reward episode-shaped stand-ins"
    config = json.loads((out / "config.json").read_text())
    assert config["max_episode_tokens"] == 24 and config["tools"] == [f"{tmp_path / 'more.py'}:double"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(1 <= m["episode/turns"] <= 2 and "episode/tool_calls" in m for m in metrics)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert all(s["completion"][0]["role"] == "assistant" and s["turns"] >= 1 for s in samples)
    assert "[assistant]" in result.output, "the sample panel shows the episode turn by turn"
    assert len((out / "eval.jsonl").read_text().splitlines()) == 2
    evaluated = CliRunner().invoke(app, ["eval", "--task", str(tmp_path / "sums.py"), "--tool",
                                         f"{tmp_path / 'more.py'}:double", "--adapter", str(out / "adapter"),
                                         "--prompts", "2", "--samples", "1"])
    assert evaluated.exit_code == 0 and "pass@1" in evaluated.output, evaluated.output
    assert len((out / "eval.jsonl").read_text().splitlines()) == 3
    bad = CliRunner().invoke(app, ["train", "--task", str(tmp_path / "sums.py"), "--tool", f"{tmp_path / 'sums.py'}:add",
                                   "--out", str(tmp_path / "bad")])
    assert bad.exit_code != 0 and "two tools share a name (add)" in bad.output


GAME_FILE = '''
import random

from minigrpo.tasks import Task


class Guess:
    """A number to find: the guess tool says higher or lower."""

    def reset(self, secret, **row):
        self.secret, self.tries, self.solved = secret, 0, False
        return " Find it with the guess tool."

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess.
        """
        self.tries += 1
        if number == self.secret:
            self.solved = True
            return "correct"
        return "higher" if number < self.secret else "lower"

    def get_reward(self) -> float:
        return 1.0 if self.solved else 0.0


def rows(split, seed):
    rng = random.Random(seed)
    return [{"prompt": "I picked a number from 1 to 9.", "secret": rng.randint(1, 9)} for _ in range(20)]


TASK = Task("guess", "guess a number with hints", rows, [], environment=Guess)
'''


def guess(n: int) -> str:
    return f'<tool_call>{{"name": "guess", "arguments": {{"number": {n}}}}}</tool_call>'


def test_an_environment_per_episode_its_methods_as_tools_and_its_own_reward(tokenizer, tmp_path):
    from minigrpo.config import TrainConfig
    from minigrpo.rollout import rollout
    from minigrpo.tasks import get_task

    (tmp_path / "game.py").write_text(GAME_FILE)
    task = get_task(str(tmp_path / "game.py"))
    assert task.reward_names == ["Guess"] and task.weights == [1.0], "the environment scores its own episodes"
    cfg = TrainConfig(task=str(tmp_path / "game.py"), num_generations=2, max_new_tokens=64, max_episode_tokens=400)
    rows = [{"prompt": "I picked a number from 1 to 9.", "secret": 7}]
    model = Scripted(tokenizer, [guess(5), guess(7), "Found it: 7."])
    batch = rollout(cfg, tokenizer, model, task, rows)
    first_prompt = tokenizer.decode(model.asked[0][0][0])
    assert "I picked a number from 1 to 9. Find it with the guess tool." in first_prompt and '"guess"' in first_prompt
    for episode in batch.completions:
        assert [m["content"] for m in episode if m["role"] == "tool"] == ["higher", "correct"]
    assert batch.scores.totals == [1.0, 1.0] and batch.episode_stats["tool_calls"] == 4
    # each episode had its own instance: its tries were its own
    model = Scripted(tokenizer, [guess(5), "I give up."])
    assert rollout(cfg, tokenizer, model, task, rows).scores.totals == [0.0, 0.0]


def test_resets_that_disagree_within_a_group_are_refused(tokenizer, tmp_path):
    from minigrpo.config import TrainConfig
    from minigrpo.rollout import rollout
    from minigrpo.tasks import get_task

    (tmp_path / "game.py").write_text(GAME_FILE.replace('return " Find it with the guess tool."',
                                                        'return f" Try {random.random()}"'))
    task = get_task(str(tmp_path / "game.py"))
    cfg = TrainConfig(task=str(tmp_path / "game.py"), num_generations=2, max_new_tokens=16)
    with pytest.raises(ValueError, match="returned different text for one row"):
        rollout(cfg, tokenizer, Scripted(tokenizer, ["x"]), task, [{"prompt": "p", "secret": 1}])
    (tmp_path / "broken.py").write_text(GAME_FILE.replace("self.secret, self.tries, self.solved = secret, 0, False",
                                                          "self.secret = 1 / 0"))
    task = get_task(str(tmp_path / "broken.py"))
    with pytest.raises(ValueError, match="reset raised ZeroDivisionError"):
        rollout(cfg, tokenizer, Scripted(tokenizer, ["x"]), task, [{"prompt": "p", "secret": 1}])


def test_train_end_to_end_in_an_environment(tmp_path):
    import json

    from typer.testing import CliRunner

    from minigrpo.cli.app import app

    (tmp_path / "game.py").write_text(GAME_FILE)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "train", "--task", str(tmp_path / "game.py"), "--steps", "1", "-G", "2", "--prompts-per-step", "2",
        "--max-new-tokens", "12", "--max-turns", "2", "--eval-prompts", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "reward/Guess/mean" in metrics and "episode/turns" in metrics


class Hint:
    """A game that talks: the environment answers a turn without tool calls as the user (`respond`)."""

    def reset(self, secret, **row):
        self.secret, self.solved = secret, False

    def respond(self, message: str):
        import re

        numbers = re.findall(r"\d+", message)
        if not numbers:
            return "Say a number."
        if int(numbers[-1]) == self.secret:
            self.solved = True
            return None  # the game is over
        return "Higher." if int(numbers[-1]) < self.secret else "Lower."

    def get_reward(self) -> float:
        return float(self.solved)


def test_an_environment_that_talks_answers_as_the_user(tokenizer):
    from minigrpo.config import TrainConfig
    from minigrpo.tools import environment_reward
    from minigrpo.rollout import rollout
    from minigrpo.tasks import Task

    task = Task("hint", "", lambda split, seed: [], [environment_reward(Hint)], environment=Hint)
    cfg = TrainConfig(num_generations=2, max_new_tokens=16, max_turns=4, max_episode_tokens=200)
    rows = [{"prompt": "Guess my number, 1 to 9.", "secret": 7}]
    batch = rollout(cfg, tokenizer, Scripted(tokenizer, ["5", "8", "It is 7."]), task, rows)
    episode = batch.completions[0]
    assert [(m["role"], m["content"]) for m in episode] == [
        ("assistant", "5"), ("user", "Higher."), ("assistant", "8"), ("user", "Lower."), ("assistant", "It is 7.")]
    assert batch.scores.totals == [1.0, 1.0] and batch.episode_stats["turns"] == 6
    mask, ids = batch.model_masks[0], batch.completion_ids[0]
    user_text = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "Higher." in user_text and "Lower." in user_text and "It is 7" not in user_text
    # at the turn limit the game is cut, unsolved
    cfg = TrainConfig(num_generations=2, max_new_tokens=16, max_turns=2, max_episode_tokens=200)
    batch = rollout(cfg, tokenizer, Scripted(tokenizer, ["5", "8", "It is 7."]), task, rows)
    assert batch.scores.totals == [0.0, 0.0] and batch.truncated == [True, True]


@pytest.mark.parametrize("name", ["guess", "multiply"])
def test_the_built_in_episode_tasks_check_out(name):
    from minigrpo.check import check_examples, precheck_rewards
    from minigrpo.tasks import get_task

    task = get_task(name)
    assert task.examples and check_examples(task) == []
    assert precheck_rewards(task, task.make_data("train", 0)) == []
    assert task.make_data("test", 0) and task.make_data("test", 0) != task.make_data("train", 0)[:64]


def test_the_guess_game_trains_end_to_end(tmp_path):
    import json

    from typer.testing import CliRunner

    from minigrpo.cli.app import app

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--task", "guess", "--steps", "1", "-G", "2", "--prompts-per-step", "2",
                                      "--max-new-tokens", "8", "--max-turns", "3", "--no-eval-before-after",
                                      "--sample-every", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (sample, *_) = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sample["completion"][0]["role"] == "assistant" and 1 <= sample["turns"] <= 3
    if sample["turns"] > 1:  # the game answered as the user
        assert sample["completion"][1]["role"] == "user"


def test_sample_and_check_reward_show_episodes(tmp_path):
    from typer.testing import CliRunner

    from minigrpo.cli.app import app

    runner = CliRunner()
    result = runner.invoke(app, ["sample", "--task", "guess", "--prompts", "1", "--samples", "2", "--max-new-tokens", "8",
                                 "--max-turns", "2", "--temperature", "1.0"])
    assert result.exit_code == 0, result.output
    assert result.output.count("[assistant]") >= 2 and result.output.count("\nreward ") == 2
    assert "guess_reward" in result.output and "Guess" in result.output  # the held-out prompt, then its episode
    # free prompts with a tool of one's own: episodes too (the tool is offered; whether it is called is the model's)
    result = runner.invoke(app, ["sample", "What is 347 x 892?", "--tool", "rewards/multiply.py:multiply",
                                 "--max-new-tokens", "8", "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert "[assistant]" in result.output and "reward" not in result.output
    result = runner.invoke(app, ["check-reward", "--task", "guess", "--prompts", "1", "--samples", "2",
                                 "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert "guess: 2 episodes sampled" in result.output and "a sample" in result.output
    assert "groups with reward spread" in result.output
    result = runner.invoke(app, ["sample", "What is 2 x 3?", "--task", "guess"])
    assert result.exit_code != 0 and "not both" in result.output
    result = runner.invoke(app, ["sample", "Hi", "--tool", "nowhere.py:fn"])
    assert result.exit_code != 0 and "nowhere.py" in result.output and "Traceback" not in result.output


def test_eval_and_check_reward_sample_episodes_under_the_turn_limit_asked_for(monkeypatch):
    """A notebook's before/after evaluations must run episodes as its training did: `--max-turns` reaches
    the config both commands sample with."""
    from typer.testing import CliRunner

    from minigrpo import settle
    from minigrpo.cli.app import app

    seen = []
    budget = settle.episode_budget
    monkeypatch.setattr(settle, "episode_budget", lambda cfg, task: (seen.append(cfg.max_turns), budget(cfg, task))[1])
    runner = CliRunner()
    result = runner.invoke(app, ["eval", "--task", "guess", "--prompts", "1", "--samples", "1", "--max-new-tokens",
                                 "4", "--max-turns", "2"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["check-reward", "--task", "guess", "--prompts", "1", "--samples", "2",
                                 "--max-new-tokens", "4", "--max-turns", "3"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["check-reward", "--task", "guess", "--prompts", "1", "--samples", "2",
                                 "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    assert seen == [2, 3, 4]  # the last: the config's own default
