"""Episodes: the model's turns and the tools' results, alternating, for every completion of a step.

Each of the G episodes of a prompt starts from the prompt; turn by turn, all the episodes still going are
sampled in one batch (the first turn with one prefill per prompt, as single replies are), each model turn's
tool calls are run (`minigrpo.tools`) and their results appended as the chat template writes them. An
episode ends when the model answers without calling a tool, at `max_turns`, or when its tokens reach
`max_episode_tokens` (cut: marked truncated, like a reply cut at its length limit).

Environments follow TRL's `environment_factory` contract: one instance per episode, `reset(**row)` (its text
ends the prompt), its public methods as the episode's tools, `get_reward()` as a reward. Beyond TRL, an
environment may `respond(message)` to a turn without tool calls, as the user; None ends the episode.

An episode is one completion to the rest of the loop: its tokens are everything after the prompt, with a
mask that is True only where the model wrote them, so tool results are context and never trained on
(`Groups.model_masks`); the sampler's log-probs cover the model's tokens, 0 elsewhere (masked out).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

from minigrpo.generate import Generator, Sampling
from minigrpo.tools import call_fields, environment_tools, kept_message, message, parse_calls, run_call, turn_text


@dataclass
class Episode:
    group: int  # which prompt
    messages: list[dict]  # the conversation after the prompt: assistant turns and tool results
    ids: list[int] = field(default_factory=list)  # every token after the prompt
    mask: list[bool] = field(default_factory=list)  # True where the model wrote the token
    # the sampler's log-probs, 0.0 for the tools' tokens; None where the generator does not report them
    logps: list[float] | None = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)  # kind (tools.ERRORS) -> count
    cut: str | None = None  # "turns" or "tokens" when a limit ended the episode
    done: bool = False
    tools: list[Callable] = field(default_factory=list, repr=False)  # the task's, then its environment's methods
    env: object | None = field(default=None, repr=False)  # this episode's environment, if the task has one

    @property
    def truncated(self) -> bool:
        return self.cut is not None


@dataclass
class Limits:
    max_new_tokens: int  # per model turn
    max_turns: int = 4  # model turns per episode
    max_episode_tokens: int = 1024  # all tokens after the prompt: the model's and the tools'
    tool_timeout: float = 10.0  # seconds per call
    tool_max_chars: int = 2000  # a longer result is cut, with a marker
    temperature: float = 1.0
    top_p: float = 1.0


def run_episodes(generator: Generator, tokenizer, tools: list[Callable], prompt_ids: list[list[int]], G: int,
                 limits: Limits, environments: list | None = None) -> list[Episode]:
    """G episodes per prompt, in group order (episodes [0, G) belong to prompt 0); with `environments`, one
    per episode, whose methods are that episode's tools beside the task's."""
    episodes = [Episode(i // G, [], tools=list(tools) + (environment_tools(environments[i]) if environments else []),
                        env=environments[i] if environments else None) for i in range(len(prompt_ids) * G)]
    live, contexts, n = episodes, prompt_ids, G  # the first turn: one prefill per prompt
    longest = max(len(p) for p in prompt_ids) + limits.max_episode_tokens  # no context of these episodes is longer
    while live:
        room = max(limits.max_episode_tokens - len(e.ids) for e in live)
        out = generator.generate(contexts, Sampling(n, min(limits.max_new_tokens, room), limits.temperature,
                                                    limits.top_p, context_tokens=longest))
        logps = out.sampler_logps or [None] * len(live)
        for e, ids, cut_short, lp in zip(live, out.completion_ids, out.truncated, logps):
            _model_turn(e, ids, cut_short, lp, limits, tokenizer)
            if not e.done:
                _tool_turn(e, tokenizer, limits)
        live = [e for e in episodes if not e.done]
        contexts, n = [prompt_ids[e.group] + e.ids for e in live], 1
    return episodes


def _model_turn(e: Episode, ids: list[int], cut_short: bool, logps: list[float] | None, limits: Limits,
                tokenizer) -> None:
    room = limits.max_episode_tokens - len(e.ids)
    if len(ids) > room:  # the batch's turn limit was set by the episode with the most room left
        ids, logps, cut_short = ids[:room], logps[:room] if logps is not None else None, True
    e.ids += ids
    e.mask += [True] * len(ids)
    e.logps = e.logps + list(logps) if e.logps is not None and logps is not None else None
    e.turns += 1
    e.messages.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
    if cut_short:
        e.done, e.cut = True, "tokens"


def _tool_turn(e: Episode, tokenizer, limits: Limits) -> None:
    """The model's turn read: its calls run and their results appended; or, for a turn without calls, the
    environment's `respond` (where it has one) answers as the user; or the episode ended."""
    calls = parse_calls(e.messages[-1]["content"])
    if call_fields(calls):  # the turn as TRL's episodes keep it: its text, and its calls
        e.messages[-1]["tool_calls"] = call_fields(calls)
    said = _respond(e) if not calls else None
    if not calls and said is None:  # an answer: the episode is over
        e.done = True
        return
    if e.turns >= limits.max_turns:
        e.done, e.cut = True, "turns"
        return
    if calls:
        table = {fn.__name__: fn for fn in e.tools}
        results = [run_call(table, call, limits.tool_timeout, limits.tool_max_chars) for call in calls]
        e.tool_calls += len(calls)
        for r in results:
            if r.error:
                e.tool_errors[r.error] = e.tool_errors.get(r.error, 0) + 1
        replies, kept = [message(r) for r in results], [kept_message(r) for r in results]
    else:
        replies = kept = [{"role": "user", "content": said}]
    ids = tokenizer(turn_text(tokenizer, replies, e.tools), add_special_tokens=False).input_ids
    e.messages += kept
    if len(e.ids) + len(ids) >= limits.max_episode_tokens:  # no room left for the model to read them and answer
        e.done, e.cut = True, "tokens"
        return
    e.ids += ids
    e.mask += [False] * len(ids)
    e.logps = e.logps + [0.0] * len(ids) if e.logps is not None else None


def _respond(e: Episode) -> str | None:
    """The environment's answer to a turn without tool calls (`respond(message) -> str | None`, beyond TRL's
    contract: a game that talks), or None to end the episode. Its failure ends the episode and is counted."""
    respond = getattr(e.env, "respond", None)
    if not callable(respond):
        return None
    try:
        said = respond(e.messages[-1]["content"])
    except Exception:  # the user's code: the episode ends as it stands, counted
        e.tool_errors["environment"] = e.tool_errors.get("environment", 0) + 1
        return None
    return None if said is None else str(said)


def episode_stats(episodes: list[Episode]) -> dict[str, int]:
    """Totals over the episodes, summed across rounds and turned into per-episode means in the step's metrics."""
    return {"episodes": len(episodes), "turns": sum(e.turns for e in episodes),
            "tool_calls": sum(e.tool_calls for e in episodes),
            "tool_errors": sum(sum(e.tool_errors.values()) for e in episodes),
            "cut_by_turns": sum(e.cut == "turns" for e in episodes),
            "cut_by_tokens": sum(e.cut == "tokens" for e in episodes)}


def start_environments(factory: Callable, rows: list[dict], G: int, own_prompts: bool = False
                       ) -> tuple[list, list[str | None]]:
    """One environment per episode, each reset from its row (TRL's contract: `reset(**row)` returns None or
    text for the end of the prompt). The G episodes of a row share one prompt, so their resets must say the
    same; whatever differs between them belongs in their state, which the tools reveal. Where the environment
    writes the prompts (`own_prompts`: no data, a new puzzle per reset), one is reset per group and copied for
    the rest, so a group shares its puzzle, as GRPO's advantages assume."""
    environments, said = [], []
    for row in rows:
        group = [factory() for _ in range(1 if own_prompts else G)]
        texts = [_reset(env, row) for env in group]
        if own_prompts and G > 1:
            try:
                group += [copy.deepcopy(group[0]) for _ in range(G - 1)]
            except Exception as error:
                raise ValueError(f"an environment that writes its own prompts is copied for the {G} episodes of a "
                                 f"group, and copy.deepcopy failed on it ({type(error).__name__}: {error}); keep "
                                 f"open files and connections out of its state, or give data rows") from None
        if len(set(texts)) > 1:
            raise ValueError(f"the environment's reset returned different text for one row ({texts[0]!r} and "
                             f"{next(t for t in texts if t != texts[0])!r}): the {G} episodes of a row share their "
                             f"prompt, so reset may vary only what its tools reveal, not what it says")
        environments += group
        said.append(texts[0])
    return environments, said


def _reset(env, row: dict):
    try:
        return env.reset(**row)
    except Exception as error:  # the user's code: named, with the row it failed on
        raise ValueError(f"the environment's reset raised {type(error).__name__}: {error} "
                         f"(row: {str(row)[:120]})") from None


def offered_tools(task) -> list[Callable]:
    """Every tool a task's episodes offer: its own, then its environment's (from a fresh instance)."""
    return list(task.tools) + (environment_tools(task.environment()) if task.environment else [])

