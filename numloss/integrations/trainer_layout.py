"""The layout checks of the Trainer integration (`numloss.integrations.hf_trainer`): what the Trainer
believes about processes and gradient accumulation must be what the step's counts are summed over.

The integration sums each optimizer step's counts over the default torch.distributed process group and
multiplies each micro-batch's loss by the Trainer's number of processes to undo the mean over ranks.
Both are right only when the Trainer's world (accelerate's, read from WORLD_SIZE / RANK at
`TrainingArguments`) is that process group, rank for rank, and when the micro-batches one optimizer
step accumulates are the ones counted. A process group started by hand (`init_process_group` with a
`file://` or `tcp://` address and no WORLD_SIZE in the environment) gives a Trainer of world size 1
beside a group of 2: each process then trains alone on counts summed over both, and the loss silently
halves. `check_first_step` refuses that at the first optimizer step, naming both sides.
"""

from __future__ import annotations

import torch.distributed as dist


SHARED_BATCH_HINT = ("for rows split along the sequence use recipes.train with deepspeed.sp_size (DeepSpeed-Ulysses;"
                     " every numeric term exact under the split), or numloss.Objective(..., sequence_split=) in your"
                     " own loop (numloss.sequence_split); for tensor parallelism recipes.train with deepspeed.tp_size"
                     " or train.engine: megatron; in the Trainer, data parallelism (DDP, DeepSpeed ZeRO)")


def check_parallelism_config(args) -> None:
    """Before the Trainer is made: accelerate's parallelism config (`TrainingArguments.parallelism_config`)
    with ranks that share a batch. Its sequence-parallel backend (DeepSpeed's ALST) hands each rank its slice
    of `shift_labels` only, so the whole rows' labels, from which a number's place and a row's sequence
    count come, are not on any rank; context and tensor parallelism likewise."""
    config = getattr(args, "parallelism_config", None)
    if config is None:
        return
    shared = {name: getattr(config, f"{name}_size", None) or 1 for name in ("tp", "cp", "sp")}
    if any(size > 1 for size in shared.values()):
        named = ", ".join(f"{name}_size {size}" for name, size in shared.items() if size > 1)
        raise ValueError(f"numloss: TrainingArguments.parallelism_config with {named} (ranks that share a batch) is"
                         f" not supported by the Trainer integration; {SHARED_BATCH_HINT}")


def check_construction(trainer, sft: bool) -> None:
    """What can be refused from the arguments alone, when the trainer is made."""
    args = trainer.args
    if args.n_gpu > 1:
        raise ValueError("numloss: torch DataParallel (n_gpu > 1 in one process) is not supported; launch"
                         " one process per device (torchrun, accelerate launch)")
    shared = {"tensor": trainer.get_tp_size(), "context": trainer.get_cp_size(), "sequence": trainer.get_sp_size()}
    if any(size > 1 for size in shared.values()):
        raise ValueError(f"numloss: ranks that share a batch ({shared}) are not supported by the Trainer"
                         f" integration; {SHARED_BATCH_HINT}")
    if args.world_size > 1 and not args.average_tokens_across_devices:
        raise ValueError("numloss: average_tokens_across_devices must be True with several processes: the"
                         " numeric objective divides by the global batch's counts, over every process")
    if args.label_smoothing_factor:
        raise ValueError("numloss: label_smoothing_factor is not applied by the numeric objective; set it to 0")
    if sft and getattr(args, "loss_type", "nll") != "nll":
        raise ValueError(f"numloss: SFTConfig.loss_type={args.loss_type!r} is SFTTrainer's own loss, which the"
                         " numeric objective replaces; leave loss_type='nll'")


def _engine_accumulation(trainer) -> int | None:
    """DeepSpeed's own gradient accumulation (it steps the optimizer on its own boundary), or None."""
    engine = getattr(trainer, "deepspeed", None)
    steps = getattr(engine, "gradient_accumulation_steps", None)
    return int(steps()) if callable(steps) else None


def check_first_step(trainer, micro_batches: int) -> None:
    """At the first optimizer step, on every process: the Trainer's world size and process index equal
    torch.distributed's (the group the counts are summed over), outside DeepSpeed the accelerator
    leaves gradient accumulation to the Trainer (its own would divide the loss again), DeepSpeed steps every
    `gradient_accumulation_steps` micro-batches as the Trainer reads them, and every process reads the
    same number of micro-batches for the step. Raises RuntimeError naming each disagreement with both
    values, on every process alike.

    Collective: one all_gather_object over the default group (every process calls it once, at its
    first step; the group's timeout bounds the wait); none without a process group."""
    args, accelerator = trainer.args, trainer.accelerator
    mine = {"trainer_world": accelerator.num_processes, "trainer_rank": accelerator.process_index,
            "args_world": args.world_size, "args_rank": args.process_index,
            "accumulation": args.gradient_accumulation_steps,
            # accelerate divides the loss by its own accumulation outside DeepSpeed (DeepSpeed's engine
            # takes the accelerator's from its config, and the Trainer tells it not to scale)
            "accelerator_accumulation": None if getattr(trainer, "is_deepspeed_enabled", False)
            else accelerator.gradient_accumulation_steps,
            "engine_accumulation": _engine_accumulation(trainer), "micro_batches": micro_batches}
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
    else:
        world, everyone = 1, [mine]
    problems, hints = [], []
    for rank, info in enumerate(everyone):
        for source, size, index in (("the Trainer (accelerate)", info["trainer_world"], info["trainer_rank"]),
                                    ("TrainingArguments", info["args_world"], info["args_rank"])):
            if (size, index) != (world, rank):
                problems.append(f"process {rank}: {source} has world size {size}, process index {index}, but"
                                f" torch.distributed has world size {world}, rank {rank}")
                hints.append(LAUNCH_HINT)
                break
        if info["accelerator_accumulation"] not in (None, 1):
            problems.append(f"process {rank}: the accelerator accumulates gradients over"
                            f" {info['accelerator_accumulation']} micro-batches itself (it would divide the loss"
                            " again); the Trainer's gradient_accumulation_steps is"
                            f" {info['accumulation']} and the accelerator's must be 1")
            hints.append(ACCUMULATION_HINT)
        engine = info["engine_accumulation"]
        if engine is not None and engine != info["accumulation"]:
            problems.append(f"process {rank}: DeepSpeed steps every {engine} micro-batches but the Trainer's"
                            f" gradient_accumulation_steps is {info['accumulation']} (changed after the"
                            " trainer was made?)")
            hints.append(ACCUMULATION_HINT)
    batches = [info["micro_batches"] for info in everyone]
    if len(set(batches)) > 1:
        problems.append(f"the processes read different numbers of micro-batches for the first step: {batches}")
    if problems:
        raise RuntimeError(
            "numloss: the Trainer's layout does not match the process group the step's counts are summed over"
            " (the loss and its gradient would be wrong): " + "; ".join(problems) + "."
            + "".join(" " + hint for hint in dict.fromkeys(hints)))


LAUNCH_HINT = ("Launch every process with torchrun or accelerate launch (they set WORLD_SIZE, RANK and LOCAL_RANK,"
               " from which the Trainer reads its layout), or set those variables before making TrainingArguments.")
ACCUMULATION_HINT = ("Set gradient_accumulation_steps in TrainingArguments before making the trainer (DeepSpeed's"
                     " config takes it then), and leave the accelerator's gradient accumulation to the Trainer.")
