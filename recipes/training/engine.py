"""The interface between `recipes.train`'s loop and a training engine (DeepSpeed, Megatron-core).

The loop owns everything that must mean the same on every engine: the data order (`ShardDataset`
sharded by the engine's data-parallel position), the step's micro-batches and their model inputs,
logging, the checkpoint directories and their cadence, hooks for orchestrators. The engine owns the
model, its parallel layout, the forward/backward of a step (normalised over the step's global counts,
`recipes.training.parallel.step_counts`), the optimizer and schedule, its own checkpoint state and the
Hugging Face export.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from .parallel import DataParallel


class Engine(Protocol):
    """What every engine provides; built as `Engine(recipe, runtime, checkpoint_dirs)` (the directories
    tell it, before it builds anything, what layout a resume comes from). Every method is a collective:
    every rank calls it."""

    name: str  # its contract's name (train.engine)
    dp: DataParallel  # this rank's data-parallel replica: the reader shards rows by it
    tokenizer: Any
    processor: Any  # vision recipes: the processor (else None)
    batch_options: dict  # keyword arguments of `recipes.inputs.batches.model_inputs` for this model
    layout: dict  # written to each checkpoint's layout.json; compared at resume
    optimizer_name: str  # which optimizer implementation runs the step (for the run log)

    @staticmethod
    def join_process_group(timeout_minutes: float) -> Any:
        """On the class, before it is built: this rank's `Runtime`, its process group made as the engine needs
        (`recipes.training.runtime.setup_distributed`, with the engine's `init_group` where it has one)."""

    def train_step(self, window: list[dict], diagnostics: bool = False) -> dict[str, float]:
        """Forward, backward and optimizer step over this rank's micro-batches `window` (model inputs on
        the device); returns this rank's share of the logged values (loss, ce, term/*,
        numeric_positions, and with `diagnostics` the gradient sums `grad_sums/*` of
        `numloss.diagnostics`): their SUM over the data-parallel group is the global batch's value."""
        ...

    def eval_step(self, window: list[dict], answers: bool = True) -> tuple[dict[str, float], list[list[int]]]:
        """Optional (`eval.every`, `recipes.training.held_out`; the terms' scale before step 1,
        `recipes.training.scale_check`): the forward of `train_step` without gradients or update, in eval
        mode, the training mode restored after: this rank's share of the logged values over `window`
        (normalised over the window's global counts), and per row of the window, in order, the argmax token
        at each of its label positions (the teacher-forced answer; with `answers` False none: [])."""
        ...

    def eval_problem(self) -> str | None:
        """Optional, with `eval_step`: why `eval_step` cannot run for this model (None: it can). Known on
        every rank alike, before any collective."""
        ...

    def lr(self) -> float:
        """The learning rate the next step uses."""
        ...

    def grad_norm(self) -> float | None:
        """The last step's global gradient norm before clipping (None where the engine has none)."""
        ...

    def weights_finite(self) -> bool:
        """Optional: whether this rank's parameters (its own shards) are all finite; the loop combines the
        ranks and never saves or exports non-finite weights (`recipes.reliability.health`). An engine without
        it is not checked."""
        ...

    def save_state(self, directory: Path, step: int) -> None:
        """The engine's state (model, optimizer, schedule) into a step directory."""
        ...

    def load_state(self, directory: Path) -> None:
        ...

    def export(self, path: Path, record: Any = None) -> None:
        """A Hugging Face safetensors model (sharded) plus tokenizer or processor in `path`, written by the
        one export writer (`recipes.reliability.export_writer`), whose `record` says what it holds."""
        ...

    def close(self) -> None:
        """Release the engine: its own process groups, and every reference it holds to the model and the
        optimizer, which hold groups too (`recipes.training.runtime.teardown`). Unusable afterwards."""
        ...
