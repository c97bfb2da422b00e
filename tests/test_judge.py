"""Judge rewards: replies parsed strictly, cached, logged and counted; the in-memory base model, a real
OpenAI-compatible HTTP server on 127.0.0.1, and a sequence-classification reward model, each in training."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from minigrpo.judge import rubric as J
from minigrpo.judge.rubric import Judge
from minigrpo.judge.client import ChatEndpoint
from minigrpo.scoring import score


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIGRPO_JUDGE_CACHE", str(tmp_path / "judge.sqlite"))
    yield
    J.attach(None, None)


def scripted(replies):
    """A stand-in for the base model: each conversation's reply from `replies(asked_text)`."""
    asked = []

    def generate(conversations, max_tokens):
        asked.extend(c[-1]["content"] for c in conversations)
        return [(replies(c[-1]["content"]), 10) for c in conversations]

    return generate, asked


def test_scores_are_parsed_strictly_and_malformed_replies_are_counted_errors():
    generate, asked = scripted(lambda text: "Kind.\nScore: 7" if "thanks" in text else "I like it a lot!")
    J.attach(generate)
    polite = Judge("Polite: 10. Rude: 0.", name="polite")
    with pytest.warns(UserWarning, match="could not score 1 of 2"):
        result = score([polite], [1.0], ["Say hi.", "Say hi."], ["Hi, thanks!", "Go away."], [[], []],
                       [{"prompt": "Say hi."}] * 2)
    assert result.totals == [0.7, 0.0] and result.errors == {"polite": 1}
    assert "Polite: 10. Rude: 0." in asked[0] and "Hi, thanks!" in asked[0] and "'Score: N'" in asked[0]
    assert J.step_metrics() == {"judge/polite/calls": 2, "judge/polite/cached": 0, "judge/polite/tokens": 20,
                                "judge/polite/errors": 1, "judge/polite/gated": 0}
    # the good grade was cached; the malformed one is asked again
    polite(["Say hi.", "Say hi."], ["Hi, thanks!", "Go away."])
    assert J.step_metrics()["judge/polite/cached"] == 1 and len(asked) == 3


def test_rank_mode_grades_each_group_together():
    generate, asked = scripted(lambda text: "1: 9\n2: 3" if "<reply 2>" in text else "1: 5")
    J.attach(generate)
    ranked = Judge("Funny: 10.", name="ranked", mode="rank")
    scores = ranked(["Joke A.", "Joke A.", "Joke B."], ["one", "two", "three"])
    assert scores == [0.9, 0.3, 0.5] and len(asked) == 2  # two groups: the same prompt twice, then another
    assert "<reply 1>\none\n</reply 1>" in asked[0] and "<reply 2>\ntwo" in asked[0]
    with pytest.raises(J.MalformedReply, match="2 of 3"):
        J.parse_ranking("1: 4\n3: 2", 3, 10)
    with pytest.raises(J.MalformedReply, match="repeats"):
        J.parse_ranking("1: 4\n1: 2", 2, 10)


def test_defences_gate_length_and_rubric_echo():
    generate, asked = scripted(lambda text: "Score: 10")
    J.attach(generate)
    rubric = "the reply names a colour and says why it likes that colour best of all"
    gated = Judge(rubric, name="gated", gate=lambda prompt, text: text.count("\n") == 0, max_chars=20)
    scores = gated(["p"] * 4, ["Blue, like the sea.", "Blue.\nBecause.", "Blue " * 10,
                               f"Yes: {rubric.upper()}"])
    # prose passes; two lines fail the gate; 50 characters get 20/50 of the grade; quoting the rubric gets 0
    assert scores == [1.0, 0.0, pytest.approx(0.4), 0.0] and len(asked) == 2
    assert J.step_metrics()["judge/gated/gated"] == 2


def test_the_in_memory_judge_needs_a_loaded_model():
    with pytest.raises(J.JudgeUnavailable, match="runs inside `minigrpo train`"):
        score([Judge("x", name="alone")], [1.0], ["p"], ["c"], [[]], [{"prompt": "p"}])


class Grader(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat completions endpoint: the grade is the reply's count of the letter e
    (at most 10). It checks the key, fails each new question once (500, then 429) before answering, and
    sleeps a little so concurrent requests overlap."""
    hits: list = []
    seen: dict = {}
    live = [0, 0]  # now, most at once

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Grader.hits.append(body)
        if self.path != "/v1/chat/completions" or self.headers.get("Authorization") != "Bearer sesame":
            return self._send(401 if self.path == "/v1/chat/completions" else 404, {"error": "no"})
        asked = body["messages"][-1]["content"]
        reply = asked.split("<reply>\n")[1].split("\n</reply>")[0]
        if "slow" in reply:
            time.sleep(3)
        tries = Grader.seen[asked] = Grader.seen.get(asked, 0) + 1
        if tries == 1:
            return self._send(500, {"error": "busy"})
        if tries == 2:
            return self._send(429, {"error": "slow down"}, {"Retry-After": "0"})
        Grader.live[0] += 1
        Grader.live[1] = max(Grader.live)
        time.sleep(0.2)
        Grader.live[0] -= 1
        content = "nonsense" if "gibberish" in reply else f"Score: {min(reply.count('e'), 10)}"
        self._send(200, {"choices": [{"message": {"role": "assistant", "content": content}}],
                         "usage": {"prompt_tokens": 100, "completion_tokens": 5}})

    def do_GET(self):
        if self.path != "/v1/models":
            return self._send(404, {"error": "no"})
        self._send(200, {"object": "list", "data": [{"id": "grader", "object": "model", "max_model_len": 2048}]})

    def _send(self, code, data, headers=()):
        payload = json.dumps(data).encode()
        self.send_response(code)
        for key, value in dict(headers).items():
            self.send_header(key, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def grader(monkeypatch):
    Grader.hits, Grader.seen, Grader.live = [], {}, [0, 0]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Grader)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("GRADER_KEY", "sesame")
    monkeypatch.setattr(ChatEndpoint, "backoff", 0.0)  # no waiting between retries
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def test_an_http_judge_retries_runs_concurrently_caches_and_counts(grader):
    judge = Judge("Many e's.", name="remote", endpoint=grader, model="grader", api_key_env="GRADER_KEY",
                  concurrency=4, retries=2, timeout=1)
    replies = ["eee", "e", "none", "every tree", "gibberish", "slow"]
    with pytest.warns(UserWarning, match="could not score 2 of 6"):
        result = score([judge], [1.0], ["p"] * 6, replies, [[]] * 6, [{"prompt": "p"}] * 6)
    assert result.totals == [0.3, 0.1, 0.1, 0.4, 0.0, 0.0] and result.errors == {"remote": 2}
    assert Grader.live[1] > 1  # requests overlapped
    metrics = J.step_metrics()
    assert metrics["judge/remote/calls"] == 6 and metrics["judge/remote/errors"] == 2
    assert metrics["judge/remote/tokens"] == 5 * 105  # usage of the answered ones (the malformed reply's too)
    asked = len(Grader.hits)
    assert judge(["p"] * 4, replies[:4]) == [0.3, 0.1, 0.1, 0.4] and len(Grader.hits) == asked  # all cached


def test_an_http_judge_with_a_refused_key_stops_the_run_named(grader, monkeypatch):
    monkeypatch.setenv("GRADER_KEY", "wrong")
    judge = Judge("x", name="remote", endpoint=grader, model="grader", api_key_env="GRADER_KEY")
    with pytest.raises(J.JudgeUnavailable, match=r"answered 401.*\$GRADER_KEY"):
        score([judge], [1.0], ["p"], ["c"], [[]], [{"prompt": "p"}])
    with pytest.raises(ValueError, match="needs the model name"):
        Judge("x", endpoint=grader)


@pytest.fixture(scope="module")
def reward_model_folder(tmp_path_factory, tiny_model_path):
    """A sequence classifier made from the offline tiny model (its score head freshly initialised)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = tmp_path_factory.mktemp("rm") / "tiny-reward-model"
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(folder)
    return folder


def test_a_reward_model_from_a_folder_scores_each_completion(reward_model_folder):
    from minigrpo.judge.rubric import RewardModel

    rm = RewardModel(str(reward_model_folder), batch_size=2)
    scores = rm(["Say hi."] * 3, ["Hello there!", "Go away.", "Hello there!"])
    assert rm.__name__ == "tiny_reward_model" and len(scores) == 3
    assert scores[0] == pytest.approx(scores[2], abs=1e-4) and scores[0] != scores[1]


def test_each_judge_kind_trains_end_to_end(tmp_path, grader, reward_model_folder):
    """One step of the tiny model with three judge rewards at once: itself in memory, the HTTP grader and
    the reward model; then `minigrpo eval` and `check-reward` with them."""
    from typer.testing import CliRunner

    from minigrpo.cli.app import app

    (tmp_path / "judges.py").write_text(
        "from minigrpo.judge.rubric import Judge, RewardModel\n"
        "polite = Judge('Polite and short: 10. Rude: 0.', name='polite', max_tokens=12)\n"
        f"remote = Judge('Many e letters.', name='remote', endpoint={grader!r}, model='grader', "
        "api_key_env='GRADER_KEY')\n"
        f"rm = RewardModel({str(reward_model_folder)!r}, name='rm')\n")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"Greet {n} politely."}) + "\n"
                                                 for n in ["Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Hal", "Ivy", "Jo"]))
    rewards = [arg for name in ("polite", "remote", "rm") for arg in ("--reward", f"{tmp_path / 'judges.py'}:{name}")]
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", "--task", str(tmp_path / "data.jsonl"), *rewards, "--steps", "1",
                                      "-G", "2", "--prompts-per-step", "2", "--max-new-tokens", "12",
                                      "--no-eval-before-after", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics["judge/polite/calls"] == 4 and metrics["judge/polite/tokens"] > 0
    assert metrics["judge/remote/calls"] == 4 and metrics["judge/remote/tokens"] > 0
    assert all(f"reward/{name}/mean" in metrics for name in ("polite", "remote", "rm"))
    logged = [json.loads(line) for line in (out / "judge.jsonl").read_text().splitlines()]
    assert {r["judge"] for r in logged} == {"polite", "remote"} and len(logged) == 8
    assert all("Polite and short" in r["asked"] for r in logged if r["judge"] == "polite")
    evaluated = CliRunner().invoke(app, ["eval", "--task", str(tmp_path / "data.jsonl"), *rewards, "--adapter",
                                         str(out / "adapter"), "--prompts", "2", "--samples", "2"])
    assert evaluated.exit_code == 0 and "pass@1" in evaluated.output, evaluated.output
    checked = CliRunner().invoke(app, ["check-reward", "--task", str(tmp_path / "data.jsonl"), *rewards,
                                       "--prompts", "2", "--samples", "2", "--max-new-tokens", "12"])
    assert checked.exit_code == 0 and "checked on sampled completions only" in checked.output, checked.output
    assert "remote" in checked.output and "groups with reward spread" in checked.output


def test_the_haiku_task_is_judged_by_the_base_model(tmp_path):
    from minigrpo import TrainConfig, train
    from minigrpo.check import precheck_rewards
    from minigrpo.tasks import get_task

    task = get_task("haiku")
    assert task.rewards[0].__name__ == "haiku_judge" and precheck_rewards(task, []) == []
    assert set(r["prompt"] for r in task.make_data("test", 0)).isdisjoint(r["prompt"] for r in task.make_data("train", 0))
    with pytest.raises(J.JudgeUnavailable):
        task.rewards[0](["Write a haiku about fog."], ["Grey fog on the hill\nthe bus lights fade one by one\nthen only the sound"])
    # reward_timeout: the judge generates inside the reward's time limit, which a busy 2-core machine can pass;
    # the fallback then asks again one completion at a time, and the counts below would double
    run = train(TrainConfig(task="haiku", steps=1, num_generations=2, prompts_per_step=2, max_new_tokens=24,
                            eval_before_after=False, sample_every=0, output_dir=str(tmp_path / "run"),
                            reward_timeout=300))
    (metrics,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "reward/haiku_judge/mean" in metrics
    # every completion was gated (not three short lines), or asked, or found in the cache
    assert sum(metrics.get(f"judge/haiku_judge/{key}", 0) for key in ("gated", "calls", "cached")) == 4


class Stuck(BaseHTTPRequestHandler):
    """Accepts every request and never answers (until the test ends); or, under /v1/limited, answers 429 with
    the Retry-After the server was given (and under /v1/interrupt, then sends this process a real Ctrl-C, so it
    arrives while the judge waits). Counts the requests."""
    release = threading.Event()
    retry_after = "3600"
    hits: list = []

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        Stuck.hits.append(self.path)
        if self.path.startswith(("/v1/limited", "/v1/interrupt")):
            payload = b"{}"
            self.send_response(429)
            self.send_header("Retry-After", Stuck.retry_after)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            if self.path.startswith("/v1/interrupt"):
                import signal

                # to the main thread, as a terminal's Ctrl-C reaches a process whose main thread is waiting: a
                # process-wide kill may land on this server thread, and the main thread's wait is not interrupted
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            return
        Stuck.release.wait()

    def log_message(self, *args):
        pass


@pytest.fixture
def stuck():
    Stuck.release.clear()
    Stuck.hits = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stuck)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    Stuck.release.set()
    server.shutdown()


def test_a_judge_that_never_answers_costs_no_more_than_the_reward_time_limit(stuck):
    judge = Judge("x", name="hung", endpoint=f"{stuck}/v1", model="m")  # the defaults: 60 s, 3 retries
    n, per_completion = 4, 1.0
    start = time.monotonic()
    with pytest.warns(UserWarning, match="could not score 4 of 4.*no answer within the reward's time limit"):
        result = score([judge], [1.0], ["p"] * n, ["a", "b", "c", "d"], [[]] * n, [{"prompt": "p"}] * n,
                       timeout=per_completion)
    assert result.totals == [0.0] * n and result.errors == {"hung": n}
    # the judge gave up at the call's deadline: each completion asked at most once, and not asked again one by
    # one after a timed-out call (as before, when a 2 s limit took 25.5 s); the time is a loose guard only
    assert len(Stuck.hits) <= n, Stuck.hits
    assert time.monotonic() - start < n * per_completion + 20


@pytest.mark.parametrize("header", ["3600", "Wed, 21 Oct 2099 07:28:00 GMT"])
def test_a_long_retry_after_is_cut_to_the_deadline(stuck, header, monkeypatch):
    monkeypatch.setattr(Stuck, "retry_after", header)
    judge = Judge("x", name="limited", endpoint=f"{stuck}/v1/limited", model="m")
    start = time.monotonic()
    with pytest.warns(UserWarning, match="could not score 2 of 2.*429"):
        result = score([judge], [1.0], ["p"] * 2, ["a", "b"], [[]] * 2, [{"prompt": "p"}] * 2, timeout=1.0)
    # parsed (an HTTP date raised ValueError before), and not waited out: no retry fits before the deadline
    assert result.totals == [0.0, 0.0] and len(Stuck.hits) == 2
    assert time.monotonic() - start < 30


def test_ctrl_c_reaches_through_a_judge_waiting_out_retry_after(stuck):
    import signal

    judge = Judge("x", name="limited", endpoint=f"{stuck}/v1/interrupt", model="m")  # no deadline: waits 60 s
    # Ctrl-C as an interactive process has it: a process started in the background by a shell inherits SIGINT
    # ignored, and then no Ctrl-C reaches anything
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            judge(["p"], ["a"])  # the server sends the Ctrl-C once it has answered 429
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - start < 50


def test_an_endpoint_that_cannot_be_reached_stops_before_training(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for endpoint, says in ((f"http://127.0.0.1:{port}/v1", "Connection refused"),
                           ("http://judge.invalid/v1", "did not answer")):
        with pytest.raises(J.JudgeUnavailable, match=f"judge far: {endpoint} did not answer.*{says}|{says}"):
            Judge("x", name="far", endpoint=endpoint, model="m").preflight()
    # and through the command line, before any model loads or folder is made
    from typer.testing import CliRunner

    from minigrpo.cli.app import app

    (tmp_path / "grade.py").write_text(f"from minigrpo.judge.rubric import Judge\n"
                                       f"far = Judge('Polite: 10.', name='far', endpoint='http://127.0.0.1:{port}/v1', model='m')\n")
    result = CliRunner().invoke(app, ["train", "--reward", f"{tmp_path / 'grade.py'}:far",
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code == 1 and "judge far" in result.output and "did not answer" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "run").exists()


def test_rubrics_that_cannot_work_are_refused(grader):
    with pytest.raises(ValueError, match="judge empty has an empty rubric"):
        Judge("  \n", name="empty")
    with pytest.raises(ValueError, match="rubric is 1,000,000 characters"):
        Judge("x" * 1_000_000, name="huge")
    long = Judge("Be kind. " * 800, name="long", endpoint=grader, model="grader", api_key_env="GRADER_KEY")
    with pytest.raises(J.JudgeUnavailable, match="leave no room for the reply in grader's context of 2,048 tokens"):
        long.preflight()
    Judge("Be kind.", name="fits", endpoint=grader, model="grader", api_key_env="GRADER_KEY").preflight()
