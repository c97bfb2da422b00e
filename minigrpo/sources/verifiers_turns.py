"""A verifiers multi-turn environment played in minigrpo's episode loop: the `Env`'s own `run(task, agents)`,
unchanged, with minigrpo's policy in its one seat.

A verifiers `Env` says how an episode goes as a coroutine: it opens an interaction for its agent and calls
`await interaction.turn(message)` for each model turn (a game engine stepping between turns, as verifiers'
TextArena environment does), recording rewards on the interaction's trace. Here each episode runs that
coroutine turn by turn: every `turn(...)` suspends it, its message goes to the model as the user's turn (minigrpo's
`respond`, beyond TRL's environment contract), and the model's reply is sent back in as the turn's result;
when `run` returns, the episode is over and what it recorded on the trace is the environment's reward
(weighted, as verifiers sums them), named after the Env class. The task's own `@vf.reward`s score the
episode's messages as for a single reply.

Each episode's `run` lives on one event loop in a thread of minigrpo's, so it may await what it likes (a
sleep, its engine's I/O) between turns, for up to a minute; an Env with more than one agent seat (a
simulated user, a judge) is refused with the reason.
"""

from __future__ import annotations

import asyncio
import atexit
import queue
import types as pytypes

TURN_TIMEOUT_S = 60.0  # the longest a run() may take between two turns (its game engine stepping)


class Unsupported(ValueError):
    """The Env's run() does something minigrpo's episode loop cannot play."""


def environment_class(env_cls, taskset, tasks, vf):
    """A minigrpo environment class (TRL's `environment_factory` shape, plus `respond`) playing `env_cls`."""
    from verifiers.v1.configs.agent import agent_config_fields

    config_type = _config_type(env_cls, vf)
    seats = list(agent_config_fields(config_type()))
    if len(seats) != 1:
        raise Unsupported(f"{env_cls.__name__} seats {len(seats)} agents ({', '.join(seats)}); minigrpo trains one "
                          f"policy in one seat")
    env = _make_env(env_cls, config_type, taskset, vf)

    class Episode(_Episode):
        def __init__(self):
            super().__init__(env, seats[0], tasks, vf)

    Episode.__name__ = Episode.__qualname__ = env_cls.__name__
    return Episode


class _Interaction:
    """The one interaction of an episode, as verifiers' `Interaction` is used inside `run`: each `turn` hands
    its message to the episode and waits for the model's reply."""

    def __init__(self, episode, trace):
        self._episode, self.trace = episode, trace

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None

    async def turn(self, message=None):
        from verifiers.v1.agent import Segment

        reply = await self._episode._wait_for_reply(message)
        if reply is None:  # the episode ended on minigrpo's side (a limit): the run sees a terminated segment
            return Segment(messages=[], terminated=True)
        return Segment(messages=[self._episode._vf.types.AssistantMessage(content=reply)])


class _Seat:
    def __init__(self, interaction):
        self._interaction, self.trainable = interaction, True

    def interaction(self, task, *args, **kwargs):
        return self._interaction


class _Episode:
    """One episode: the Env's `run` on the event loop of minigrpo's thread for them, a turn at a time."""

    def __init__(self, env, seat: str, tasks, vf):
        self._env, self._seat, self._tasks, self._vf = env, seat, tasks, vf
        self._said: queue.Queue = queue.Queue()  # ("turn", message) | ("end", None) | ("error", exception)
        self._reply = None  # the future the run's current turn waits on
        self._trace, self._running = None, None
        # run() said it ended (queued "end" or an error): its future completes a moment later, so it is not the sign
        self._ended = False

    def reset(self, vf_index: int, **row) -> str | None:
        task, vf = self._tasks()[vf_index], self._vf
        self._trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data),
                               agent=vf.AgentInfo(config=vf.AgentConfig()))
        agents = pytypes.SimpleNamespace(**{self._seat: _Seat(_Interaction(self, self._trace))})
        self._ended = False
        self._running = asyncio.run_coroutine_threadsafe(self._play(task, agents), _loop())
        kind, said = self._next()
        if kind == "end":
            raise Unsupported(f"{type(self._env).__name__}.run() ended before the model's first turn")
        return None if said is None else _text(said)

    def respond(self, message: str) -> str | None:
        kind, said = self._answer(message)
        return None if kind == "end" else "" if said is None else _text(said)

    def get_reward(self) -> float:
        if self._running is not None and not self._ended:  # minigrpo ended it first (a limit):
            if self._answer(None)[0] == "turn":  # run() saw a terminated segment and still asked again
                self._running.cancel()
        return sum(r.score * r.weight for r in self._trace.rewards.values() if r is not None)

    def __deepcopy__(self, memo):  # its run() lives on a thread: the rewards' copies of their arguments share it
        return self

    def __del__(self):  # an episode dropped before its end (one reset only to measure its prompt): run() cancelled
        if self._running is not None and not self._running.done():
            self._running.cancel()

    async def _play(self, task, agents) -> None:
        _PLAYING.add(asyncio.current_task())  # held here, so that a dropped episode's run is cancelled, not lost
        try:
            await self._env.run(task, agents)
        except asyncio.CancelledError:
            return
        except BaseException as error:  # the Env's own code: the episode ends, counted
            self._said.put(("error", error))
            raise
        finally:
            _PLAYING.discard(asyncio.current_task())
        self._said.put(("end", None))

    async def _wait_for_reply(self, message):
        self._reply = asyncio.get_running_loop().create_future()
        self._said.put(("turn", message))
        return await self._reply

    def _answer(self, reply):
        if self._running is None or self._ended or self._running.done():
            return "end", None
        _loop().call_soon_threadsafe(self._reply.set_result, reply)
        return self._next()

    def _next(self):
        try:
            kind, said = self._said.get(timeout=TURN_TIMEOUT_S)
        except queue.Empty:
            self._running.cancel()
            raise Unsupported(f"{type(self._env).__name__}.run() took over {TURN_TIMEOUT_S:.0f} s between two "
                              f"turns") from None
        self._ended = kind in ("end", "error")
        if kind == "error":
            raise said
        return kind, said


_PLAYING: set = set()
_registered: list = []


def _loop() -> asyncio.AbstractEventLoop:
    """The event loop every episode's run() lives on, minigrpo's background loop (at exit, the runs still
    waiting for a turn are cancelled)."""
    from minigrpo.guard import background_loop

    if not _registered:
        _registered.append(atexit.register(_cancel_all))
    return background_loop()


def _cancel_all() -> None:
    async def cancel():
        for task in list(_PLAYING):
            task.cancel()
        await asyncio.gather(*_PLAYING, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(cancel(), _loop()).result(timeout=10)


def _text(message) -> str:
    if isinstance(message, str):
        return message
    return "\n\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(getattr(m, "content", ""))
                       for m in message)


def _config_type(env_cls, vf):
    from verifiers.v1.utils.generic import concrete_type

    return concrete_type(env_cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig


def _make_env(env_cls, config_type, taskset, vf):
    """The Env made as verifiers makes it, from a config naming its taskset."""
    config = config_type.model_validate({"taskset": taskset.config.model_dump()})
    try:
        return env_cls(config)
    except Exception as error:  # noqa: BLE001 - its constructor is the Env's own code
        raise Unsupported(f"{env_cls.__name__}({config_type.__name__}) failed: {type(error).__name__}: {error}") \
            from None
