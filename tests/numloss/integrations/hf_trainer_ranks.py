"""The 2-process Trainer runs of tests/numloss/integrations/test_hf_trainer.py and test_hf_trainer_layout.py.

As torchrun runs it (CPU, gloo): docs/library.md's Trainer snippet at micro-batch 1 x gradient accumulation 2
per rank, one optimizer step over 4 rows, then an evaluation of 5 rows at batch 1 per rank (accelerate
repeats a row to even out the last batch).

    torchrun --nproc_per_node 2 tests/numloss/integrations/hf_trainer_ranks.py TOKENIZER_DIR OUT_DIR

Rank 0 writes the initial and the trained weights (`init.pt`, `trained.pt`), the Trainer's log history
(`log_history.json`) and the evaluation's metrics (`eval.json`).

`layout_rank` is the same snippet on ranks that `tests.distributed.run_ranks` started: a process group
made by hand, with or without the variables the Trainer reads its layout from."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from tests.numloss.integrations import hf_trainer_helpers as H


def _train(tok_dir: str, out_dir: Path):
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, TrainingArguments

    from numloss import NumericVocab  # noqa: F401  (the snippet imports it too)

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    model = H.model(tokenizer)
    args = TrainingArguments(output_dir=str(out_dir / "trainer"), per_device_train_batch_size=1,
                             per_device_eval_batch_size=1, gradient_accumulation_steps=2, max_steps=1,
                             logging_steps=1, learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, disable_tqdm=True, log_level="error")
    if args.process_index == 0:
        torch.save(model.state_dict(), out_dir / "init.pt")
    namespace = {"tokenizer": tokenizer, "model": model, "args": args, "dataset": H.rows(tokenizer, 4),
                 "collator": DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)}
    exec(H.trainer_snippets()[0], namespace)  # docs/library.md's Trainer snippet, as a user runs it
    return namespace["trainer"], tokenizer


def main(tok_dir: str, out: str) -> None:
    out_dir = Path(out)
    trainer, tokenizer = _train(tok_dir, out_dir)
    evaluated = trainer.evaluate(eval_dataset=H.rows(tokenizer, 5))
    if trainer.args.process_index == 0:
        (out_dir / "log_history.json").write_text(json.dumps(trainer.state.log_history))
        (out_dir / "eval.json").write_text(json.dumps(evaluated))
        torch.save(trainer.model.state_dict(), out_dir / "trained.pt")
    # end the process group before exit: left to interpreter shutdown, gloo's threads sometimes abort the
    # process ("terminate called without an active exception", exit -6) after a run that succeeded
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def layout_rank(rank: int, world: int, tok_dir: str, out: str, launched: bool) -> None:
    """One rank under `run_ranks` (its gloo group already made by hand). `launched`: set WORLD_SIZE, RANK
    and LOCAL_RANK first, as torchrun would. Writes `rank<r>.json`: the log history, or the error."""
    if launched:
        os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    out_dir = Path(out)
    (out_dir / f"rank{rank}").mkdir()
    try:
        trainer, _ = _train(tok_dir, out_dir / f"rank{rank}")
        result = {"log_history": trainer.state.log_history, "world_size": trainer.args.world_size}
    except RuntimeError as err:
        result = {"error": str(err)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))


def launched_rank(rank: int, world: int, tok_dir: str, out: str) -> None:
    """`main` on a rank under `run_ranks` with the variables torchrun sets: the torchrun job's numbers
    without its interpreter starts."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    main(tok_dir, out)


if __name__ == "__main__":
    main(*sys.argv[1:])


def deepspeed_rank(rank: int, world: int, tok_dir: str, out: str) -> None:
    """One process (launched: WORLD_SIZE etc. set) training docs/library.md's Trainer snippet under DeepSpeed ZeRO-2
    through the Trainer (`deepspeed.init_distributed()` and `use_cpu=True` first, as on a CPU machine):
    micro-batch 2 x accumulation 2 over the 4 rows, then a trainer whose gradient_accumulation_steps is
    changed after it was made (DeepSpeed's config took the old one). Writes `deepspeed.json`."""
    import sys as _sys

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import deepspeed.comm.torch  # noqa: F401
    _sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # inference-only op: skip its CPU build
    import deepspeed
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, TrainingArguments

    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericTrainer

    deepspeed.init_distributed()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}
    result = {}
    for name, accumulation, changed_to in (("trained", 2, None), ("changed", 1, 2)):
        model = H.model(tokenizer)
        if name == "trained":
            torch.save(model.state_dict(), Path(out) / "init.pt")
        args = TrainingArguments(output_dir=f"{out}/{name}", per_device_train_batch_size=2, max_steps=1,
                                 gradient_accumulation_steps=accumulation, logging_steps=1, learning_rate=1e-3,
                                 report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                                 log_level="error", deepspeed=config)
        trainer = NumericTrainer(model=model, args=args, train_dataset=H.rows(tokenizer, 4),
                                 data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100),
                                 numeric_vocab=NumericVocab.from_tokenizer(tokenizer, policy="digits"), objective=H.SPEC)
        if changed_to is not None:
            trainer.args.gradient_accumulation_steps = changed_to
        try:
            trainer.train()
            result[name] = {"log_history": trainer.state.log_history}
        except RuntimeError as err:
            result[name] = {"error": str(err)}
        trainer.accelerator.free_memory()
    (Path(out) / "deepspeed.json").write_text(json.dumps(result))


def zero3_rank(rank: int, world: int, tok_dir: str, out: str) -> None:
    """One of 2 processes training docs/library.md's Trainer snippet under DeepSpeed ZeRO-3 through the Trainer
    (every weight partitioned: the LM head's weight is a shard outside a gather), micro-batch 1 x
    accumulation 2 per rank over 4 rows, one of them without any label (its rank's micro-batch runs the
    head on no labelled position), for an untied and a tied (lm_head = embed_tokens) model. Rank 0 writes
    each model's initial weights (gathered) and `zero3.json`: the log histories."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import deepspeed.comm.torch  # noqa: F401
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # inference-only op: skip its CPU build
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, TrainingArguments

    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericTrainer
    from recipes.experiments.tiny import tiny_llama_config

    deepspeed.init_distributed()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto",
              # every weight partitioned and released after each use (no reuse window, no prefetch), so a
              # weight read outside a gather is empty
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
                                    "stage3_max_live_parameters": 0}}
    result = {}
    for tied in (False, True):
        args = TrainingArguments(output_dir=f"{out}/tied{tied}", per_device_train_batch_size=1, max_steps=1,
                                 gradient_accumulation_steps=2, logging_steps=1, learning_rate=1e-3, report_to=[],
                                 save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, log_level="error",
                                 deepspeed=config)
        spec = dict(tiny_llama_config(len(tokenizer)), tie_word_embeddings=tied)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec),
                                                 dtype=torch.float32)  # under zero.Init: partitioned
        assert model.lm_head.weight.numel() == 0, "the model was not partitioned"
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            if rank == 0:
                torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                           Path(out) / f"init_tied{tied}.pt")
        rows = H.rows(tokenizer, 4)
        rows[2]["labels"] = [-100] * len(rows[2]["labels"])
        trainer = NumericTrainer(model=model, args=args, train_dataset=rows,
                                 data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100),
                                 numeric_vocab=NumericVocab.from_tokenizer(tokenizer, policy="digits"),
                                 objective=H.SPEC)
        trainer.train()
        result[f"tied{tied}"] = trainer.state.log_history
        trainer.accelerator.free_memory()
    if rank == 0:
        (Path(out) / "zero3.json").write_text(json.dumps(result))
    torch.distributed.barrier()
