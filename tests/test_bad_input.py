"""Mistakes a hobbyist makes, and what each gets: one line naming the cause and the fix, a non-zero exit,
and nothing of theirs lost or overwritten. Reward code is the user's: what it does wrong is scored and named.
(docs/reliability.md lists these.)"""

import http.server
import json
import os
import re
import signal
import threading
import time
import warnings

import numpy as np
import pytest
from typer.testing import CliRunner

from minigrpo import TrainConfig, per_sample
from minigrpo.checkpoint import truncate_logs
from minigrpo.cli.app import app
from minigrpo.console import Display
from minigrpo.run import RunFolder, results_folder
from minigrpo.scoring import RewardError, score
from minigrpo.data import read_rows
from minigrpo.tasks import get_task

ROWS = [{"prompt": "p1", "answer": "a"}, {"prompt": "p2", "answer": "b"}]
FAST = ["-G", "2", "--prompts-per-step", "2", "--max-new-tokens", "8", "--no-eval-before-after"]


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "400"})  # long paths on one line
    return result.exit_code, result.output


def one_line_error(code, output, *expected):
    assert code != 0, output
    assert "Traceback" not in output, output
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())
    for text in expected:
        assert text in flat, output


def write(path, text):
    path.write_text(text)
    return path


def a_reward(folder) -> str:
    write(folder / "r.py", "def r(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    return f"{folder / 'r.py'}:r"


# --- reward code is the user's: whatever it does is scored and named ---------------------------------------

def test_exiting_or_interrupting_reward_code_is_a_reward_error():
    def exits(prompts, completions, **kw):
        raise SystemExit(0)

    def interrupts(prompts, completions, **kw):
        raise KeyboardInterrupt

    for fn, what in ((exits, "called sys.exit(0)"), (interrupts, "raised KeyboardInterrupt")):
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            s = score([fn], [1.0], ["p1", "p2"], ["a", "b"], [[], []], ROWS)
        assert s.totals == [0.0, 0.0] and s.errors == {fn.__name__: 2}
        with pytest.raises(RewardError, match=re.escape(what)):
            score([fn], [1.0], ["p1", "p2"], ["a", "b"], [[], []], ROWS, strict=True)


def test_a_real_ctrl_c_during_a_reward_still_interrupts():
    # Python's own Ctrl-C handler, as in a terminal (a shell's background job starts with SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def slow(prompts, completions, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        return [1.0] * len(completions)

    try:
        with pytest.raises(KeyboardInterrupt):
            score([slow], [1.0], ["p1", "p2"], ["a", "b"], [[], []], ROWS)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_rewards_get_copies_of_what_they_are_given():
    def vandal(prompts, completions, answer, **kw):
        completions[0] = "rewritten"
        answer.clear()
        return [1.0] * len(prompts)

    completions, rows = ["a", "b"], [dict(r) for r in ROWS]
    score([vandal], [1.0], ["p1", "p2"], completions, [[], []], rows)
    assert completions == ["a", "b"] and rows == ROWS


@pytest.mark.parametrize("body", ["time.sleep(60)", "while True:\n        pass"])
def test_a_reward_that_hangs_is_stopped_and_named(body):
    namespace = {}
    exec(f"import time\ndef hangs(prompts, completions, **kw):\n    {body}\n", namespace)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = score([namespace["hangs"]], [1.0], ["p1"], ["a"], [[]], ROWS[:1], timeout=0.2)
    assert s.totals == [0.0] and s.errors == {"hangs": 1} and time.perf_counter() - start < 3
    assert "hangs ran past its time limit" in str(caught[0].message)
    with pytest.raises(RewardError, match="hangs ran past its time limit"):
        score([namespace["hangs"]], [1.0], ["p1"], ["a"], [[]], ROWS[:1], strict=True, timeout=0.2)


def test_any_real_number_type_is_a_score_and_nan_is_not():
    def numpyish(prompts, completions, **kw):
        return [np.float32(0.5), np.bool_(True)]

    assert score([numpyish], [1.0], ["p1", "p2"], ["a", "b"], [[], []], ROWS).totals == [0.5, 1.0]

    def nan(prompts, completions, **kw):
        return [np.float64("nan"), 1]

    with pytest.raises(RewardError, match="finite number"):
        score([nan], [1.0], ["p1", "p2"], ["a", "b"], [[], []], ROWS)


def test_two_rewards_with_one_name_are_logged_apart(tmp_path):
    write(tmp_path / "a.py", "def reward(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    write(tmp_path / "b.py", "def reward(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.warns(UserWarning, match="two reward functions are named reward"):
        task = get_task("addition", [f"{tmp_path / 'a.py'}:reward", f"{tmp_path / 'b.py'}:reward"])
    assert task.reward_names[1:] == ["reward", "reward_2"]
    s = score(task.rewards[1:], [1.0, 1.0], ["p1"], ["a"], [[]], [{"prompt": "p1", "answer": 1}])
    assert s.values == {"reward": [1.0], "reward_2": [0.0]}


def test_a_per_sample_reward_without_the_decorator_is_told_to_add_it():
    def short(completion: str, **example) -> float:
        return float(len(completion) < 5)

    with pytest.raises(RewardError, match=r"decorate it with @per_sample"):
        score([short], [1.0], ["p1"], ["a"], [[]], ROWS[:1])
    assert score([per_sample(short)], [1.0], ["p1"], ["a"], [[]], ROWS[:1]).totals == [1.0]


def test_the_precheck_warns_on_stand_ins_but_holds_worked_examples_strictly():
    from minigrpo.tasks import Task
    from minigrpo.check import precheck_rewards

    def picky(prompts, completions, **kw):
        return [1.0 / len(c) for c in completions]  # raises on the empty stand-in

    rows = [{"prompt": "p"}]
    notes = precheck_rewards(Task("t", "", lambda s, seed: rows, [picky]), rows)
    assert len(notes) == 1 and "picky raised ZeroDivisionError" in notes[0]
    with pytest.raises(RewardError, match="picky raised ZeroDivisionError"):
        precheck_rewards(Task("t", "", lambda s, seed: rows, [picky], examples=[{"prompt": "p", "completion": ""}]),
                         rows)


def test_none_shows_as_not_applicable_on_screen(capsys):
    display = Display(1)
    display.sample(1, {"prompt": "p", "completion": "c", "reward": 0.0, "advantage": 0.0,
                       "reward_parts": {"applies": 1.0, "not_applicable": None}})
    assert "not_applicable n/a" in capsys.readouterr().out


# --- settings ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value, says", [("--learning-rate", "inf", "must be a finite number"),
                                               ("--beta", "nan", "greater than or equal to 0"),  # its bound's check
                                               ("--reward-weight", "nan", "must be a finite number"),
                                               ("--temperature", "inf", "must be a finite number")])
def test_non_finite_numbers_are_refused(flag, value, says):
    one_line_error(*cli("train", flag, value), says, flag)


@pytest.mark.parametrize("flags", [("--dtype", "bfloat16"), ("--4bit",)])
def test_bf16_projections_go_with_a_float32_model_only(flags):
    one_line_error(*cli("train", "--bf16-base", *flags), "it goes with --dtype float32", "--no-4bit")


def test_a_model_name_typo_suggests_the_preset_and_leaves_no_folder(tmp_path):
    one_line_error(*cli("train", "--model", "qwen-1.5bb", "--out", tmp_path / "run"), "did you mean qwen-1.5b")
    assert not (tmp_path / "run").exists()


def test_a_model_out_of_reach_stops_the_run_before_its_folder(tmp_path):
    one_line_error(*cli("train", "--model", "someone/not-downloaded", "--out", tmp_path / "run"),
                   "cannot load someone/not-downloaded: HF_HUB_OFFLINE=1 and it is not in the local cache")
    assert not (tmp_path / "run").exists()
    one_line_error(*cli("eval", "--task", "addition", "--model", "someone/not-downloaded"), "not in the local cache")
    one_line_error(*cli("plan", "--model", "someone/not-downloaded"), "not in the local cache")


class Hub(http.server.BaseHTTPRequestHandler):
    """A model hub on 127.0.0.1 that answers every request with the status and error code it is set to."""

    def do_GET(self):
        status, code = self.server.answer
        body = json.dumps({"error": code}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_each_answer_of_the_hub_is_named_with_what_to_do(monkeypatch):
    from huggingface_hub import constants

    from minigrpo import weights as model

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setattr(model, "HUB_PATIENCE_S", 2.0)
    said = {}
    for status, code in ((404, "RepoNotFound"), (403, "GatedRepo"), (500, "")):
        server.answer = (status, code)
        said[status] = model.hub_problem("someone/model")
    server.shutdown()  # still listening, never answering
    said["silent"] = model.hub_problem("someone/model")
    server.server_close()
    said["closed"] = model.hub_problem("someone/model")
    assert "has no such model" in said[404] and "minigrpo models" in said[404]
    assert "gated" in said[403] and "hf auth login" in said[403]
    assert "500 Internal Server Error" in said[500]
    assert "did not answer within 2 s" in said["silent"]
    assert "Connection refused" in said["closed"] and "--model" in said["closed"]
    with pytest.raises(ValueError, match="cannot load someone/model: the model hub could not"):
        model.resolve_weights("someone/model")


def test_resume_takes_the_same_options_and_names_those_that_differ(tmp_path):
    TrainConfig(output_dir=str(tmp_path), beta=0.1, rewards=["r.py:r"]).save(tmp_path / "config.json")
    code, output = cli("train", "--resume", tmp_path, "--model", "qwen-1.5b", "--beta", "0.1", "--reward", "r.py:r")
    one_line_error(code, output, "only --steps can change: --model is 'smollm2-135m' in the run, 'qwen-1.5b' here")
    assert "--beta" not in output and "--reward" not in output
    # the command that started it, with --resume appended, passes that check (and goes on to load the task;
    # its reward file is gone here, which is what stops it)
    code, output = cli("train", "--resume", tmp_path, "--model", "smollm2-135m", "--beta", "0.1", "--reward", "r.py:r",
                       "--out", tmp_path)
    one_line_error(code, output, "no such file: r.py")
    assert "only --steps can change" not in output


def test_lengths_beyond_the_model_are_refused_before_it_loads(tmp_path):
    one_line_error(*cli("train", "--max-new-tokens", "100000", "--out", tmp_path / "run"),
                   "more than smollm2-135m's context of")
    data = write(tmp_path / "long.jsonl", '{"prompt": "short"}\n\n{"prompt": "' + "word " * 900 + '"}\n')
    one_line_error(*cli("train", "--task", data, "--reward", a_reward(tmp_path), "--out", tmp_path / "run"),
                   f"{data}, line 3: the prompt is", "--max-prompt-tokens 512")
    assert not (tmp_path / "run").exists()


# --- folders: nothing of the user's is overwritten ----------------------------------------------------------

def test_a_folder_that_is_not_this_runs_is_never_written(tmp_path):
    theirs = tmp_path / "mine"
    theirs.mkdir()
    write(theirs / "config.json", "my own config")
    one_line_error(*cli("train", "--out", theirs), "already holds a run", "nothing was written")
    assert (theirs / "config.json").read_text() == "my own config"
    write(theirs / "notes.txt", "x")
    (theirs / "config.json").unlink()
    one_line_error(*cli("train", "--out", theirs), "is not empty")
    one_line_error(*cli("train", "--out", theirs / "notes.txt"), "is a file")
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt"]


def test_results_folders_are_made_before_the_work_and_never_someone_elses(tmp_path):
    assert results_folder(tmp_path / "new" / "evals", "--out").is_dir()
    write(tmp_path / "full.txt", "x")
    with pytest.raises(ValueError, match="is not empty and not a run folder"):
        results_folder(tmp_path, "--out")
    with pytest.raises(ValueError, match="is a file"):
        results_folder(tmp_path / "full.txt", "--out")
    one_line_error(*cli("eval", "--task", "addition", "--out", tmp_path), "is not empty and not a run folder")


def test_claiming_a_run_folder_writes_nothing(tmp_path):
    cfg = TrainConfig(output_dir=str(tmp_path / "run"))
    run = RunFolder.claim(cfg)
    assert not run.path.exists()
    run.start(cfg)
    assert (run.path / "config.json").exists()


# --- data ----------------------------------------------------------------------------------------------------

def test_jsonl_splits_on_newlines_only(tmp_path):
    data = write(tmp_path / "d.jsonl", json.dumps({"prompt": "a\u2028b\u0085c"}, ensure_ascii=False) + "\n"
                 + '{"prompt": "ok"}\n' + '{"prompt": 5}\n')
    with pytest.raises(ValueError, match=r"d.jsonl, line 3: 'prompt' is int 5"):
        read_rows(data)
    write(data, data.read_text().rsplit("\n", 2)[0] + "\n")
    assert read_rows(data)[0]["prompt"] == "a\u2028b\u0085c"


@pytest.mark.parametrize("line, expected", [
    ('{"prompt": 5}', "'prompt' is int 5"),
    ("null", "a row must be an object"),
    ('{"prompt": {"text": "hi"}}', "'prompt' is dict"),
    ('{"prompt": [{"role": "user"}]}', "'prompt' is list"),
    ('{"question": "hi"}', "no 'prompt' column"),
])
def test_rows_of_the_wrong_type_are_named(tmp_path, line, expected):
    data = write(tmp_path / "d.jsonl", '{"prompt": "fine"}\n' + line + "\n")
    one_line_error(*cli("check-reward", "--task", data, "--reward", a_reward(tmp_path), "--no-model"),
                   f"d.jsonl, line 2: {expected}")


def test_encodings(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("utf-8-sig"))  # a byte-order mark is fine
    assert read_rows(data)[0]["prompt"] == "caf\u00e9"
    data.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="line 2: not UTF-8"):
        read_rows(data)


def test_a_half_written_last_log_line_is_dropped_and_a_bad_middle_line_named(tmp_path):
    write(tmp_path / "metrics.jsonl", '{"step": 1}\n{"step": 2}\n{"step": 3, "loss"')
    said = []
    truncate_logs(tmp_path, 2, said.append)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n' and "half-written" in said[0]
    write(tmp_path / "samples.jsonl", '{"step": 1}\n{"st\n{"step": 2}\n')
    with pytest.raises(ValueError, match="samples.jsonl, line 2: not valid JSON"):
        truncate_logs(tmp_path, 2, said.append)


# --- one-line errors instead of tracebacks ---------------------------------------------------------------------

def test_user_mistakes_get_one_line(tmp_path):
    write(tmp_path / "syntax.py", "def r(prompts, completions, **kw):\n    return [1.0] * len(completions\n")
    write(tmp_path / "imports.py", "import os\nimport no_such_module_here\n")
    write(tmp_path / "values.py", "r = 3\n")
    (tmp_path / "folder.jsonl").mkdir()
    cases = [
        (["train", "--task", tmp_path / "folder.jsonl", "--reward", a_reward(tmp_path)], "is a folder"),
        (["train", "--reward", f"{tmp_path / 'values.py'}:r"], "int is not a function"),
        (["train", "--reward", f"{tmp_path / 'syntax.py'}:r"], "syntax.py, line 2"),
        (["train", "--reward", f"{tmp_path / 'imports.py'}:r"], "imports.py, line 2: ModuleNotFoundError"),
        (["sample", "hi", "--adapter", tmp_path / "nope"], "is not a trained adapter"),
        (["plot", tmp_path / "nope"], "is not a run folder"),
        (["check-reward", "--task", "no_such_task"], "unknown task"),
        (["check-reward", "--task", "addition", "--reward", "rewards.nothing:r"], "cannot import rewards.nothing"),
        (["export", tmp_path / "nope", "--out", tmp_path / "x"], "is not a trained adapter"),
    ]
    for args, expected in cases:
        one_line_error(*cli(*args), expected)


def test_check_reward_without_examples_says_so_and_probes_stand_ins(tmp_path):
    data = write(tmp_path / "d.jsonl", '{"prompt": "hello"}\n')
    write(tmp_path / "r.py", "def picky(prompts, completions, **kw):\n    return [1 / len(c) for c in completions]\n")
    code, output = cli("check-reward", "--task", data, "--reward", f"{tmp_path / 'r.py'}:picky", "--no-model")
    flat = " ".join(output.split())
    assert code == 0 and "has no worked examples" in flat and "stand-in completions" in flat
    assert "raised on 1 of 2 completions" in flat


# --- a whole run with a reward that never applies, a damaged log and a damaged checkpoint ---------------------

def test_a_run_survives_none_rewards_and_resumes_past_damage(tmp_path):
    write(tmp_path / "none.py", "def never(prompts, completions, **kw):\n    return [None] * len(completions)\n")
    run = tmp_path / "run"
    code, output = cli("train", "--steps", 2, *FAST, "--reward", f"{tmp_path / 'none.py'}:never", "--sample-every", 1,
                       "--save-every", 1, "--out", run)
    assert code == 0, output
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    with open(run / "samples.jsonl", "a") as f:
        f.write('{"step": 3, "prompt": "cut sh')  # killed mid-write
    state = run / "checkpoints" / "step-000002" / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])  # a damaged latest checkpoint
    code, output = cli("train", "--resume", run, "--steps", 3)
    flat = " ".join(output.split())
    assert code == 0, output
    assert "step-000002 cannot be read" in flat and "resumed from" in flat and "step-000001" in flat
    assert "half-written" in flat
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_small_data_file_trains_and_says_the_before_after_was_skipped(tmp_path):
    data = write(tmp_path / "ok.jsonl", '{"prompt": "Say hi."}\n{"prompt": "Say yes."}\n{"prompt": "Say no."}\n')
    small = ["-G", "2", "--prompts-per-step", "2", "--max-new-tokens", "8"]
    code, output = cli("train", "--task", data, "--reward", a_reward(tmp_path), "--steps", "1", *small,
                       "--out", tmp_path / "run")
    assert code == 0, output
    assert "task ok has no held-out rows, so the before/after evaluation is skipped; for it, give --eval-data" in output
    one_line_error(*cli("train", "--task", data, "--reward", a_reward(tmp_path), "--eval-every", "1",
                        "--out", tmp_path / "run2"), "--eval-every 1: task ok has no held-out rows")
    one_line_error(*cli("train", "--task", data, "--reward", a_reward(tmp_path), "--eval-data", tmp_path / "nope.jsonl",
                        "--out", tmp_path / "run2"), "nope.jsonl: no such file")
    held_out = write(tmp_path / "held.jsonl", '{"prompt": "Say maybe."}\n{"prompt": "Say no."}\n')
    code, output = cli("train", "--task", data, "--reward", a_reward(tmp_path), "--eval-data", held_out, "--steps",
                       "1", *small, "--out", tmp_path / "run3")
    assert code == 0 and "1 of the 2 held-out prompts are also training prompts" in output, output
    assert f"held-out, 2 prompts of {held_out}: pass@1" in output


def test_a_rewards_own_alarm_does_not_reset_the_time_limit():
    # math_verify and TRL's own examples time themselves with signal.alarm, and clear it when done
    def own_alarm(prompts, completions, **kw):
        signal.signal(signal.SIGALRM, lambda *args: None)
        signal.alarm(30)
        signal.alarm(0)
        time.sleep(300)
        return [1.0] * len(completions)

    start = time.monotonic()
    with pytest.warns(UserWarning, match="ran past its time limit"):
        result = score([own_alarm], [1.0], ["p"], ["c"], [[]], [{"prompt": "p"}], timeout=1.0)
    assert result.totals == [0.0] and time.monotonic() - start < 120  # stopped, not slept out (loose on purpose)


def test_the_misleading_lines_of_eval_and_sft_now_name_the_cause(tmp_path):
    """eval --prompts 0 said "no held-out rows"; eval of a run that stopped before its end said it was no adapter;
    sft --out a run folder said it was "not a run folder"; an sft `messages` row of strings was a traceback."""
    from typer.testing import CliRunner

    from minigrpo.cli.app import app

    run = tmp_path / "run"
    (run / "checkpoints" / "step-000002" / "adapter").mkdir(parents=True)
    (run / "checkpoints" / "step-000002" / "adapter" / "adapter_config.json").write_text("{}")
    (run / "config.json").write_text("{}")
    rows, good = tmp_path / "rows.jsonl", tmp_path / "good.jsonl"
    rows.write_text(json.dumps({"messages": ["hello", {"role": "assistant", "content": "hi"}]}) + "\n")
    good.write_text(json.dumps({"prompt": "What is 1 + 1?", "completion": "2"}) + "\n")
    long = tmp_path / "long.jsonl"  # sft sized itself for GRPO's lengths: one such example grew to 20 GB, killed
    long.write_text(json.dumps({"prompt": "Write.", "completion": "word " * 9000}) + "\n")
    for argv, says in [(["eval", "--task", "addition", "--prompts", "0"], "--prompts 0: give at least 1"),
                       (["eval", "--task", "addition", "--adapter", str(run)],
                        "is a run with no final adapter (it stopped before its end): its last checkpoint's is"),
                       (["sft", "--task", str(good), "--out", str(run)], "is a training run's folder; give a new folder"),
                       (["sft", "--task", str(rows), "--out", str(tmp_path / "new")],
                        "each item of `messages` must be a message"),
                       (["sft", "--task", str(long), "--out", str(tmp_path / "new")],
                        "example 1: 9034 tokens, more than smollm2-135m's context of 8192")]:
        result = CliRunner().invoke(app, argv)
        said = " ".join(result.output.split())
        assert result.exit_code == 1 and says in said and "Traceback" not in said, (argv, result.output)
