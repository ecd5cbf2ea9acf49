"""numloss.integrations.trainer_head in the Trainer (one process, CPU): where the training loss comes from.

- A model whose lm_head is not a plain bias-free Linear (here: a Linear with a bias) cannot be scored from
  its hidden states by the head: the trainer says why (`head_problem`), leaves the model's forward as it
  is, and trains on the model's own logits; its logged step is the whole batch's objective computed by
  hand from those logits (bias included), in fp32 to 1e-6.
- bf16 autocast (`TrainingArguments(bf16=True)`, the CPU autocast SFTConfig turns on by default), on both
  paths (the head from hidden states, and the logits fallback): the logged objective is the hand
  computation's with the model's forward under the same autocast (bf16 logits) and the objective in fp32,
  to 1e-6, while the same computation without autocast is further off than that: the step ran in bf16.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")

from tests.numloss.integrations import hf_trainer_helpers as H  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
KEYS = ("loss", "ce", "term/smmd", "term/ntl_was", "numeric_positions")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return H.tokenizer(tmp_path_factory.mktemp("hf_tok"))


def _with_biased_head(model):
    head = model.lm_head
    model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    model.config.tie_word_embeddings = False
    return model


def _train_one_step(tok, model, out, bf16: bool):
    from transformers import DataCollatorForSeq2Seq, TrainingArguments

    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericTrainer

    args = TrainingArguments(output_dir=str(out), max_steps=1, logging_steps=1, learning_rate=1e-3, report_to=[],
                             save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, log_level="error",
                             per_device_train_batch_size=4, bf16=bf16)
    trainer = NumericTrainer(model=model, args=args, train_dataset=H.rows(tok, 4),
                             data_collator=DataCollatorForSeq2Seq(tok, label_pad_token_id=-100),
                             numeric_vocab=NumericVocab.from_tokenizer(tok, policy="digits"), objective=H.SPEC)
    trainer.train()
    return trainer, trainer.state.log_history[0]


def _objective(tok, model, autocast: bool) -> dict:
    """The whole batch's objective by hand: the model's forward (under bf16 autocast when asked), the
    objective on its logits in fp32."""
    from transformers import DataCollatorForSeq2Seq

    from numloss import NumericVocab, Objective, shift_labels

    batch = DataCollatorForSeq2Seq(tok, label_pad_token_id=-100)(H.rows(tok, 4))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert logits.dtype == (torch.bfloat16 if autocast else torch.float32)
    vocab = NumericVocab.from_tokenizer(tok, policy="digits")
    return Objective(vocab, H.SPEC)(logits.float(), shift_labels(batch["labels"])).log_dict()


def test_a_head_with_a_bias_trains_on_the_models_own_logits(tok, tmp_path):
    initial = _with_biased_head(H.model(tok))
    with torch.no_grad():
        initial.lm_head.bias.uniform_(-1, 1)  # a bias that moves the objective
    trainer, logged = _train_one_step(tok, copy.deepcopy(initial), tmp_path, bf16=False)
    assert trainer._numeric_head_problem == "its lm_head has a bias"
    assert not getattr(trainer.model, "_numloss_head", False)  # the forward was left as the model's own
    want = _objective(tok, initial, autocast=False)
    for key in KEYS:
        assert logged[key] == pytest.approx(want[key], rel=1e-6), (key, logged[key], want[key])
    without_bias = copy.deepcopy(initial)
    with torch.no_grad():
        without_bias.lm_head.bias.zero_()
    assert abs(_objective(tok, without_bias, autocast=False)["loss"] - logged["loss"]) > 1e-3  # the bias counted


@pytest.mark.parametrize("head", ["from hidden states", "logits fallback"])
def test_bf16_autocast_trains_on_bf16_logits(tok, tmp_path, head):
    initial = H.model(tok) if head == "from hidden states" else _with_biased_head(H.model(tok))
    trainer, logged = _train_one_step(tok, copy.deepcopy(initial), tmp_path, bf16=True)
    assert (trainer._numeric_head_problem is None) == (head == "from hidden states")
    want, fp32 = _objective(tok, initial, autocast=True), _objective(tok, initial, autocast=False)
    for key in KEYS:
        assert logged[key] == pytest.approx(want[key], rel=1e-6), (key, logged[key], want[key])
    assert abs(logged["loss"] - fp32["loss"]) > 5e-6 * fp32["loss"], (logged["loss"], fp32["loss"])
