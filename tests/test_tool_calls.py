"""Tools: a plain function described to the model, its calls read from the model's text as data, and every
way a call can fail turned into a message the model reads, never a crash."""

import json
import time

import pytest

from minigrpo import tools
from minigrpo.tasks import load_tool
from minigrpo.tools import ToolCall, parse_calls, run_call


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def boom(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ValueError(f"no good: {x}")


def sleepy(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def verbose(n: int) -> str:
    """Says a lot.

    Args:
        n: How many characters.
    """
    return "x" * n


def exits() -> str:
    """Calls sys.exit."""
    raise SystemExit(3)


def echo(text: str) -> str:
    """Returns its argument.

    Args:
        text: The text.
    """
    return text


TOOLS = {fn.__name__: fn for fn in (add, boom, sleepy, verbose, exits, echo)}


def call(text: str, **kwargs):
    (one,) = parse_calls(text)
    return run_call(TOOLS, one, **kwargs)


def test_a_tool_is_described_by_its_hints_and_docstring():
    s = tools.schema(add)
    assert s["type"] == "function" and s["function"]["name"] == "add"
    assert s["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first number."}
    assert s["function"]["parameters"]["required"] == ["a", "b"]


def test_a_tool_without_a_docstring_is_refused_with_the_fix():
    def bare(a: int) -> int:
        return a

    with pytest.raises(ValueError, match="'bare' cannot be described.*type hint on every argument and a docstring"):
        tools.schema(bare)


def test_tools_no_schema_can_describe_are_refused_with_the_fix():
    def any_args(*args: int, **kwargs: int) -> int:
        """Adds.

        Args:
            args: Numbers.
            kwargs: More numbers.
        """
        return sum(args)

    class Klass:
        """A class.

        Args:
            x: A number.
        """

        def __init__(self, x: int):
            self.x = x

    with pytest.raises(ValueError, match=r"'any_args' takes \*args or \*\*kwargs.*give it named arguments"):
        tools.schema(any_args)
    with pytest.raises(ValueError, match="'Klass' is a class; a tool is a function"):
        tools.schema(Klass)


def test_a_tool_file_that_exits_at_import_is_named(tmp_path):
    (tmp_path / "t.py").write_text("import sys\nsys.exit('needs an API key')\n")
    with pytest.raises(ValueError, match=r"t.py called sys.exit\('needs an API key'\) while loading \(--tool .*t.py:f\)"):
        load_tool(f"{tmp_path / 't.py'}:f")


def test_load_tool_from_a_file(tmp_path):
    (tmp_path / "t.py").write_text('def shout(text: str) -> str:\n    """Upper case.\n\n    Args:\n'
                                   '        text: The text.\n    """\n    return text.upper()\n'
                                   "def untyped(text):\n    return text\n")
    assert load_tool(f"{tmp_path / 't.py'}:shout")("hi") == "HI"
    with pytest.raises(ValueError, match="cannot be described"):
        load_tool(f"{tmp_path / 't.py'}:untyped")
    with pytest.raises(ValueError, match="defines no missing"):
        load_tool(f"{tmp_path / 't.py'}:missing")
    with pytest.raises(ValueError, match="must be file.py:function"):
        load_tool("t.py")


def test_a_good_call_runs_and_its_result_is_text():
    result = call('I will add. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>')
    assert (result.content, result.error, result.truncated) == ("42", None, False)
    assert tools.message(result) == {"role": "tool", "name": "add", "content": "42"}


def test_several_calls_in_one_turn_are_read_in_order():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> then '
            '<tool_call>{"name": "echo", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call>')
    calls = parse_calls(text)
    assert [c.name for c in calls] == ["add", "echo"] and calls[1].arguments == {"text": "hi"}


@pytest.mark.parametrize("text, error, says", [
    ("<tool_call>{name: add}</tool_call>", "malformed", "not JSON"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', "malformed", "no closing </tool_call>"),
    ('<tool_call>["add", 1, 2]</tool_call>', "malformed", '{"name": "...", "arguments": {...}}'),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "malformed", '"arguments": {...}'),
    ('<tool_call>{"name": "multiply", "arguments": {}}</tool_call>', "unknown", "the tools are: add, boom"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "arguments", "missing a required argument: 'b'"),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}</tool_call>', "arguments", "unexpected keyword"),
    ('<tool_call>{"name": "boom", "arguments": {"x": "y"}}</tool_call>', "raised", "ValueError: no good: y"),
    ('<tool_call>{"name": "exits", "arguments": {}}</tool_call>', "raised", "SystemExit"),
])
def test_every_failed_call_becomes_a_message_the_model_reads(text, error, says):
    result = call(text)
    assert result.error == error and result.content.startswith("error: ") and says in result.content, result


def test_a_tool_that_hangs_is_stopped_at_its_limit():
    start = time.perf_counter()
    result = call('<tool_call>{"name": "sleepy", "arguments": {"seconds": 30}}</tool_call>', timeout=0.5)
    assert result.error == "timeout" and "ran past its time limit (0.5 s)" in result.content
    assert time.perf_counter() - start < 5
    assert call('<tool_call>{"name": "sleepy", "arguments": {"seconds": 0}}</tool_call>').content == "awake"


def test_a_huge_result_is_cut_with_a_marker():
    result = call('<tool_call>{"name": "verbose", "arguments": {"n": 100000}}</tool_call>', max_chars=50)
    assert result.truncated and result.error is None
    assert result.content == "x" * 50 + "\n[... 99950 more characters cut]"


def test_arguments_are_data_never_code(tmp_path):
    marker = tmp_path / "ran"
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    result = call(json.dumps({"name": "echo", "arguments": {"text": payload}}).join(["<tool_call>", "</tool_call>"]))
    assert result.content == payload and not marker.exists()
    assert parse_calls(f"<tool_call>{payload}</tool_call>")[0].error.startswith("malformed")
    assert not marker.exists()


def test_the_tools_reach_a_template_without_tools_through_the_system_message(tiny_model_path):
    from minigrpo.model import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path)
    assert not tools.template_has_tools(tokenizer)
    text = tools.render(tokenizer, [{"role": "user", "content": "What is 2 + 40?"}], [add])
    assert '"name": "add"' in text and "<tool_call>" in text and text.index('"name": "add"') < text.index("2 + 40")


def test_a_template_with_tools_gets_them_as_a_list(tiny_model_path):
    from minigrpo.model import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path)
    tokenizer.chat_template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}"
                               "{% endif %}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    assert tools.template_has_tools(tokenizer)
    text = tools.render(tokenizer, [{"role": "user", "content": "hi"}], [add, echo])
    assert text.startswith("TOOLS:add;echo;") and "[user] hi" in text and "<tool_call>" not in text


def test_with_no_tools_every_call_is_unknown():
    assert run_call({}, ToolCall("add", {"a": 1, "b": 1})).content == "error: unknown tool 'add'; the tools are: none"


def test_an_episode_continues_token_by_token_as_the_template_would_render_it(tiny_model_path):
    from minigrpo.model import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path)
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    question = [{"role": "user", "content": "What is 2 + 40?"}]
    said = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'
    result = [{"role": "tool", "name": "add", "content": "42"}]
    # the episode's tokens: the prompt, what the model sampled (ending with its end-of-turn token), the
    # environment's turn
    episode = ids(tools.render(tokenizer, question, [add])) + ids(said) + [tokenizer.eos_token_id] + \
        ids(tools.turn_text(tokenizer, result, [add]))
    whole = tools.render(tokenizer, question + [{"role": "assistant", "content": said}] + result, [add])
    assert tokenizer.decode(episode) == whole
    assert tools.turn_text(tokenizer, result) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_model_path):
    from minigrpo.model import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path)
    tokenizer.chat_template = ("{% for m in messages %}{% if loop.last or m['role'] != 'assistant' %}"
                               "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        tools.turn_text(tokenizer, [{"role": "tool", "content": "42"}])
