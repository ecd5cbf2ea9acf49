"""`NumericSFTTrainer` against TRL's own `SFTTrainer` on the same tiny random Llama, rows and seed (CPU,
fp32): one decoder forward per micro-batch, as SFTTrainer (before, TRL's `compute_loss_func` path ran
a second forward without gradients for its metrics: 2 per micro-batch), the LM head module never called
in training (both read its weight: the objective from hidden states, over the labelled tail of the batch
only), and with every term at weight 0
the same logged loss, gradient norm and TRL metrics (entropy, mean_token_accuracy, num_tokens), which
SFTTrainer computes in its own fused head and the integration from its logits; evaluation likewise."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from tests.numloss.integrations import hf_trainer_helpers as H  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
TRL_METRICS = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")


def _mixtral(tok):
    """A tiny random Mixtral (4 experts, top 2) with a large router aux-loss weight, so that leaving the
    aux loss out would show in the logged loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5,
                                            max_position_embeddings=128))


def _run(tok, tmp_path, numeric: bool, make_model=H.model, accumulation: int = 1) -> tuple[dict, list[dict], dict]:
    """Two optimizer steps (micro-batch 2, accumulation 1 by default, so TRL's per-micro-batch metrics
    and the integration's per-step ones are over the same tokens) and one evaluation of 4 rows in one
    batch. Returns the decoder's forward counts, the training logs and the evaluation's metrics."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericSFTTrainer

    model = make_model(tok)
    forwards = {"train": 0, "eval": 0, "positions": [], "head_positions": []}

    def count(module, args, out):  # the decoder (LlamaModel): every forward of the model runs it once
        forwards["train" if module.training else "eval"] += 1
        if module.training:
            forwards["positions"].append(out.last_hidden_state.shape[1])

    def head(module, args):  # both trainers read the weight and never call the module in training
        if module.training:
            forwards["lm_head_calls"] = forwards.get("lm_head_calls", 0) + 1

    model.model.register_forward_hook(count)
    model.lm_head.register_forward_pre_hook(head)
    config = SFTConfig(output_dir=str(tmp_path / str(numeric)), per_device_train_batch_size=2,
                       gradient_accumulation_steps=accumulation, per_device_eval_batch_size=4, max_steps=2, logging_steps=1, learning_rate=1e-3, report_to=[],
                       save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, log_level="error", bf16=False)
    kwargs = dict(model=model, args=config, train_dataset=Dataset.from_list(H.chat_rows(8)), processing_class=tok)
    if numeric:
        trainer = NumericSFTTrainer(**kwargs, numeric_vocab=NumericVocab.from_tokenizer(tok, policy="digits"),
                                    objective={"terms": {"ntl_was": {"weight": 0}}})
        objective = trainer.numeric_loss.objective
        from_hidden = objective.from_hidden

        def chunked(hidden, *args, **kw):  # the hidden states the objective's chunked head reads
            forwards["head_positions"].append(hidden.shape[1])
            return from_hidden(hidden, *args, **kw)

        objective.from_hidden = chunked
    else:
        trainer = SFTTrainer(**kwargs)
    trainer.train()
    evaluated = trainer.evaluate(eval_dataset=Dataset.from_list(H.chat_rows(4)))
    return forwards, [h for h in trainer.state.log_history if "grad_norm" in h], evaluated


def test_one_forward_per_micro_batch_and_trls_own_metrics(tmp_path):
    tok = H.tokenizer(tmp_path / "tok")
    stock_forwards, stock_logs, stock_eval = _run(tok, tmp_path, numeric=False)
    forwards, logs, evaluated = _run(tok, tmp_path, numeric=True)
    assert {k: stock_forwards[k] for k in ("train", "eval")} == {"train": 2, "eval": 1}  # 2 micro-batches, 1 batch
    assert {k: forwards[k] for k in ("train", "eval")} == {"train": 2, "eval": 1}
    assert "lm_head_calls" not in stock_forwards and "lm_head_calls" not in forwards  # no full logits
    # the chunked head ran from the first labelled position on, not over the prompts before it
    assert len(forwards["head_positions"]) == 2
    assert all(h < p for h, p in zip(forwards["head_positions"], forwards["positions"])), forwards
    assert len(logs) == len(stock_logs) == 2
    for mine, stock in zip(logs, stock_logs):
        for key in TRL_METRICS:
            assert mine[key] == pytest.approx(stock[key], rel=1e-5), (key, mine[key], stock[key])
        assert mine["term/ntl_was"] > 0 and mine["numeric_positions"] > 0  # the numeric values beside them
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert evaluated[key] == pytest.approx(stock_eval[key], rel=1e-5), (key, evaluated[key], stock_eval[key])


def test_an_moe_models_router_aux_loss_is_added_as_sft_trainer_adds_it(tmp_path):
    """Mixtral at accumulation 2: SFTTrainer adds router_aux_loss_coef x the aux loss / accumulation steps
    to the loss; with every term at weight 0 the integration's loss and gradient norm are SFTTrainer's
    (without the aux loss they differ by ~0.5 x 2 / 2)."""
    tok = H.tokenizer(tmp_path / "tok")
    stock_forwards, stock_logs, _ = _run(tok, tmp_path, numeric=False, make_model=_mixtral, accumulation=2)
    forwards, logs, _ = _run(tok, tmp_path, numeric=True, make_model=_mixtral, accumulation=2)
    assert {k: forwards[k] for k in ("train", "eval")} == {k: stock_forwards[k] for k in ("train", "eval")}
    assert "aux_loss" in stock_logs[0]  # SFTTrainer did train with it
    for mine, stock in zip(logs, stock_logs):
        for key in ("loss", "grad_norm"):
            assert mine[key] == pytest.approx(stock[key], rel=1e-5), (key, mine[key], stock[key])
