"""Tasks from verifiers (`pip install 'minigrpo[verifiers]'`): a verifiers taskset, its prompts and its own
rubric (the task's `@vf.reward` functions and weights), a `--task` away.

    minigrpo train --task vf:my_taskset                  # an installed taskset package (its Taskset in __all__)
    minigrpo train --task vf:envs/arith.py:size=200      # a Taskset defined in a file; its config fields too

    from minigrpo.tasks import get_task
    task = get_task("vf:envs/arith.py")                  # the same, from Python

Verifiers 0.4 splits an environment into a data half (a `Taskset` yielding `Task`s: prompt, system prompt,
fields of its own, and `@vf.reward` / `@vf.metric` methods) and a rollout half (an `Env` whose harness runs
an agent program under a runtime, calling the model through an intercepting OpenAI-style proxy, with tools as
MCP servers; the runtime bootstraps `uv` from the network). The rollout half needs separate processes and a
network, so minigrpo takes the data half and the scoring as they are and generates itself: for a
single-turn task the model's one reply is the whole rollout, and minigrpo hands the task the trace its
rollout would have recorded (system, user, the sampled assistant turn) and scores it with the task's own
`score`. Each reward is logged by its name with its weight; `@vf.metric`s go to metrics.jsonl. Tasksets
whose tools are `vf.Toolset`s run them in minigrpo's episode loop (each completion an episode, as with
`--tool`), the toolset's `@vf.tool` methods called in this process; a multi-turn `Env` of the taskset's own
plays its `run()` in that loop too (`minigrpo.sources.verifiers_turns`). Tasksets that need containers or judges are
refused with the reason.

Options: `size` (training tasks read from an endless taskset; default 1000), and any field of the
taskset's config. The held-out tasks are a fixed, seeded tenth of the rest (at most 200), as for a data file.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import inspect
import json
import pkgutil
import sys
from pathlib import Path

from minigrpo.sources.spec import parse_spec, split_rows

EXTRA = "pip install 'minigrpo[verifiers]'"
DEFAULT_SIZE = 1000


def fields_from_spec(spec: str) -> dict:
    """The fields of a minigrpo Task for `vf:NAME[:key=value,...]` (see the module)."""
    name, options = parse_spec(spec)
    size = int(options.pop("size", DEFAULT_SIZE))
    vf = _library()
    taskset, env = _taskset(name, options, vf)
    tasks = functools.cache(lambda: _tasks(taskset, size))
    try:
        probe = next(iter(taskset.take(1)), None)
    except Exception as error:  # its own load(): a download offline, a missing file
        raise ValueError(f"vf:{name}: the taskset could not load its tasks ({_first_line(error)})") from None
    if probe is None:
        raise ValueError(f"vf:{name}: the taskset yields no tasks")
    if all(m["role"] == "system" for m in messages(probe.data)):
        raise ValueError(f"vf:{name}: its tasks carry no prompt (its Env's run() writes the first turn), and "
                         f"minigrpo starts every episode from the task's prompt: give its tasks a prompt")
    refusal = unsupported(taskset, probe, env, vf)
    if refusal:
        raise ValueError(f"vf:{name}: {refusal}; minigrpo plays verifiers tasks in its own process")
    hooks = probe.hooks("reward")
    if not hooks and env is vf.SingleAgentEnv:
        raise ValueError(f"vf:{name}: its Task has no @vf.reward method to train on")

    @functools.lru_cache(maxsize=8192)
    def scored(index: int, completion: str):
        return _score(tasks()[index], json.loads(completion), vf)

    def make_data(split: str, seed: int) -> list[dict]:
        rows = [{"prompt": messages(task.data), "vf_index": i} for i, task in enumerate(tasks())]
        return split_rows(rows, split, seed)

    environment = None
    if env is not vf.SingleAgentEnv:
        from minigrpo.sources.verifiers_turns import Unsupported, environment_class

        try:
            environment = environment_class(env, taskset, tasks, vf)
        except Unsupported as error:
            raise ValueError(f"vf:{name}: {error}") from None
    names = [hook.__name__ for hook in hooks]
    rewards = [_reward(name, names, scored, logs_metrics=i == 0) for i, name in enumerate(names)]
    return dict(name=f"vf:{Path(name).stem if name.endswith('.py') else name}", make_data=make_data,
                description=f"verifiers taskset {type(taskset).__name__}, scored by its rubric", rewards=rewards,
                weights=[float(getattr(h, "_vf_weight", 1.0)) for h in hooks], tools=toolset_tools(taskset),
                environment=environment)


def toolset_tools(taskset) -> list:
    """The `@vf.tool` methods of the taskset's toolsets (and its task type's), as minigrpo tools under the names
    verifiers advertises (`<server>_<tool>`): minigrpo's episode loop calls them in this process, on one
    instance of each toolset made from its config (its per-rollout state stays the toolset's default)."""
    from verifiers.v1.utils.decorators import discover_decorated

    config = taskset.config
    out = []
    for server in [*type(taskset).toolsets(config), *taskset.task_type().toolsets(config.task)]:
        for method in discover_decorated(server, "tool"):
            name = getattr(method, "tool_name", None) or method.__name__
            out.append(_renamed(method, f"{server.server_name}_{name}" if server.server_name else name))
    return out


def _renamed(method, name: str):
    @functools.wraps(method)
    def tool(*args, **kwargs):
        return method(*args, **kwargs)

    tool.__name__ = tool.__qualname__ = name
    return tool


def messages(data) -> list[dict]:
    """A verifiers TaskData's prompt (text or messages) and system prompt as chat messages."""
    from verifiers.v1.types import content_text

    prompt = data.prompt
    turns = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else
             [{"role": m.role, "content": content_text(m.content)} for m in prompt or []])
    return ([{"role": "system", "content": data.system_prompt}] if data.system_prompt else []) + turns


def unsupported(taskset, task, env, vf) -> str | None:
    """Why minigrpo cannot train this taskset (of which `task` is one) as it is (None: it can)."""
    config = taskset.config
    task_type = taskset.task_type()
    if task_type.NEEDS_CONTAINER:
        return "its tasks need a container"
    if config.task.judges:
        return "its rubric has judges, which call a model through verifiers' clients (use minigrpo's --judge)"
    for kind in ("reward", "metric"):
        for hook in task.hooks(kind):
            runtime = inspect.signature(hook).parameters.get("runtime")
            if runtime is not None and runtime.default is inspect.Parameter.empty:
                return f"its {kind} {hook.__name__} reads a runtime (a container the agent ran in)"
    return None


def listing() -> str:
    """What `--task vf:NAME` takes (for `minigrpo tasks`)."""
    return f"--task vf:NAME or vf:file.py runs a verifiers taskset ({EXTRA})"


def _taskset(name: str, options: dict, vf):
    from pydantic import ValidationError
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import environment_class, file_module, taskset_class

    if name.endswith(".py"):
        if not Path(name).is_file():
            raise FileNotFoundError(f"--task vf:{name}: no such file")
        try:
            module = file_module(name)
        except Exception as error:  # the file's own code, run at import
            raise ValueError(f"--task vf:{name}: importing it raised {_first_line(error)}") from None
        found = [obj for obj in vars(module).values()
                 if isinstance(obj, type) and issubclass(obj, vf.Taskset) and obj is not vf.Taskset
                 and obj.__module__ == module.__name__]
        if len(found) != 1:
            raise ValueError(f"--task vf:{name}: the file must define one verifiers Taskset subclass "
                             f"(it defines {len(found)})")
        envs = [obj for obj in vars(module).values() if isinstance(obj, type) and issubclass(obj, vf.Env)
                and obj.__module__ == module.__name__]
        # importable by its name, as verifiers finds a taskset (and an Env builds its own) by id
        if sys.modules.setdefault(module.__name__, module) is module and not hasattr(module, "__all__"):
            module.__all__ = [found[0].__name__, *(e.__name__ for e in envs[:1])]
        cls, config_id, env = found[0], module.__name__, envs[0] if envs else vf.SingleAgentEnv
    else:
        try:
            cls, config_id, env = taskset_class(name), name, environment_class(name)
        except ModuleNotFoundError as error:
            package = name.replace("-", "_")
            if importlib.util.find_spec(package) is not None:  # installed: its own import failed
                for _ in range(10):  # verifiers wraps the import's own error: the innermost one is the cause
                    error = error.__cause__ or error.__context__ or error
                raise ValueError(f"--task vf:{name}: the package is installed, and importing it raised "
                                 f"{_first_line(error)}") from None
            close = difflib.get_close_matches(package, [m.name for m in pkgutil.iter_modules()], n=3)
            raise ValueError(f"--task vf:{name}: no verifiers taskset package {name!r} is installed"
                             + (f"; did you mean {', '.join(close)}?" if close else
                                "; install it (`pip install NAME`) or give a file: vf:file.py")) from None
        except (TypeError, AttributeError, ValueError) as error:
            raise ValueError(f"--task vf:{name}: {error}") from None
    config_type = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
    try:
        return cls(config_type.model_validate({"id": config_id, **options})), env
    except ValidationError as error:
        first = error.errors()[0]
        raise ValueError(f"--task vf:{name}: option {'.'.join(map(str, first['loc']))}: {first['msg']} "
                         f"(its options: size, {', '.join(config_type.model_fields)})") from None
    except Exception as error:  # the taskset's own set-up
        raise ValueError(f"--task vf:{name}: the taskset could not start ({_first_line(error)})") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


def _tasks(taskset, size: int) -> list:
    return list(taskset if taskset.bounded else taskset.take(size))


def _score(task, completion, vf):
    """The task's own `score` on the trace its rollout would have recorded for `completion` (a reply, or an
    episode's messages): its rewards (name -> Reward) and metrics; an exception in place if its scoring failed
    (the task's own code: scored 0, counted)."""
    from verifiers.v1.graph import MessageNode

    from minigrpo.guard import awaited

    given = [_message(m, False) for m in messages(task.data)]
    taken = [_message(m, True) for m in completion] if isinstance(completion, list) else [
        _message({"role": "assistant", "content": completion}, True)]
    nodes = [MessageNode(parent=i - 1 if i else None, message=m, sampled=sampled)
             for i, (m, sampled) in enumerate(given + taken)]
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data),
                     agent=vf.AgentInfo(config=vf.AgentConfig()), nodes=nodes, is_completed=True, ok=True)
    try:
        awaited(task.score(trace))
    except vf.TaskError as error:
        return error
    return trace


def _message(m: dict, taken: bool):
    """A chat message as verifiers records it, and whether the model wrote it (an assistant turn it sampled)."""
    from verifiers.v1 import types

    role, content = m["role"], m.get("content")
    if role == "assistant":
        calls = [types.ToolCall(id=f"call_{i}", name=c["function"]["name"],
                                arguments=json.dumps(c["function"]["arguments"]))
                 for i, c in enumerate(m.get("tool_calls") or [])]
        return types.AssistantMessage(content=content, tool_calls=calls or None), taken
    if role == "tool":
        text = content if isinstance(content, str) else json.dumps(content)
        return types.ToolMessage(tool_call_id="call", name=m.get("name"), content=text), False
    kind = {"system": types.SystemMessage, "user": types.UserMessage}[role]
    return kind(content=content if isinstance(content, str) else json.dumps(content)), False


def _reward(name: str, names: list[str], scored, logs_metrics: bool):
    """A minigrpo reward reading the verifiers reward `name` (one of the task's `names`) from the task's scored
    trace; a reward that returned a mapping records its parts under their own names, given here as parts (the
    trace does not say which function wrote them: with two such rewards, each is given every part)."""
    def reward(completions, vf_index, log_metric=None, **columns) -> list:
        traces = [scored(i, json.dumps(c, default=str)) for c, i in zip(completions, vf_index)]
        if logs_metrics and log_metric is not None:
            for trace in traces:
                for metric, value in getattr(trace, "metrics", {}).items():
                    if value is not None:
                        log_metric(metric, value)
        return [trace if isinstance(trace, Exception) else _value(trace, name, names) for trace in traces]

    reward.__name__ = name
    return reward


def _value(trace, name: str, names: list[str]):
    if name in trace.rewards:
        found = trace.rewards[name]
        return None if found is None else found.score
    return {key: r.score for key, r in trace.rewards.items() if r is not None and key not in names}


def _library():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ValueError(f"--task vf:... needs verifiers: {EXTRA}") from None
    return vf
