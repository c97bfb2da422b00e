"""A judge's OpenAI-compatible chat endpoint, where every wait has a deadline.

`ChatEndpoint.ask` sends a batch of conversations `concurrency` at a time, each request with `timeout`
seconds and `retries` retries with exponential backoff (429, obeying Retry-After in both its forms, and 5xx).
Inside a reward's time limit (`guard.time_left`), that limit is a hard deadline for the whole batch,
retries included: it stops waiting in time to return, and what is unanswered scores 0 as a counted error,
never a crash and never a wait for a stuck server. Ctrl-C goes through: the workers stop retrying and
nobody waits for them. `preflight` checks the endpoint before training.
"""

from __future__ import annotations

import email.utils
import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from datetime import datetime, timezone
from typing import Callable

from minigrpo.guard import time_left


class JudgeUnavailable(ValueError):
    fatal = True  # a refused key, a wrong address, no model to judge with: the run stops, named


class JudgeError(RuntimeError):
    """A judge that could not be reached for one completion after its retries: that completion's error."""


def retry_after(value: str | None, now: datetime | None = None) -> float:
    """Seconds to wait as a Retry-After header says (RFC 9110: a number of seconds, or an HTTP date);
    0 for anything else.

    >>> retry_after("3")
    3.0
    >>> retry_after("Wed, 21 Oct 2026 07:28:30 GMT", now=datetime(2026, 10, 21, 7, 28, tzinfo=timezone.utc))
    30.0
    >>> retry_after("soon"), retry_after(None)
    (0.0, 0.0)
    """
    if not value:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    when = when if when.tzinfo else when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - (now or datetime.now(timezone.utc))).total_seconds())


class ChatEndpoint:
    """The server a Judge with an `endpoint` asks (see the module)."""

    backoff = 0.5  # seconds before the first retry, doubling after each

    def __init__(self, url: str, model: str, api_key_env: str, timeout: float, retries: int, concurrency: int,
                 name: str):
        self.endpoint, self.model, self.api_key_env = url, model, api_key_env
        self.timeout, self.retries, self.concurrency, self.__name__ = timeout, retries, concurrency, name

    def ask(self, messages: list[list[dict]], max_tokens: int, count: Callable) -> list:
        """A reply, or the JudgeError that stands for it, per conversation (`count(tokens=n)` gets the usage).
        Concurrent; it stops waiting at the deadline (the reward's time limit, less a margin to return in),
        so a server that never answers costs no more: what is unanswered then is a counted error."""
        left = time_left()
        deadline = time.monotonic() + left - min(1.0, 0.1 * left) if left is not None else None
        stop = threading.Event()
        pool = ThreadPoolExecutor(max_workers=self.concurrency)
        futures = [pool.submit(self._post, m, max_tokens, count, deadline, stop) for m in messages]
        try:
            done, _ = wait(futures, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        finally:  # also on Ctrl-C: the workers stop retrying, and nobody waits for them
            stop.set()
            pool.shutdown(wait=False, cancel_futures=True)
        return [f.result() if f in done else JudgeError(f"{self.endpoint}: no answer within the reward's time "
                                                        f"limit ({left:g} s)") for f in futures]

    def _post(self, messages: list[dict], max_tokens: int, count: Callable, deadline: float | None,
              stop: threading.Event):
        body = json.dumps({"model": self.model, "messages": messages, "max_tokens": max_tokens,
                           "temperature": 0}).encode()
        headers = {"Content-Type": "application/json", **self._key()}
        failure = JudgeError(f"{self.endpoint}: no answer within the reward's time limit")
        for attempt in range(self.retries + 1):
            left = self.timeout if deadline is None else min(self.timeout, deadline - time.monotonic())
            if left <= 0 or stop.is_set():
                return failure
            try:
                request = urllib.request.Request(f"{self.endpoint}/chat/completions", body, headers)
                with urllib.request.urlopen(request, timeout=left) as response:
                    data = json.loads(response.read())
                usage = data.get("usage") or {}
                count(tokens=usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0))
                return data["choices"][0]["message"]["content"] or ""
            except urllib.error.HTTPError as error:
                if error.code in (401, 403, 404):
                    raise self._unavailable(f"answered {error.code} ({error.reason})") from None
                failure = JudgeError(f"{self.endpoint} answered {error.code} ({error.reason})")
                wait_s = retry_after(error.headers.get("Retry-After")) if error.code == 429 else 0.0
            except (urllib.error.URLError, TimeoutError, OSError, KeyError, IndexError, TypeError, ValueError) as error:
                failure, wait_s = JudgeError(f"{self.endpoint}: {error}"), 0.0
            pause = max(wait_s, self.backoff * 2 ** attempt)
            if deadline is None:
                pause = min(pause, self.timeout)  # a Retry-After of an hour is not waited out
            elif time.monotonic() + pause >= deadline:
                break  # no retry would be answered in time
            if attempt == self.retries or stop.wait(pause):
                break
        return failure

    def preflight(self, rubric_chars: int, max_tokens: int) -> None:
        """Before training: the endpoint answers, the key is taken, and the rubric fits the judge's context
        where the server says it (vLLM's /models gives max_model_len). Raises JudgeUnavailable, named."""
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/models", headers=self._key()),
                                        timeout=min(self.timeout, 10.0)) as response:
                listed = json.loads(response.read()).get("data") or []
        except urllib.error.HTTPError as error:
            if error.code in (401, 403):
                raise self._unavailable(f"answered {error.code} ({error.reason})") from None
            return  # it answers; not every server lists its models
        except (urllib.error.URLError, TimeoutError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise self._unavailable(f"did not answer ({reason}); start the server or fix the address "
                                    f"(nothing was trained)") from None
        except (ValueError, AttributeError):
            return
        served = [m for m in listed if isinstance(m, dict) and m.get("id") == self.model]
        context = served[0].get("max_model_len") if served else None
        needed = rubric_chars // 3 + max_tokens + 256  # a rough token count, the grade, a short reply
        if isinstance(context, int) and needed > context:
            raise JudgeUnavailable(f"judge {self.__name__}: the rubric (about {rubric_chars // 3:,} tokens) and "
                                   f"max_tokens={max_tokens} leave no room for the reply in {self.model}'s "
                                   f"context of {context:,} tokens: shorten the rubric")

    def _key(self) -> dict:
        key = os.environ.get(self.api_key_env)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _unavailable(self, what: str) -> JudgeUnavailable:
        return JudgeUnavailable(f"judge {self.__name__}: {self.endpoint} {what}: check the address, "
                                f"model={self.model!r} and the key in ${self.api_key_env}")
