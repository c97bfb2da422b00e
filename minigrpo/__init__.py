"""minigrpo: GRPO on one consumer GPU, with a 4-bit base, LoRA adapters and checkable rewards."""

from minigrpo.config import TrainConfig
from minigrpo.train import train

__all__ = ["TrainConfig", "train"]
__version__ = "0.1.0"
