"""Running the user's code (rewards, tools, judges, environments) so that its failures stay its own.

A call gets a time limit that its own code cannot reset or swallow (`time_limit`, raising `OutOfTime`); a
KeyboardInterrupt it raises itself is told from the user's Ctrl-C (`real_interrupts`); an `async def` result is
awaited, in a notebook's running loop too (`awaited`); and code that waits on something outside learns how
long it has left (`time_left`) or leaves a slow close behind on a loop of its own (`background_loop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import signal
import sys
import threading
import time

_deadline: contextvars.ContextVar = contextvars.ContextVar("minigrpo_deadline", default=None)  # see time_left
SLOW_NOTICE_S = 10.0  # a call running this long is announced, so a slow reward is not a silent hang


class OutOfTime(BaseException):
    """Raised inside a reward or tool call that ran past its time (a BaseException, so `except Exception`
    in the user's own code does not swallow it)."""


# the time limits' own signal: a reward's signal.alarm (math_verify sets and clears one) cannot reset it
LIMIT_SIGNAL = getattr(signal, "SIGRTMAX", signal.SIGALRM)
_running: list[tuple[float, str]] = []  # (deadline, message) of each limit in force, innermost last


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str, hint: str = ""):
    """Interrupt the call after `seconds` (main thread, POSIX: a timer thread signals it), and say so when it
    takes long. `what` names the user's code in the notice ("reward function f"); `hint` says how to change
    the limit. Elsewhere the call is not interrupted, but `time_left` still tells code that waits."""
    deadline = time.monotonic() + seconds if seconds else None
    token = _deadline.set(deadline)
    use_signal = seconds and hasattr(signal, "pthread_kill") and threading.current_thread() is threading.main_thread()
    if not use_signal:
        try:
            yield
        finally:
            _deadline.reset(token)
        return
    if signal.getsignal(LIMIT_SIGNAL) is not _expire:
        signal.signal(LIMIT_SIGNAL, _expire)  # and left in place: a late signal then finds nothing to stop
    _running.append((deadline, f"ran past its time limit ({seconds:g} s{'; ' + hint if hint else ''})"))
    alarm = threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, LIMIT_SIGNAL))
    notice = threading.Timer(SLOW_NOTICE_S, lambda: print(
        f"minigrpo: {what} is still running after {SLOW_NOTICE_S:g} s (limit {seconds:g} s)...",
        file=sys.stderr, flush=True))
    for timer in (alarm, notice):
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        alarm.cancel()
        notice.cancel()
        _running.pop()
        _deadline.reset(token)


def _expire(signum, frame) -> None:
    """The limit's signal arrived: stop the call if a limit in force has run out (it may be a late signal of
    one that has ended, or an outer limit's, which ends the inner call too)."""
    now = time.monotonic()
    for deadline, message in _running:
        if deadline <= now:
            raise OutOfTime(message)


def time_left() -> float | None:
    """Seconds left before the innermost `time_limit` ends the call (None: no limit). Code that waits on
    something outside, a judge's server, stops waiting in time to return what it has."""
    deadline = _deadline.get()
    return None if deadline is None else max(0.0, deadline - time.monotonic())


@contextlib.contextmanager
def real_interrupts():
    """Records a real SIGINT during the call (then passes it on), so that a KeyboardInterrupt the reward's
    code raised itself can be told from the user's Ctrl-C."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = signal.getsignal(signal.SIGINT)

    def record(signum, frame):
        seen.append(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, record)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def awaited(value):
    """An async reward's or tool's result, awaited here (on a fresh event loop; in a thread of its own where
    this one already runs a loop, as a notebook's does); anything else as it is."""
    if not inspect.isawaitable(value):
        return value

    async def wait_for():
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait_for())
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = asyncio.run(wait_for())
        except BaseException as error:  # raised again in the caller's thread
            out["error"] = error

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


_background: list = []  # the one event loop of background_loop(), once started


def background_loop() -> asyncio.AbstractEventLoop:
    """An event loop running in a daemon thread of its own (started on first use), for work that must be left
    behind at a deadline: a caller waits on `run_coroutine_threadsafe(...).result(timeout)` and returns on
    time, while a connection that cannot close politely finishes closing here."""
    if not _background:
        _background.append(asyncio.new_event_loop())
        threading.Thread(target=_background[0].run_forever, name="minigrpo-background", daemon=True).start()
    return _background[0]
