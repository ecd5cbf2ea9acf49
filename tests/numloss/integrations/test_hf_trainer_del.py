"""DEL through the Trainer integration with no code of its own: `NumericTrainer` and `NumericSFTTrainer`
given `{"terms": {"del": {}}}` log `term/del` equal to the float64 reference of the definition
(`tests/numloss/numeric_reference.digit_entropy`) on the whole global batch at the initial weights, and
loss = CE + 0.01 x DEL; the decimal point comes from the tokenizer (CPU, fp32, a tiny random Llama)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")

from tests.numloss.integrations import hf_trainer_helpers as H  # noqa: E402
from tests.numloss import numeric_reference as R  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
SPEC = {"terms": {"del": {}}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return H.tokenizer(tmp_path_factory.mktemp("hf_tok_del"))


def _reference(model, tok, batch) -> float:
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    return float(R.digit_entropy(logits[:, :-1], batch["labels"][:, 1:], digits, tok.convert_tokens_to_ids(".")))


def _check(logged: dict, want: dict, reference: float) -> None:
    assert logged["term/del"] == pytest.approx(reference, rel=1e-5)
    for key in ("loss", "ce", "term/del", "numeric_positions"):
        assert logged[key] == pytest.approx(want[key], rel=1e-5), (key, logged[key], want[key])
    assert logged["loss"] == pytest.approx(logged["ce"] + 0.01 * logged["term/del"], rel=1e-6)


def test_numeric_trainer_trains_del(tok, tmp_path):
    from transformers import DataCollatorForSeq2Seq, TrainingArguments

    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericTrainer

    model, dataset = H.model(tok), H.rows(tok, 4)
    initial = copy.deepcopy(model)
    collator = DataCollatorForSeq2Seq(tok, label_pad_token_id=-100)
    vocab = NumericVocab.from_tokenizer(tok, policy="digits")
    assert vocab.decimal_point_id == tok.convert_tokens_to_ids(".")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, logging_steps=1, learning_rate=1e-3, report_to=[],
                             save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, log_level="error",
                             per_device_train_batch_size=2, gradient_accumulation_steps=2)
    trainer = NumericTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator,
                             numeric_vocab=vocab, objective=SPEC)
    trainer.train()
    batch = collator(copy.deepcopy(dataset))
    _check(trainer.state.log_history[0], H.whole_batch_objective(initial, vocab, SPEC, batch),
           _reference(initial, tok, batch))


def test_numeric_sft_trainer_trains_del(tok, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig

    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericSFTTrainer

    model = H.model(tok)
    initial = copy.deepcopy(model)
    vocab = NumericVocab.from_tokenizer(tok, policy="digits")
    config = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, logging_steps=1,
                       learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
                       log_level="error", completion_only_loss=True, bf16=False)
    trainer = NumericSFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(H.chat_rows(4)),
                                processing_class=tok, numeric_vocab=vocab, objective=SPEC)
    trainer.train()
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])  # TRL's own labels
    _check(trainer.state.log_history[0], H.whole_batch_objective(initial, vocab, SPEC, batch),
           _reference(initial, tok, batch))
