"""Both notebooks, top to bottom, on cpu with the offline tiny model and 2 steps: an API change that breaks
a notebook fails here."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"


def run_notebook(name: str, parameters: str, workdir: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    cells = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(cells) == 1, "each notebook has one parameters cell"
    cells[0].source = parameters  # what papermill would inject, done by hand
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}).execute()
    return nb


def outputs(nb) -> str:
    return "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_countdown_notebook(tmp_path):
    nb = run_notebook("countdown_qwen_1.5b.ipynb", (
        'MODEL = "smollm2-135m"\nTASK = "countdown"\nSTEPS = 2\nNUM_GENERATIONS = 2\nPROMPTS_PER_STEP = 1\n'
        f'MAX_NEW_TOKENS = 16\nGENERATOR = "hf"\nRUN_DIR = "{tmp_path / "countdown"}"\nLIVE_PLOT_SECONDS = 1\n'
    ), tmp_path)
    assert "done:" in outputs(nb)
    assert (tmp_path / "countdown" / "adapter" / "adapter_model.safetensors").exists()
    assert (tmp_path / "countdown" / "curves.png").exists()


def test_your_own_reward_notebook(tmp_path):
    nb = run_notebook("your_own_reward.ipynb", (
        'MODEL = "smollm2-135m"\nSTEPS = 2\nNUM_GENERATIONS = 2\nMAX_NEW_TOKENS = 12\nEVAL_PROMPTS = 2\n'
        f'WORKDIR = "{tmp_path / "haiku"}"\n'
    ), tmp_path)
    text = outputs(nb)
    assert "three_lines" in text and "pass@1" in text
    assert (tmp_path / "haiku" / "run" / "adapter" / "adapter_model.safetensors").exists()


def test_countdown_notebook_shows_a_training_error_as_an_error(tmp_path):
    """Training runs in the cell itself, not in a thread that would swallow the error and print "done"."""
    import pytest
    from nbclient.exceptions import CellExecutionError

    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the run folder cannot be made under a file: train() itself fails
    with pytest.raises(CellExecutionError) as failed:
        run_notebook("countdown_qwen_1.5b.ipynb", (
            'MODEL = "smollm2-135m"\nTASK = "countdown"\nSTEPS = 2\nNUM_GENERATIONS = 2\nPROMPTS_PER_STEP = 1\n'
            f'MAX_NEW_TOKENS = 8\nGENERATOR = "hf"\nRUN_DIR = "{blocker / "run"}"\nLIVE_PLOT_SECONDS = 1\n'
        ), tmp_path)
    assert "is a file, so no folder can be made there" in str(failed.value) and "import threading" in str(failed.value)  # the training cell


def test_your_own_tool_notebook(tmp_path):
    nb = run_notebook("your_own_tool.ipynb", (
        'MODEL = "smollm2-135m"\nSTEPS = 2\nNUM_GENERATIONS = 2\nMAX_NEW_TOKENS = 12\nMAX_TURNS = 2\n'
        f'EVAL_PROMPTS = 2\nWORKDIR = "{tmp_path / "shop"}"\n'
    ), tmp_path)
    text = outputs(nb)
    assert '"name": "price"' in text and "2.9" in text and "error: " in text  # the schema, a call, a failed one
    assert "shop: 4 episodes sampled" in text and text.count("pass@1") == 2 and "[assistant]" in text
    assert (tmp_path / "shop" / "run" / "adapter" / "adapter_model.safetensors").exists()
