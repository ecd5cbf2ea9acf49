"""numloss.integrations.trainer_layout.check_construction: what the Trainer integration refuses when the
trainer is made, before any step, each with the message that names the setting.

Real trainers throughout (`NumericTrainer`, TRL's `NumericSFTTrainer`), on CPU. Two refusals need what a
CPU machine cannot have, and the Trainer's own answer is replaced there (said at each test): more than one
GPU in one process (`n_gpu`), and ranks that share a batch (tensor, context or sequence parallelism, which
accelerate builds from a device mesh of GPUs). `average_tokens_across_devices=False` is refused only with
several processes: on 2 real ranks (`tests.distributed.run_ranks`, launched as torchrun would: WORLD_SIZE
and RANK set), and accepted in one process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("trl")

from tests.distributed import run_ranks  # noqa: E402
from tests.numloss.integrations import hf_trainer_helpers as H  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tok")
    tok = H.tokenizer(path)
    tok.save_pretrained(str(path))
    return tok


def _args(out, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), max_steps=1, logging_steps=1, learning_rate=1e-3, report_to=[],
                save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, log_level="error")
    return TrainingArguments(**{**base, **kw})


def _trainer(tok, args, base=None):
    from transformers import DataCollatorForSeq2Seq

    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericTrainer, numeric_trainer_class

    numeric = dict(numeric_vocab=NumericVocab.from_tokenizer(tok, policy="digits"), objective=H.SPEC)
    if base is not None:  # TRL's SFTTrainer: its own dataset form and collator
        from datasets import Dataset

        return numeric_trainer_class(base)(model=H.model(tok), args=args, processing_class=tok,
                                           train_dataset=Dataset.from_list(H.chat_rows(4)), **numeric)
    return NumericTrainer(model=H.model(tok), args=args, train_dataset=H.rows(tok, 4),
                          data_collator=DataCollatorForSeq2Seq(tok, label_pad_token_id=-100), **numeric)


def test_a_plain_layout_is_accepted(tok, tmp_path):
    trainer = _trainer(tok, _args(tmp_path, average_tokens_across_devices=False))  # one process: nothing to average
    assert trainer.args.world_size == 1 and trainer.get_tp_size() == 1


def test_label_smoothing_is_refused(tok, tmp_path):
    with pytest.raises(ValueError, match="label_smoothing_factor is not applied by the numeric objective; set it to 0"):
        _trainer(tok, _args(tmp_path, label_smoothing_factor=0.1))


def test_an_sft_loss_type_other_than_nll_is_refused(tok, tmp_path):
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                       bf16=False, loss_type="dft")
    with pytest.raises(ValueError, match=r"SFTConfig.loss_type='dft' is SFTTrainer's own loss"):
        _trainer(tok, config, base=SFTTrainer)


def test_data_parallel_in_one_process_is_refused(tok, tmp_path, monkeypatch):
    """The Trainer's n_gpu (what it would wrap in torch DataParallel) read as 2: a CPU machine has no GPU."""
    from transformers import TrainingArguments

    args = _args(tmp_path)
    monkeypatch.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
    with pytest.raises(ValueError, match=r"torch DataParallel \(n_gpu > 1 in one process\) is not supported"):
        _trainer(tok, args)


@pytest.mark.parametrize("kind", ["tp", "cp", "sp"])
def test_ranks_that_share_a_batch_are_refused(tok, tmp_path, monkeypatch, kind):
    """The Trainer's own get_<kind>_size answering 2 (accelerate builds these groups from a GPU mesh)."""
    from transformers import Trainer

    monkeypatch.setattr(Trainer, f"get_{kind}_size", lambda self: 2)
    name = {"tp": "tensor", "cp": "context", "sp": "sequence"}[kind]
    with pytest.raises(ValueError, match=rf"ranks that share a batch \(.*'{name}': 2.*\) are not supported"):
        _trainer(tok, _args(tmp_path))


def construct_without_token_averaging(rank: int, world: int, tok_dir: str, out: str) -> None:
    """One of 2 ranks started as torchrun starts them: the Trainer sees a world of 2."""
    from transformers import AutoTokenizer

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    try:
        trainer = _trainer(tok, _args(Path(out) / f"rank{rank}", average_tokens_across_devices=False))
        result = {"world_size": trainer.args.world_size}
    except ValueError as err:
        result = {"error": str(err)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_without_token_averaging_several_processes_are_refused(tok, tmp_path):
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(str(tok_dir))
    run_ranks(2, construct_without_token_averaging, str(tok_dir), str(tmp_path), timeout=240)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result.get("error", "").startswith("numloss: average_tokens_across_devices must be True with several"
                                                  " processes"), (rank, result)
