"""Tasks from OpenEnv servers: environments written here in OpenEnv's own server API, served by uvicorn on
127.0.0.1 (openenv-core itself, no stand-in), trained one episode per completion; failures scored, counted, bounded."""

import json
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from typer.testing import CliRunner

from minigrpo.cli.app import app
from minigrpo.scoring import score
from minigrpo.tasks import get_task

pytest.importorskip("openenv.core")

SERVER = '''
import random
import time

from fastapi import FastAPI
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

WORDS = ["apple", "river", "stone", "cloud", "green"]


class SayAction(Action):
    message: str


class SayObservation(Observation):
    text: str = ""


class SayWord(Environment):
    """Say the word the reset names; "slow" makes the step take 120 s, "nothing" gives no reward."""
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self.word, self._state = WORDS[0], State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.word = WORDS[(seed or 0) % len(WORDS)]
        return SayObservation(text=f"Say the word {self.word}.", done=False, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        if "slow" in action.message:
            time.sleep(120)
        reward = None if "nothing" in action.message else float(self.word in action.message.lower())
        return SayObservation(text="", done=True, reward=reward)

    @property
    def state(self):
        return self._state


class CellAction(Action):
    row: int
    col: int


class CellObservation(Observation):
    rows: int = 3
    cols: int = 3
    hint: str = ""


class FindCell(Environment):
    """Name the hidden cell of a grid: an action of two fields, given as JSON."""
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self.cell, self._state = (0, 0), State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.cell = divmod((seed or 0) % 9, 3)
        return CellObservation(hint=f"The cell is in row {self.cell[0]}.", done=False, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        return CellObservation(done=True, reward=float((action.row, action.col) == self.cell))

    @property
    def state(self):
        return self._state


class Unseeded(SayWord):
    """A reset that ignores its seed: every answer differs (a counter), so the check cannot pass by chance."""
    resets = 0

    def reset(self, seed=None, episode_id=None, **kwargs):
        Unseeded.resets += 1
        observation = super().reset(seed=random.randrange(1000))
        observation.text += f" ({Unseeded.resets})"
        return observation


app = FastAPI()
for path, env, action, observation in [("/say", SayWord, SayAction, SayObservation),
                                       ("/cell", FindCell, CellAction, CellObservation),
                                       ("/unseeded", Unseeded, SayAction, SayObservation)]:
    app.mount(path, create_app(env, action, observation, env_name=path[1:], max_concurrent_envs=8))
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("openenv")
    (folder / "envs_app.py").write_text(textwrap.dedent(SERVER))
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "uvicorn", "envs_app:app", "--host", "127.0.0.1", "--port",
                                str(port), "--log-level", "warning"], cwd=folder, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/say/schema", timeout=2).is_success:
                break
        except httpx.HTTPError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, "the OpenEnv test server did not start"
        time.sleep(0.5)
    yield url
    process.kill()  # not a graceful stop: that would wait for the 120-s step
    process.wait(timeout=30)


def said(result) -> str:
    return " ".join(result.output.split())


def scored(task, rows, completions):
    return score(task.rewards, task.weights, [r["prompt"] for r in rows], completions, [[]] * len(rows), rows)


def test_prompts_come_from_seeded_resets_and_each_completion_is_an_episode(server):
    task = get_task(f"openenv:{server}/say:size=20")
    assert task.reward_names == ["openenv_SayWord"]
    train, test = task.make_data("train", 0), task.make_data("test", 0)
    assert [r["prompt"][0]["content"] for r in train[:2]] == ["Say the word apple.", "Say the word river."]
    assert len(train) == 20 and len(test) == 2  # a tenth held out, as of every source
    assert not {r["openenv_seed"] for r in train} & {r["openenv_seed"] for r in test}
    result = scored(task, train[:3], ["apple", "banana", "Stone, I say."])
    assert result.values["openenv_SayWord"] == [1.0, 0.0, 1.0] and not result.errors


def test_an_action_of_several_fields_is_read_as_json(server):
    task = get_task(f"openenv:{server}/cell:size=4")
    row = task.make_data("train", 0)[1]  # seed 1: row 0, column 1
    assert "The cell is in row 0." in row["prompt"][0]["content"] and '"col"' in row["prompt"][0]["content"]
    with pytest.warns(UserWarning, match="could not score 2 of 4"):
        result = scored(task, [row] * 4, ['{"row": 0, "col": 1}', 'I pick {"row": 0, "col": 2}', "row 0",
                                          '{"row": "zero", "col": 1}'])
    assert result.values["openenv_FindCell"] == [1.0, 0.0, 0.0, 0.0]
    assert result.metrics == {"openenv/malformed": [1.0], "openenv/refused": [1.0]}


def test_failed_episodes_score_zero_counted_and_within_their_deadline(server, monkeypatch):
    # a deadline far above what a normal episode takes on a busy machine, far below the slow step
    task = get_task(f"openenv:{server}/say:size=2,timeout=10")
    row = task.make_data("train", 0)[0]
    started = time.monotonic()
    with pytest.warns(UserWarning, match="could not score 2 of 3"):
        result = scored(task, [row] * 3, ["slow apple", "apple, nothing", "apple"])
    assert result.values["openenv_SayWord"] == [0.0, 0.0, 1.0]
    assert result.metrics == {"openenv/timeout": [1.0], "openenv/malformed": [1.0]}
    assert time.monotonic() - started < 100  # the 120-s step was cut at its 10-s deadline, not waited for
    monkeypatch.setattr("minigrpo.guard.time_left", lambda: 0.0)  # the reward's own time limit is spent
    with pytest.warns(UserWarning, match="could not score 1 of 1"):
        spent = scored(task, [row], ["apple"])
    assert spent.metrics == {"openenv/timeout": [1.0]}  # not asked at all: no wait past the limit


def test_a_server_that_goes_away_scores_zero_and_is_counted():
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r})
        import test_openenv_task as t, textwrap, types
        module = types.ModuleType("envs_app"); exec(textwrap.dedent(t.SERVER), module.__dict__)
        import uvicorn; uvicorn.run(module.app, host="127.0.0.1", port={port}, log_level="warning")""")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/say"
    try:
        deadline = time.monotonic() + 120
        while not _answers(url):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        task = get_task(f"openenv:{url}:size=2,timeout=20")
        row = task.make_data("train", 0)[0]
    finally:
        process.kill()  # gone at once, as a crashed server is
        process.wait(timeout=30)
    with pytest.warns(UserWarning, match="could not score 2 of 2"):
        result = scored(task, [row] * 2, ["apple", "apple"])
    assert result.values["openenv_SayWord"] == [0.0, 0.0] and result.metrics == {"openenv/unreachable": [2.0]}  # a count


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/schema", timeout=2).is_success
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("where, says", [
    ("/unseeded", "its reset must honour the seed"),
    (":1", "does not answer as one"),
])
def test_servers_that_cannot_train_are_one_line(server, where, says, tmp_path):
    url = f"{server}{where}" if where.startswith("/") else f"http://127.0.0.1{where}"
    result = CliRunner().invoke(app, ["train", "--task", f"openenv:{url}", "--out", str(tmp_path / "run")])
    assert result.exit_code == 1 and says in said(result) and "Traceback" not in result.output, result.output


def test_without_the_library_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "openenv.core", None)  # as if not installed
    result = CliRunner().invoke(app, ["train", "--task", "openenv:http://127.0.0.1:9", "--out",
                                      str(tmp_path / "run")])
    assert result.exit_code == 1 and "pip install 'minigrpo[openenv]'" in said(result), result.output


def test_trains_from_the_command_line(server, tmp_path):
    trained = CliRunner().invoke(app, ["train", "--task", f"openenv:{server}/say:size=8", "--steps", "1", "-G", "2",
                                       "--prompts-per-step", "2", "--max-new-tokens", "6", "--eval-prompts", "1",
                                       "--out", str(tmp_path / "run")])
    assert trained.exit_code == 0, trained.output
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert "reward/openenv_SayWord/mean" in metrics and not [k for k in metrics if k.endswith("/errors")], metrics
