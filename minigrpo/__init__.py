"""minigrpo: GRPO on one consumer GPU, with a 4-bit base, LoRA adapters and checkable rewards."""

from minigrpo.config import TrainConfig
from minigrpo.errors import Stopped
from minigrpo.evaluate import sample_completions, sample_texts
from minigrpo.scoring import per_sample
from minigrpo.train import train

__all__ = ["TrainConfig", "train", "Stopped", "per_sample", "sample_texts", "sample_completions"]
__version__ = "0.1.0"
