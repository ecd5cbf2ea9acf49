"""What a run reports while it trains: metrics.jsonl, TensorBoard, Weights & Biases, a progress bar."""

from __future__ import annotations

import json
import sys
from pathlib import Path


from recipes.config import Recipe
from .health import strict_json_row
from .runtime import Runtime


class MetricsLog:
    """metrics.jsonl (+ TensorBoard, + Weights & Biases when configured), on rank 0 only."""

    def __init__(self, recipe: Recipe, out: Path, runtime: Runtime, resumed_step: int):
        self.enabled = runtime.is_main
        self.path = out / "metrics.jsonl"
        self.tb = self.wandb = None
        if not self.enabled:
            return
        if self.path.exists():  # a restart: drop the lines logged after the checkpoint it resumes from
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resumed_step]
            self.path.write_text("".join(line + "\n" for line in keep))
        if recipe.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tb"), purge_step=resumed_step + 1 if resumed_step else None)
        if recipe.train.wandb_project:
            import wandb  # optional: only when a project is configured

            self.wandb = wandb.init(project=recipe.train.wandb_project, name=recipe.name, config=recipe.to_dict(),
                                    id=recipe.name, resume="allow")

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(strict_json_row(row), allow_nan=False) + "\n")  # strict JSON: NaN/inf as null
        step = row["step"]
        if self.tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(row, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def progress_bar(recipe: Recipe, runtime: Runtime, start: int):
    if not (recipe.train.progress and runtime.is_main):
        return None
    from tqdm import tqdm

    return tqdm(total=recipe.train.steps, initial=start, desc=recipe.name, unit="step", file=sys.stderr)
