"""One rank of the 2-process Trainer test (run by torchrun on CPU, gloo): the README's Trainer snippet
at micro-batch 1 x gradient accumulation 2 per rank, one optimizer step over the 4 rows.

    torchrun --nproc_per_node 2 tests/integrations/hf_trainer_ranks.py TOKENIZER_DIR OUT_DIR

Rank 0 writes the initial weights (`init.pt`) and the Trainer's log history (`log_history.json`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.integrations import hf_trainer_helpers as H


def main(tok_dir: str, out: str) -> None:
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, TrainingArguments

    from numloss import NumericVocab  # noqa: F401  (the snippet imports it too)

    torch.set_num_threads(1)
    out_dir = Path(out)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    model = H.model(tokenizer)
    args = TrainingArguments(output_dir=str(out_dir / "trainer"), per_device_train_batch_size=1,
                             gradient_accumulation_steps=2, max_steps=1, logging_steps=1, learning_rate=1e-3,
                             report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                             log_level="error")
    if args.process_index == 0:
        torch.save(model.state_dict(), out_dir / "init.pt")
    namespace = {"tokenizer": tokenizer, "model": model, "args": args, "dataset": H.rows(tokenizer, 4),
                 "collator": DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)}
    exec(H.readme_snippets()[0], namespace)  # the README's Trainer snippet, as a user runs it
    trainer = namespace["trainer"]
    if args.process_index == 0:
        (out_dir / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    # end the process group before exit: left to interpreter shutdown, gloo's threads sometimes abort the
    # process ("terminate called without an active exception", exit -6) after a run that succeeded
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
