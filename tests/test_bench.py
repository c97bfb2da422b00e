"""`minigrpo bench model` on CPU: it trains each setting for real and prints what it measured and a plan.
(The figures themselves are for people to read, not for asserts: these machines are too noisy to time.)"""

from rich.console import Console

from minigrpo.bench import bench_model


def test_bench_model_measures_each_setting_and_prints_a_plan():
    console = Console(record=True, width=160)
    rows = bench_model("smollm2-135m", groups=(2,), lengths=(8, 16), steps=2, generator="hf", console=console)
    assert [(r["G"], r["max_new_tokens"]) for r in rows] == [(2, 8), (2, 16)]
    for r in rows:
        assert 0 < r["completion tokens"] <= r["max_new_tokens"] and r["prompt tokens"] > 0
        assert r["s/step"] > 0 and r["tokens/s"] > 0
        assert 0.1 < r["loaded GB"] <= r["peak GB"]
    text = console.export_text()
    assert "memory plan" in text and "Fits this machine" in text
