"""`minigrpo bench learn` at a tiny size, TRL included: both trainers train for real, are evaluated by minigrpo's
evaluator on the same held-out rows, and the card holds what docs/results.md is written from. (The learning
itself is for the cards' figures, made with the commands docs/results.md names; these runs are too short.)"""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from minigrpo.bench.learn import TABLE_END, TABLE_START, read_cards, summarize, table, write_tables
from minigrpo.cli.app import app

ROOT = Path(__file__).resolve().parents[1]


TINY = ["--task", "addition", "--steps", "2", "--eval-every", "1", "--eval-prompts", "4", "--eval-samples", "1",
        "--set", "max_new_tokens=16", "--set", "num_generations=2"]


@pytest.fixture(scope="module")
def card_folder(tmp_path_factory):
    pytest.importorskip("trl")
    out = tmp_path_factory.mktemp("cards")
    result = CliRunner().invoke(app, ["bench", "learn", *TINY, "--seed", "3", "--with-trl", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result.output


def test_a_card_holds_both_trainers_seed_by_seed_with_the_recipe_and_the_machine(card_folder):
    out, printed = card_folder
    card = json.loads((out / "addition-smollm2-135m.json").read_text())
    assert (card["task"], card["model"], card["steps"], card["seeds"]) == ("addition", "smollm2-135m", 2, [3])
    # the recipe: what differs from --model and --task alone, and a fingerprint of the whole config
    assert card["settings"] == {"steps": 2, "num_generations": 2, "max_new_tokens": 16}
    assert len(card["config_hash"]) == 16 and card["eval"] == {"every": 1, "prompts": 4, "samples": 1}
    assert card["hardware"]["cpu"] and card["hardware"]["threads"] >= 1 and card["versions"]["trl"]
    assert list(card["trainers"]) == ["minigrpo", "TRL GRPOTrainer"]
    for trainer, result in card["trainers"].items():
        (run,) = result["runs"]
        assert run["seed"] == 3 and (out / run["folder"]).is_dir() and not Path(run["folder"]).is_absolute()
        # an evaluation before, after each step (--eval-every 1), on the clock of training seconds
        assert [p["step"] for p in run["curve"]] == [0, 1, 2], trainer
        assert run["curve"][0]["train_s"] == 0 < run["curve"][1]["train_s"] < run["curve"][2]["train_s"] == pytest.approx(run["train_s"], abs=0.06)
        assert run["train_s"] < run["wall_s"]
        assert all(0 <= p["pass@1"] <= 1 for p in run["curve"])
        first = run["curve"][0]
        assert (run["before"]["pass@1"], run["before"]["reward"]) == (first["pass@1"], first["reward"])
        # addition extracts answers, so each point says how many prompts got the commonest one (a share of 4)
        assert all(run[point]["top_answer"] in (0, 0.25, 0.5, 0.75, 1.0) for point in ("before", "after"))
        assert result["summary"] == summarize([run])
        assert f"{trainer}: pass@1" in printed.replace("seed 3, ", "")
    # TRL's checkpoints were evaluated by minigrpo's evaluator, every step's and the base's, on 4 prompts each
    trl_evals = [json.loads(line) for line in (out / card["trainers"]["TRL GRPOTrainer"]["runs"][0]["folder"]
                                               / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["prompts"], e["samples_per_prompt"]) for e in trl_evals] == [(0, 4, 1), (1, 4, 1), (2, 4, 1)]
    # the markdown row is the table's
    assert (out / "addition-smollm2-135m.md").read_text().strip() == table([card])
    assert table([card]).count("| addition | smollm2-135m |") == 2


def test_the_results_page_is_written_between_its_markers_and_a_card_folder_is_not_overwritten(card_folder, tmp_path):
    out, _ = card_folder
    page = tmp_path / "results.md"
    page.write_text(f"# Results\n\nbefore\n{TABLE_START}\nold\n{TABLE_END}\nafter\n")
    result = CliRunner().invoke(app, ["bench", "tables", str(out), "--page", str(page)])
    assert result.exit_code == 0, result.output
    assert page.read_text() == f"# Results\n\nbefore\n{TABLE_START}\n{table(read_cards(out))}\n{TABLE_END}\nafter\n"
    # a seed already in the card, or a card of another recipe in the folder: refused, nothing touched
    before = {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*")}
    for flags, says in ((["--seed", "3"], "seed 3 of minigrpo is there already"),
                        (["--seed", "4", "--set", "learning_rate=1e-5"], "holds a card with another config (hash")):
        again = CliRunner().invoke(app, ["bench", "learn", *TINY, *flags, "--out", str(out)])
        assert again.exit_code != 0 and says in " ".join(again.output.split()), again.output  # as wrapped
    assert {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_seeds_run_later_join_their_card(card_folder, tmp_path):
    import shutil

    out = tmp_path / "cards"
    shutil.copytree(card_folder[0], out)
    result = CliRunner().invoke(app, ["bench", "learn", *TINY, "--seed", "4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    card = json.loads((out / "addition-smollm2-135m.json").read_text())
    mine, trl = (card["trainers"][t]["runs"] for t in ("minigrpo", "TRL GRPOTrainer"))
    assert card["seeds"] == [3, 4] and [r["seed"] for r in mine] == [3, 4] and [r["seed"] for r in trl] == [3]
    assert card["trainers"]["minigrpo"]["summary"] == summarize(mine) and summarize(mine)["pass@1"]["gain"]["se"] is not None
    assert "| minigrpo | 2 | 2 |" in table([card]) and "| TRL GRPOTrainer | 1 | 2 |" in table([card])


def test_a_cards_curve_is_drawn(card_folder):
    from minigrpo.plot import plot_card

    out, _ = card_folder
    png = plot_card(out / "addition-smollm2-135m.json", out / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_results_page_shows_exactly_its_cards():
    page = (ROOT / "docs" / "results.md").read_text()
    block = page.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    assert block == table(read_cards(ROOT / "docs" / "cards"))
