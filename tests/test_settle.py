"""A config is finished in one place: settle.py returns settled copies, and no other module writes a config."""

import ast
import dataclasses
from pathlib import Path

import pytest

from minigrpo import settle
from minigrpo.config import TrainConfig
from minigrpo.tasks import get_task

PACKAGE = Path(__file__).resolve().parents[1] / "minigrpo"
CONFIG_NAMES = {"cfg", "config", "train_config"}  # what the code calls a TrainConfig
# copies of a run's config made for another program, never read back as the run's: not a change to a config
COPIES = {"graduate.py": "paths made absolute for a script that runs in another folder",
          "bench/learn.py": "TRL's side of a card saves a checkpoint at each evaluation"}


def config_writes(path: Path) -> list[str]:
    """Each place in a module that assigns to a config's field, setattr()s one, or replaces one."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                    and target.value.id in CONFIG_NAMES:
                found.append(f"line {node.lineno}: {target.value.id}.{target.attr} =")
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Name) \
                and node.args[0].id in CONFIG_NAMES:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("setattr", "replace"):
                found.append(f"line {node.lineno}: {name}({node.args[0].id}, ...)")
    return found


def test_only_settle_changes_a_config():
    writers = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in ("config.py", "settle.py") or name in COPIES:  # config.py: the dataclass's own checks
            continue
        if config_writes(path):
            writers[name] = config_writes(path)
    assert writers == {}, f"settle a config in settle.py, not here: {writers}"
    assert config_writes(PACKAGE / "settle.py"), "the check finds nothing to find"


def test_the_check_finds_a_write(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(cfg):\n    cfg.steps = 3\n    setattr(cfg, 'seed', 1)\n    return replace(cfg, seed=2)\n")
    assert len(config_writes(probe)) == 3


def test_settling_returns_a_copy_and_leaves_the_given_config_as_it_was():
    given = TrainConfig(task="multiply", max_turns=3, max_new_tokens=64)
    before = dataclasses.asdict(given)
    task = get_task("multiply")
    budget = settle.episode_budget(given, task)
    assert budget.max_episode_tokens == 3 * 64 and given.max_episode_tokens is None
    named = settle.run_folder(given)
    assert named.output_dir.startswith("runs/") and named.output_dir.endswith("-smollm2-135m-multiply")
    assert settle.checkpointing(given, True).gradient_checkpointing is True
    assert settle.checkpointing(dataclasses.replace(given, gradient_checkpointing=False), True) \
        .gradient_checkpointing is False  # a choice the user made stays
    sized = settle.for_sft(given, 40, 12)
    assert (sized.max_prompt_tokens, sized.max_new_tokens, sized.generator) == (40, 12, "hf")
    assert dataclasses.asdict(given) == before


def test_a_task_with_no_held_out_rows_skips_its_evaluation_or_stops_one_asked_for(tmp_path):
    data = tmp_path / "five.jsonl"
    data.write_text("".join(f'{{"prompt": "say {i}", "answer": "{i}"}}\n' for i in range(5)))
    reward = tmp_path / "exact.py"
    reward.write_text("def exact(completions, answer, **kw):\n"
                      "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n")
    cfg = TrainConfig(task=str(data), rewards=[f"{reward}:exact"])
    task = get_task(cfg.task, cfg.rewards)
    settled, note = settle.evaluation(cfg, task, task.make_data("train", cfg.seed))
    assert settled.eval_before_after is False and cfg.eval_before_after is True
    assert "no held-out rows" in note and "--eval-data" in note
    with pytest.raises(ValueError, match="--eval-every 5: task .* has no held-out rows"):
        settle.evaluation(dataclasses.replace(cfg, eval_every=5), task, [])
