"""The episode loop: model turns and tool results alternating, batched turn by turn, ended by an answer, the
turn limit or the token budget; its tokens continue the context exactly as the chat template renders it."""

import pytest
import torch

from minigrpo.episodes import Limits, run_episodes
from minigrpo.generation import Rollout
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
    from minigrpo.generation import HFGenerator
    from minigrpo.model import load_policy

    torch.manual_seed(0)
    policy = load_policy(TrainConfig(lora_rank=4, load_in_4bit=False), tiny_model_path, torch.float32)
    _, a = prompt(tokenizer)
    _, b = prompt(tokenizer, "Use the add tool to add 3 and 4.")
    episodes = run_episodes(HFGenerator(policy, tokenizer, report_logprobs=True), tokenizer, [add], [a, b], 3,
                            Limits(max_new_tokens=12, max_turns=2, max_episode_tokens=40))
    assert [e.group for e in episodes] == [0, 0, 0, 1, 1, 1]
    for e in episodes:
        assert e.done and 1 <= e.turns <= 2 and len(e.ids) <= 40
        assert len(e.ids) == len(e.mask) == len(e.logps) and all(lp <= 0 for lp in e.logps)
        assert e.mask[0] and sum(e.mask) >= 1
