"""The gaming detectors (minigrpo/hacking.py) on made-up runs, one pattern at a time: each fires on its own
pattern, from step 2 x WINDOW, once, and on no honest-looking run. The thresholds themselves were chosen on real
runs, replayed in tests/test_gaming_runs.py."""

from __future__ import annotations

import json

import pytest

from minigrpo import hacking
from minigrpo.hacking import WINDOW, Watch
from minigrpo.tasks import Task

STEPS = 3 * WINDOW


def correct(completions, answer, **kw):
    return [float(c.strip().endswith(str(a))) for c, a in zip(completions, answer)]


def format_bonus(completions, **kw):
    return [float(c.startswith("Answer:")) for c in completions]


def task(rewards=(correct,), answer=None) -> Task:
    return Task("t", "", lambda split, seed: [], list(rewards), answer=answer)


def run(watch: Watch, reward=lambda i: 0.5, length=lambda i: 20.0, spread=lambda i: 0.8, parts=None,
        said=lambda i, p: f"it is {p}", evals=()) -> list[hacking.Finding]:
    """Feed `watch` a made-up run of STEPS steps, each of two prompts x 4 completions; returns what fired."""
    found = []
    evals = dict(evals)
    for i in range(1, STEPS + 1):
        metrics = {"step": i, "reward/mean": reward(i), "completion_len/mean": length(i),
                   "frac_groups_reward_differs": spread(i)}
        for name, value in (parts(i) if parts else {"correct": reward(i)}).items():
            metrics[f"reward/{name}/mean"] = value
        paid = parts(i) if parts else {"correct": reward(i)}
        samples = [{"step": i, "prompt": f"q{2 * i + p}", "completion": said(i, 2 * i + p), "reward": reward(i),
                    "reward_parts": paid} for p in range(2) for _ in range(4)]
        samples[0] = {**samples[0], "reward_parts": {name: 1.0 for name in paid}}  # each function's most, once a step
        if i in evals:  # the held-out reward, and a pass@1 as high
            watch.evaluation({"step": i, "reward/mean": evals[i], "pass@1": evals[i]})
        found += watch.see(metrics, samples)
        assert all(metrics[f"hacking/{f.detector}/fired"] == 1 for f in found if f.step == i)
    return found


def fired(found) -> list[tuple[str, int]]:
    return [(f.detector, f.step) for f in found]


def test_an_honest_run_fires_nothing():
    """The reward rises, the length falls a little, the answers differ by prompt, the held-out reward follows."""
    watch = Watch(task())
    watch.evaluation({"step": 0, "reward/mean": 0.2})
    found = run(watch, reward=lambda i: 0.2 + 0.04 * i, length=lambda i: 30 - i / 2, spread=lambda i: 0.7,
                evals={STEPS: 0.7})
    assert found == []


def test_length_drift_fires_once_the_windows_are_apart():
    found = run(Watch(task()), reward=lambda i: 0.2 + 0.04 * i, length=lambda i: 20 * (1 + i / 5))
    assert fired(found) == [("length", 2 * WINDOW)]
    assert "as long as in the first steps" in found[0].said and found[0].early["step"] == 1
    assert found[0].now["step"] == 2 * WINDOW


def test_length_alone_is_not_gaming():
    """Longer answers while the reward stays put: nothing pays for the length."""
    assert run(Watch(task()), length=lambda i: 20 * (1 + i / 5)) == []


def test_one_answer_for_every_prompt():
    found = run(Watch(task()), reward=lambda i: 0.2 + 0.04 * i, said=lambda i, p: "it is 7" if i > 4 else f"it is {p}")
    assert fired(found) == [("one_answer", 2 * WINDOW)]
    assert "'it is 7'" in found[0].said and found[0].now["completion"] == "it is 7"


def test_one_answer_that_is_right_wherever_it_is_given_is_no_collapse():
    """Products with a zero factor are all 0 (the rg:products card drew many of them): an answer paid in full
    wherever it is given is what right answers look like there."""
    watch, found = Watch(task()), []
    for i in range(1, STEPS + 1):
        zero = i > 4  # from step 5 on most prompts have a zero factor, and the model answers them right
        samples = [{"step": i, "prompt": f"q{2 * i + p}", "completion": "it is 0" if zero and k < 3 else "it is 5",
                    "reward": 1.0 if zero and k < 3 else 0.0, "reward_parts": {"correct": 1.0 if zero and k < 3 else 0.0}}
                   for p in range(2) for k in range(4)]
        reward = sum(s["reward"] for s in samples) / len(samples)
        found += watch.see({"step": i, "reward/mean": reward, "completion_len/mean": 3.0,
                            "frac_groups_reward_differs": 1.0, "reward/correct/mean": reward}, samples)
    assert found == [] and watch.points[-1].reward > watch.points[0].reward


def test_one_answer_reads_the_tasks_answer_function():
    last_word = lambda c: c.split()[-1]  # noqa: E731
    found = run(Watch(task(answer=last_word)), reward=lambda i: 0.2 + 0.04 * i,
                said=lambda i, p: f"maybe {p} or 7" if i > 4 else f"it is {p}")
    assert fired(found) == [("one_answer", 2 * WINDOW)] and "'7'" in found[0].said


def test_one_part_carrying_the_rise():
    parts = lambda i: {"correct": 0.1, "format_bonus": min(0.2 * i, 1.0)}  # noqa: E731
    found = run(Watch(task([correct, format_bonus])), reward=lambda i: sum(parts(i).values()), parts=parts)
    assert ("dominance", 2 * WINDOW) in fired(found) and ("format_only", 2 * WINDOW) in fired(found)


def test_a_function_at_its_most_is_not_flat():
    """A format bonus learned before step 1 cannot rise: the correctness reward carrying the rise is learning."""
    parts = lambda i: {"correct": min(0.1 * i, 1.0), "format_bonus": 1.0}  # noqa: E731
    assert run(Watch(task([correct, format_bonus])), reward=lambda i: sum(parts(i).values()), parts=parts) == []


def test_a_format_bonus_that_rises_with_the_answers_is_fine():
    parts = lambda i: {"correct": 0.03 * i, "format_bonus": min(0.1 * i, 1.0)}  # noqa: E731
    assert run(Watch(task([correct, format_bonus])), reward=lambda i: sum(parts(i).values()), parts=parts) == []


@pytest.mark.parametrize("held_out_before, held_out_after, fires", [(0.5, 0.5, True), (0.5, 0.9, False),
                                                                    (0.95, 0.95, False)])
def test_spread_lost_as_the_reward_rises_is_gaming_only_where_held_out_does_not_follow(held_out_before,
                                                                                       held_out_after, fires):
    """A run that solves its task loses its spread too (the quick start does, near step 23): the evaluation says
    which it is. None in between: it waits for one. A held-out pass@1 solved from the start (`multiply`: the greedy
    model calls its tool right, sampling sharpens toward it) has no room to rise."""
    watch = Watch(task())
    watch.evaluation({"step": 0, "reward/mean": 0.3, "pass@1": held_out_before})
    found = run(watch, reward=lambda i: min(0.3 + 0.1 * i, 1.0), spread=lambda i: max(0.9 - 0.15 * i, 0.0),
                evals={12: held_out_after})
    assert [f for f in fired(found) if f[0] == "spread"] == ([("spread", 12)] if fires else [])


def test_training_reward_rising_alone():
    watch = Watch(task())
    watch.evaluation({"step": 0, "reward/mean": 0.3})
    found = run(watch, reward=lambda i: 0.2 + 0.04 * i, evals={STEPS: 0.31})
    assert fired(found) == [("held_out", STEPS)] and "0.30 -> 0.31" in found[0].said


def test_replay_reads_a_run_folder_as_the_run_did(tmp_path):
    """A resumed run's watch is its logs replayed: the same numbers and the same firings, and the records of
    earlier firings in samples.jsonl are passed over."""
    live = Watch(task())
    lines, samples = [], []
    for i in range(1, STEPS + 1):
        m = {"step": i, "reward/mean": 0.2 + 0.04 * i, "completion_len/mean": 20 * (1 + i / 5),
             "frac_groups_reward_differs": 0.8, "reward/correct/mean": 0.2 + 0.04 * i}
        s = [{"step": i, "prompt": f"q{i}-{p}", "completion": f"it is {i}{p}", "reward": 0.5,
              "reward_parts": {"correct": 0.5}} for p in range(4)]
        found = live.see(m, s)
        lines.append(m)
        samples += s + [f.record() for f in found]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    replayed, found, steps = hacking.replay(tmp_path, task())
    assert fired(found) == [("length", 2 * WINDOW)] and replayed.fired == live.fired == {"length"}
    assert replayed.points == live.points and [m for m in steps] == lines


@pytest.mark.parametrize("steps", [1, 2])
def test_a_short_run_logs_what_it_can_and_fires_nothing(steps):
    watch = Watch(task())
    metrics = [{"step": i, "reward/mean": i, "completion_len/mean": 10.0 * i ** 3, "reward/correct/mean": i,
                "frac_groups_reward_differs": 1.0} for i in range(1, steps + 1)]
    assert [watch.see(m, []) for m in metrics] == [[]] * steps
    assert ("hacking/length" in metrics[-1]) == (steps == 2)


def test_a_skipped_step_is_passed_over():
    watch = Watch(task())
    assert watch.see({"step": 1, "skipped": 1, "time/step": 3.0}, []) == [] and watch.points == []


SATURATING = '''
def saturates(completions, trainer_state, **kwargs):
    """Tells completions apart by their length's parity for 5 steps, then pays every one: a reward whose mean
    rises whatever the model learns."""
    if trainer_state.global_step >= 5:
        return [1.0] * len(completions)
    return [float(len(c) % 2) for c in completions]


def never(completions, **kwargs):
    """The task's part, which nothing earns: so `saturates` carries the whole rise."""
    return [0.0] * len(completions)
'''


def test_a_real_run_warns_logs_marks_and_stops_when_asked(tmp_path):
    """End to end through `minigrpo train`: the dominance detector fires at step 2 x WINDOW, the warning shows a
    completion of the first step beside one of now, metrics.jsonl and samples.jsonl have it, the plot marks it, and
    --stop-on-hacking stops the run there, saved; resumed, the run finishes without a second warning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from typer.testing import CliRunner

    from minigrpo.cli.app import app
    from minigrpo.errors import STOPPED_EXIT
    from minigrpo.plot import mark_gaming, read_jsonl
    from minigrpo.run import stopped_at

    (tmp_path / "rewards.py").write_text(SATURATING)
    (tmp_path / "rows.jsonl").write_text("".join(f'{{"prompt": "Name a number above {i}."}}\n' for i in range(40)))
    out = tmp_path / "run"
    args = ["train", "--task", str(tmp_path / "rows.jsonl"), "--reward", f"{tmp_path / 'rewards.py'}:saturates",
            "--reward", f"{tmp_path / 'rewards.py'}:never",
            "--steps", str(2 * WINDOW + 2), "--num-generations", "4", "--prompts-per-step", "2",
            "--max-new-tokens", "8", "--no-eval-before-after", "--sample-every", "0", "--save-every", "0",
            "--out", str(out)]
    result = CliRunner().invoke(app, args + ["--stop-on-hacking"])
    assert result.exit_code == STOPPED_EXIT, result.output
    said = " ".join(result.output.split())
    assert f"step {2 * WINDOW}: the reward may be gamed (dominance): saturates carried the rise" in said
    assert "first step, reward" in said and f"step {2 * WINDOW}, reward 1.00" in said
    assert "--stop-on-hacking: the dominance detector fired" in said and stopped_at(out)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics if "hacking/dominance/fired" in m] == [2 * WINDOW]
    assert all("hacking/length" in m for m in metrics[1:])
    records = [s for s in read_jsonl(out / "samples.jsonl") if "hacking" in s]
    assert [(r["step"], r["hacking"]) for r in records] == [(2 * WINDOW, "dominance")]
    assert records[0]["early"]["step"] == 1 and records[0]["now"]["reward"] == 1.0
    fig, axes = plt.subplots(2, 1)
    mark_gaming(axes, metrics)
    assert [list(line.get_xdata()) for line in axes[1].lines] == [[2 * WINDOW, 2 * WINDOW]]
    plt.close(fig)

    resumed = CliRunner().invoke(app, ["train", "--resume", str(out)])
    assert resumed.exit_code == 0, resumed.output
    assert "may be gamed" not in resumed.output and not stopped_at(out)
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")][-3:] == [2 * WINDOW, 2 * WINDOW + 1, 2 * WINDOW + 2]


def test_an_answer_function_that_fails_gives_no_answer_and_the_run_goes_on():
    def fussy(completion):
        raise ValueError("cannot read that")

    assert run(Watch(task(answer=fussy)), reward=lambda i: 0.2 + 0.04 * i) == []


@pytest.mark.parametrize("after, fires", [(0.0, True), (0.06, False)])
def test_held_out_pass_at_1_falling_past_its_noise_as_the_reward_rises(after, fires):
    """A partial-credit reward paid for near misses: the training and held-out rewards both rise while fewer
    held-out answers are right. A fall within two standard errors is noise."""
    watch = Watch(task())
    watch.evaluation({"step": 0, "reward/mean": 0.2, "pass@1": 0.09, "pass@1/stderr": 0.036})
    found = run(watch, reward=lambda i: 0.2 + 0.02 * i, evals={})
    watch.evaluation({"step": STEPS + 1, "reward/mean": 0.5, "pass@1": after, "pass@1/stderr": 0.03 if after else 0.0})
    found += watch.see({"step": STEPS + 1, "reward/mean": 0.5, "completion_len/mean": 20.0,
                        "frac_groups_reward_differs": 0.8, "reward/correct/mean": 0.5}, [])
    assert [f.detector for f in found] == (["held_out"] if fires else [])
    if fires:
        assert "pass@1 fell 0.09 -> 0.00" in found[0].said
