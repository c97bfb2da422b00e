"""Tasks from OpenEnv servers (`pip install 'minigrpo[openenv]'`): an environment served over HTTP by
`openenv-core` (`create_app(...)`, run by uvicorn), trained one episode per completion.

    minigrpo train --task openenv:http://127.0.0.1:8000                       # a running server
    minigrpo train --task openenv:http://127.0.0.1:8000:size=128,timeout=10   # prompts, seconds per call

Each prompt is the observation the server's `reset(seed=s)` returns (its one text field, or its fields as
JSON), one seed per row; held-out rows use seeds no training row has. A completion is scored by an episode of
its own in a session of its own (OpenEnv's websocket, as its client keeps one environment per connection):
`reset(seed=s)` again, then one `step` whose action is the completion: its text, when the action has one
text field; else the last JSON object in it. The step's reward is the reward, named `openenv_<env name>`.
The reset must honour its seed, so that the episode scored is the one the prompt showed (checked at start).

A failed episode (the server down, a call past its deadline, a reply that is not OpenEnv's, an action the
server refuses) scores 0 and is counted by kind in metrics.jsonl (`openenv/<kind>`); nothing waits
unbounded: every episode ends within its time (`timeout=`, default 30 s, and within the reward time limit).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter

from minigrpo.sources.spec import held_out_size

EXTRA = "pip install 'minigrpo[openenv]'"
DEFAULT_SIZE = 64
TIMEOUT_S = 30.0
HELD_OUT_SEEDS = 500_000  # where the held-out seeds start, above any training seed
# a reset that ignores its seed is caught by asking each of these seeds several times: a server with k observations
# passes by chance with probability k^-(seeds x (resets - 1)), 1 in 15,625 for five
SEED_CHECKS, RESETS_PER_SEED = (0, 1, 2), 3
SKIPPED = {"reward", "done", "metadata"}  # an Action's fields that are OpenEnv's, not the environment's


class EpisodeError(Exception):
    """An episode that did not give a reward; `kind` says how (unreachable, timeout, malformed, refused)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


def parse_spec(spec: str) -> tuple[str, dict]:
    """`openenv:URL[:key=value,...]` -> (URL, options).

    >>> parse_spec("openenv:http://127.0.0.1:8000:size=8,timeout=2.5")
    ('http://127.0.0.1:8000', {'size': 8, 'timeout': 2.5})
    >>> parse_spec("openenv:http://localhost:8000/")
    ('http://localhost:8000', {})
    """
    from minigrpo.sources.spec import parse_spec as options_of

    rest = spec.removeprefix("openenv:")
    url, sep, tail = rest.rpartition(":")
    if not (sep and "=" in tail and "/" not in tail):
        url, tail = rest, ""
    if not re.match(r"https?://", url):
        raise ValueError(f"--task {spec}: give the server's address, as openenv:http://HOST:PORT")
    return url.rstrip("/"), options_of(f"openenv:x:{tail}")[1]


def fields_from_spec(spec: str) -> dict:
    """The fields of a minigrpo Task for an OpenEnv server (see the module)."""
    url, options = parse_spec(spec)
    unknown = set(options) - {"size", "timeout"}
    if unknown:
        raise ValueError(f"--task {spec}: unknown option(s) {sorted(unknown)}; the options are size and timeout")
    size, timeout = int(options.get("size", DEFAULT_SIZE)), float(options.get("timeout", TIMEOUT_S))
    _library()
    schema, name = _describe(url, timeout)
    text_field = _text_field(schema)
    for seed in SEED_CHECKS:  # several seeds, several resets each: a server with few observations seldom fools it
        answers = [_first_observation(url, seed, timeout) for _ in range(RESETS_PER_SEED)]
        if any(answer != answers[0] for answer in answers):
            raise ValueError(f"--task {spec}: the server's reset(seed={seed}) answered different observations; "
                             f"an episode is matched to its prompt by seed, so its reset must honour the seed")
    ask = "" if text_field else f"\n\nReply with a JSON object of the action: {json.dumps(schema)}"

    def make_data(split: str, seed: int) -> list[dict]:
        base = seed * 1_000_000 + (HELD_OUT_SEEDS if split == "test" else 0)
        count = size if split == "train" else held_out_size(size)
        return [{"prompt": [{"role": "user", "content": _observation_text(_first_observation(url, s, timeout))
                             + ask}], "openenv_seed": s} for s in range(base, base + count)]

    def reward(completions, openenv_seed, log_metric=None, **columns) -> list:
        from minigrpo.guard import time_left
        from minigrpo.scoring import text_of

        out, failed = [], Counter()
        for completion, seed in zip(completions, openenv_seed):
            left = time_left()  # the reward's own time limit, where one runs (0.0 once it is spent)
            limit = timeout if left is None else min(timeout, left)
            if limit <= 0:  # the reward's time is spent: no episode is started, so none can outlive it
                failed["timeout"] += 1
                out.append(EpisodeError("timeout", "the reward's time limit was spent before this episode"))
                continue
            try:
                out.append(_run(_episode(url, seed, _action(text_of(completion), text_field), limit), limit))
            except EpisodeError as error:
                failed[error.kind] += 1
                out.append(error)
        for kind, count in failed.items():  # counts of this batch's episodes (a step's metrics average its calls)
            if log_metric is not None:
                log_metric(f"openenv/{kind}", float(count))
        return out

    reward.__name__ = f"openenv_{re.sub(r'[^0-9A-Za-z_]+', '_', name)}"
    return dict(name=f"openenv:{name}", description=f"OpenEnv server {url}, one episode per completion",
                make_data=make_data, rewards=[reward])


def listing() -> str:
    return f"--task openenv:http://HOST:PORT trains on a running OpenEnv server ({EXTRA})"


def _describe(url: str, timeout: float) -> tuple[dict, str]:
    """The action's JSON schema (without OpenEnv's own fields) and the environment's name, from the server."""
    import httpx

    try:
        schema = httpx.get(f"{url}/schema", timeout=timeout).raise_for_status().json()["action"]
        meta = httpx.get(f"{url}/metadata", timeout=timeout)
        name = meta.json().get("name") if meta.is_success else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"the OpenEnv server at {url} does not answer as one ({type(error).__name__}: {error}); "
                         f"start it first (uvicorn module:app --port PORT)") from None
    schema = dict(schema, properties={k: v for k, v in schema.get("properties", {}).items() if k not in SKIPPED})
    return schema, name or url.split("//")[-1]


def _text_field(schema: dict) -> str | None:
    """The action's one field, when it is text: the completion goes there whole."""
    fields = schema["properties"]
    if len(fields) == 1:
        (field, spec), = fields.items()
        if spec.get("type") == "string":
            return field
    return None


def _action(text: str, text_field: str | None) -> dict | EpisodeError:
    if text_field:
        return {text_field: text}
    for match in reversed(list(re.finditer(r"\{", text))):
        try:
            found = json.JSONDecoder().raw_decode(text[match.start():])[0]
        except ValueError:
            continue
        if isinstance(found, dict):
            return found
    return EpisodeError("malformed", "the completion holds no JSON object for the action")


def _observation_text(observation: dict) -> str:
    texts = [v for v in observation.values() if isinstance(v, str)]
    return texts[0] if len(observation) == 1 and texts else json.dumps(observation, sort_keys=True)


def _first_observation(url: str, seed: int, timeout: float) -> dict:
    try:
        return _run(_reset(url, seed, timeout), timeout)
    except EpisodeError as error:
        raise ValueError(f"the OpenEnv server at {url} failed reset(seed={seed}): {error}") from None


def _session(url: str, timeout: float):
    from openenv.core.generic_client import GenericEnvClient

    return GenericEnvClient(base_url=url, connect_timeout_s=timeout, message_timeout_s=timeout)


async def _reset(url: str, seed: int, timeout: float) -> dict:
    async with _session(url, timeout) as client:
        return (await client.reset(seed=seed)).observation


async def _episode(url: str, seed: int, action: dict | EpisodeError, timeout: float) -> float:
    if isinstance(action, EpisodeError):
        raise action
    async with _session(url, timeout) as client:
        await client.reset(seed=seed)
        try:
            result = await client.step(action)
        except RuntimeError as error:  # the server's error message: most often an action it refused
            raise EpisodeError("refused", str(error)) from None
    if not isinstance(result.reward, (int, float)) or isinstance(result.reward, bool):
        raise EpisodeError("malformed", f"the step's reward is {result.reward!r}, not a number")
    return float(result.reward)


def _run(coroutine, limit: float):
    """`coroutine` to its end within `limit` seconds, on minigrpo's background loop: at the deadline the caller
    returns, and the session's closing finishes there. How it failed, as an EpisodeError."""
    import concurrent.futures

    from minigrpo.guard import background_loop

    future = asyncio.run_coroutine_threadsafe(coroutine, background_loop())
    try:
        return future.result(timeout=limit)
    except EpisodeError:
        raise
    except (concurrent.futures.TimeoutError, asyncio.TimeoutError, TimeoutError):
        future.cancel()
        raise EpisodeError("timeout", f"no answer within {limit:.1f} s") from None
    except OSError as error:
        raise EpisodeError("unreachable", f"{type(error).__name__}: {error}") from None
    except Exception as error:  # noqa: BLE001 - a reply that is not OpenEnv's (bad JSON, wrong shapes)
        raise EpisodeError("malformed", f"{type(error).__name__}: {error}") from None


def _library():
    try:
        import openenv.core  # noqa: F401
    except ImportError:
        raise ValueError(f"--task openenv:... needs openenv-core: {EXTRA}") from None
