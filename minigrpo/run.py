"""The run folder: the config verbatim, one metrics line per step, every sample, and the adapter.

    runs/<time>-<model>-<task>/
        config.json      the resolved TrainConfig
        metrics.jsonl    one JSON object per step
        samples.jsonl    every completion with its prompt, reward parts and advantage
        adapter/         PEFT format: PeftModel.from_pretrained(base, "adapter")
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from minigrpo.config import TrainConfig


class RunFolder:
    def __init__(self, path: Path, report_to: list[str] = ()):
        self.path = Path(path)
        self.reporters = [_reporter(name, self.path) for name in report_to]

    @classmethod
    def create(cls, cfg: TrainConfig) -> "RunFolder":
        if cfg.output_dir is None:
            name = Path(cfg.model.rstrip("/")).name
            cfg.output_dir = str(Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{cfg.task}")
        path = Path(cfg.output_dir)
        if (path / "metrics.jsonl").exists():
            raise FileExistsError(f"{path} already holds a run; pick another --output-dir")
        path.mkdir(parents=True, exist_ok=True)
        cfg.save(path / "config.json")
        return cls(path, cfg.report_to)

    def log(self, metrics: dict, samples: list[dict]) -> None:
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        with open(self.path / "samples.jsonl", "a") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        for report in self.reporters:
            report(numbers, metrics["step"])

    def save_adapter(self, model) -> Path:
        out = self.path / "adapter"
        model.save_pretrained(out)
        return out


def _reporter(name: str, path: Path):
    """A function(metrics, step) for TensorBoard or Weights & Biases; only ever made when asked for."""
    try:
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=str(path / "tensorboard"))

            def report(metrics, step):
                for key, value in metrics.items():
                    writer.add_scalar(key, value, step)
                writer.flush()

            return report
        import wandb

        wandb.init(project="minigrpo", name=path.name, dir=str(path), resume="allow")
        return lambda metrics, step: wandb.log(metrics, step=step)
    except ImportError as error:
        raise ValueError(f"--report-to {name} needs its package: pip install {name} ({error})") from None
