"""Tools the model may call: plain Python functions, described to the model by their type hints and docstring.

A tool is what TRL's GRPOTrainer takes as `tools=`, so one written for either runs in the other:

    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: The first number.
            b: The second number.
        \"\"\"
        return a + b

Its JSON schema comes from the hints and the docstring (`transformers.utils.get_json_schema`). The model
calls a tool by writing, in its turn,

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

the format of the Qwen2.5 and Hermes chat templates. Where a model's chat template has no tools (SmolLM2's
has none), the same schemas and the same format are written into the system message (`describe`).

Arguments are parsed as JSON, never evaluated. Every failure becomes a message the model reads and a counted
error, never a crash: a malformed call, an unknown tool, wrong arguments, a tool that raises, one that runs
past its time limit, and (not an error, but counted) a result too long for the context, cut with a marker.
"""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from typing import Callable

from minigrpo.guard import OutOfTime, awaited, real_interrupts, time_limit

CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)
ERRORS = ("malformed", "unknown", "arguments", "raised", "timeout")  # the kinds of failed call, as counted


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None  # why the call could not be read; then name and arguments are empty


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str  # what the model reads
    error: str | None = None  # one of ERRORS, or None
    truncated: bool = False
    value: object = None  # what the tool returned, where the rewards get it as it is (a list, as TRL keeps it)


def schema(fn: Callable) -> dict:
    """The tool's JSON schema in the chat-template form ({"type": "function", "function": {...}}), or a
    ValueError that says what the function lacks."""
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", repr(fn))
    if inspect.isclass(fn):
        raise ValueError(f"tool {name!r} is a class; a tool is a function: call the class in a function with "
                         f"typed arguments and a docstring, and give that")
    try:
        takes_any = {p.kind for p in inspect.signature(fn).parameters.values()} & {
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    except (TypeError, ValueError):  # a builtin without a signature: transformers says what it lacks
        takes_any = set()
    if takes_any:
        raise ValueError(f"tool {name!r} takes *args or **kwargs, which no schema can describe to the model; "
                         f"give it named arguments, each with a type hint and an Args: line")
    try:
        return get_json_schema(fn)
    except Exception as error:  # transformers' own reasons: a missing hint, docstring or argument description
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r} cannot be described to the model: {error} "
                         f"(a tool needs a type hint on every argument and a docstring with an Args: section "
                         f"describing each)") from None


def parse_calls(text: str) -> list[ToolCall]:
    """The tool calls in one model turn, in order; a call that cannot be read is kept, with its error.

    >>> parse_calls('Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')
    [ToolCall(name='add', arguments={'a': 2, 'b': 3}, error=None)]
    >>> parse_calls("<tool_call>{'name': 'add'}</tool_call>")[0].error
    'malformed tool call: not JSON (Expecting property name enclosed in double quotes at char 1)'
    >>> parse_calls("no calls here")
    []
    """
    calls = []
    for body, closed in CALL.findall(text):
        if not closed:
            calls.append(ToolCall("", {}, "malformed tool call: no closing </tool_call>"))
            continue
        try:
            data = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append(ToolCall("", {}, f"malformed tool call: not JSON ({error.msg} at char {error.pos})"))
            continue
        name = data.get("name") if isinstance(data, dict) else None
        arguments = data.get("arguments", {}) if isinstance(data, dict) else None
        if isinstance(arguments, str):  # some templates show arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(name, str) or not isinstance(arguments, dict):
            calls.append(ToolCall("", {}, 'malformed tool call: it must be {"name": "...", "arguments": {...}}'))
            continue
        calls.append(ToolCall(name, arguments))
    return calls


def run_call(tools: dict[str, Callable], call: ToolCall, timeout: float = 10.0,
             max_chars: int = 2000) -> ToolResult:
    """One call, its failures turned into what the model reads. `timeout` seconds at most (SIGALRM: the
    main thread, POSIX; elsewhere no limit), the result cut to `max_chars` characters with a marker."""
    if call.error:
        return ToolResult(call.name, f"error: {call.error}", "malformed")
    fn = tools.get(call.name)
    if fn is None:
        return ToolResult(call.name, f"error: unknown tool {call.name!r}; the tools are: {', '.join(tools) or 'none'}",
                          "unknown")
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as error:
        return ToolResult(call.name, f"error: wrong arguments for {call.name}: {error}", "arguments")
    try:
        with time_limit(timeout, f"tool {call.name}"), real_interrupts() as interrupted:
            value = awaited(fn(**call.arguments))  # an async tool is awaited, as TRL awaits it
    except OutOfTime:
        return ToolResult(call.name, f"error: {call.name} ran past its time limit ({timeout:g} s)", "timeout")
    except KeyboardInterrupt:
        if interrupted:
            raise  # the user's Ctrl-C
        return ToolResult(call.name, f"error: {call.name} raised KeyboardInterrupt", "raised")
    except (Exception, SystemExit) as error:
        return ToolResult(call.name, f"error: {call.name} raised {type(error).__name__}: {error}", "raised")
    text = value if isinstance(value, str) else _as_text(value)
    kept = value if isinstance(value, list) else None
    if len(text) > max_chars:
        cut = len(text) - max_chars
        return ToolResult(call.name, f"{text[:max_chars]}\n[... {cut} more characters cut]", truncated=True, value=kept)
    return ToolResult(call.name, text, value=kept)


def _as_text(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def message(result: ToolResult) -> dict:
    """The chat message that carries a result back to the model."""
    return {"role": "tool", "name": result.name, "content": result.content}


def kept_message(result: ToolResult) -> dict:
    """The same message as the episode keeps it for the rewards: a list the tool returned stays a list, as
    in TRL's episodes (the model read it as JSON)."""
    return {**message(result), "content": result.value} if isinstance(result.value, list) else message(result)


def call_fields(calls: list[ToolCall]) -> list[dict]:
    """A turn's readable calls as TRL's assistant messages carry them (`tool_calls`).

    >>> call_fields([ToolCall("add", {"a": 2, "b": 3}), ToolCall("", {}, "malformed tool call: not JSON")])
    [{'type': 'function', 'function': {'name': 'add', 'arguments': {'a': 2, 'b': 3}}}]
    """
    return [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls if not c.error]


def template_has_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a `tools=` list itself."""
    template = tokenizer.chat_template or ""
    return "tools" in (template if isinstance(template, str) else json.dumps(template))


def describe(tools: list[Callable]) -> str:
    """The tools and the call format in words, for a system message where the chat template has no tools."""
    listed = "\n".join(json.dumps(schema(fn)) for fn in tools)
    return ("You can call these tools. Each is described by a JSON schema:\n"
            f"{listed}\n"
            "To call one, write a JSON object with its name and arguments between <tool_call> and </tool_call>:\n"
            '<tool_call>\n{"name": "tool_name", "arguments": {"argument": "value"}}\n</tool_call>\n'
            "Its result comes back in the next message.")


def render_prompt(tokenizer, prompt: str | list[dict], tools: list = ()) -> str:
    """A prompt as the model sees it: through its chat template when it has one, with the task's tools
    offered (in the template's own way, or in the system message where it has none)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if tools:
        return render(tokenizer, messages, tools)
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "\n".join(m["content"] for m in messages) + "\n"


def render(tokenizer, messages: list[dict], tools: list[Callable]) -> str:
    """The conversation as the model's prompt text, with the tools offered the way its template can."""
    if messages and messages[0]["role"] == "system" and not template_has_tools(tokenizer):
        system = {"role": "system", "content": messages[0]["content"] + "\n\n" + describe(tools)}
        return tokenizer.apply_chat_template([system, *messages[1:]], tokenize=False, add_generation_prompt=True)
    return _render(tokenizer, messages, tools, generation_prompt=True)


def turn_text(tokenizer, messages: list[dict], tools: list[Callable] = ()) -> str:
    """The text that follows a model turn's end-of-turn token in an episode: the environment's `messages`
    (tool results, a user's reply) as the chat template writes them, then the opening of the next assistant
    turn. Appending its tokens to the sampled ones gives what rendering the whole conversation would, so the
    model's later turns see the context its template promises. Found by rendering a conversation with and
    without the messages; a template that rewrites earlier turns when later ones arrive (some hide past
    reasoning) cannot continue an episode token by token, and raises."""
    mark = "\x00turn\x00"
    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": mark}]
    before = _render(tokenizer, base, tools, generation_prompt=False)
    after = _render(tokenizer, base + messages, tools, generation_prompt=True)
    end_of_turn = before[before.index(mark) + len(mark):]  # e.g. "<|im_end|>\n"
    eos = tokenizer.eos_token or ""
    if not after.startswith(before) or not end_of_turn.startswith(eos):
        raise ValueError("this model's chat template rewrites earlier turns, so an episode cannot be continued "
                         "token by token; use a model whose template writes each message on its own (ChatML)")
    return end_of_turn[len(eos):] + after[len(before):]


def _render(tokenizer, messages: list[dict], tools, generation_prompt: bool) -> str:
    if tools and template_has_tools(tokenizer):
        return tokenizer.apply_chat_template(messages, tools=[schema(fn) for fn in tools], tokenize=False,
                                             add_generation_prompt=generation_prompt)
    if tools:
        messages = [{"role": "system", "content": describe(list(tools))}, *messages]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


# an environment (TRL's environment_factory): its methods are the model's tools, its get_reward() a reward

def environment_tools(env) -> list[Callable]:
    """An environment's tools, chosen as TRL chooses them: its public methods other than `reset` and
    `get_reward` (and our `respond`), bound to the instance (so they act on its state)."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward", "respond") and not name.startswith("_")]


def environment_reward(factory: Callable) -> Callable | None:
    """Where the environment scores its own episodes (`get_reward()`), a reward function that asks it, named
    after its class, as TRL adds one."""
    kind = factory if isinstance(factory, type) else type(factory())
    if not callable(getattr(kind, "get_reward", None)):
        return None

    def reward(prompts, completions, environments, **columns):
        return [env.get_reward() for env in environments]

    reward.__name__ = kind.__name__
    reward.environment_owned = True  # TRL adds this reward itself: `minigrpo graduate` leaves it out
    return reward
