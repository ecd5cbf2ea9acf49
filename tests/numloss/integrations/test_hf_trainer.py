"""numloss.integrations.hf_trainer with the real transformers Trainer and TRL SFTTrainer (CPU, fp32; a
tiny random Llama). The first optimizer step's logged values are checked against the objective of the
whole global batch computed by hand in one forward, at the initial weights:

- docs/library.md's Trainer snippet at gradient accumulation 2 (micro-batch 2, one process), and its
  evaluation afterwards: `eval_loss`, `eval_ce`, `eval_term/*` are the objective of the whole evaluated
  set at evaluation batch 1 and 4 alike;
- the same snippet on 2 processes (pre-started, with torchrun's variables; gloo; micro-batch 1 x
  accumulation 2 per rank), and its evaluation of 5 rows at batch 1 per rank (accelerate repeats one row
  to even the ranks out);
- docs/library.md's SFTTrainer snippet on a chat dataset with completion-only loss: the logged loss is
  numloss's Objective on the labels TRL's collator makes, which cover the answers only;
- every term weight 0 changes nothing: bit-identical losses and weights to the integration's plain CE,
  and the stock Trainer's CE within float rounding;
- `import numloss.integrations.hf_trainer` imports neither transformers nor TRL.

The answers hold 1 to 6 digits, so a micro-batch's own mean would weigh them differently (checked:
the hand value differs from the mean of the micro-batches' own objectives).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")

from tests.numloss.integrations import hf_trainer_helpers as H  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
REL = 1e-5
LOGGED = ("loss", "ce", "term/smmd", "term/ntl_was", "numeric_positions")
TRAINED = (*LOGGED, "grad_norm")  # the gradient's norm too: its scale over accumulation and processes


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return H.tokenizer(tmp_path_factory.mktemp("hf_tok"))


def _args(out, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), max_steps=1, logging_steps=1, learning_rate=1e-3, report_to=[],
                save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, log_level="error")
    return TrainingArguments(**{**base, **kw})


def _collator(tok):
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tok, label_pad_token_id=-100)


def _unprefixed(metrics: dict, prefix: str = "eval_") -> dict:
    return {key[len(prefix):]: value for key, value in metrics.items() if key.startswith(prefix)}


def _assert_logged(logged: dict, want: dict, keys=LOGGED) -> None:
    for key in keys:
        assert logged[key] == pytest.approx(want[key], rel=REL), (key, logged[key], want[key])


def test_trainer_at_grad_accum_2_logs_the_whole_batch_objective(tok, tmp_path):
    from numloss import NumericVocab

    model = H.model(tok)
    initial = copy.deepcopy(model)
    dataset = H.rows(tok, 4)
    namespace = {"tokenizer": tok, "model": model, "dataset": dataset, "collator": _collator(tok),
                 "args": _args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               report_to=["tensorboard"])}
    exec(H.trainer_snippets()[0], namespace)  # docs/library.md's snippet, as a user runs it
    trainer = namespace["trainer"]
    logged = trainer.state.log_history[0]
    vocab = NumericVocab.from_tokenizer(tok, policy="digits")
    want = H.whole_batch_objective(initial, vocab, H.SPEC, _collator(tok)(copy.deepcopy(dataset)))
    _assert_logged(logged, want, TRAINED)
    # the Trainer's own reporters get the terms: TensorBoard's event file has them as train/term/*
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent)).Reload()
    assert {"train/ce", "train/term/smmd", "train/term/ntl_was"} <= set(events.Tags()["scalars"])
    assert events.Scalars("train/term/smmd")[0].value == pytest.approx(want["term/smmd"], rel=REL)
    # a split-dependent mean (each micro-batch divided by its own counts, then averaged) is not it
    halves = [H.whole_batch_objective(initial, vocab, H.SPEC, _collator(tok)(copy.deepcopy(dataset[i:i + 2])))
              for i in (0, 2)]
    assert abs(sum(h["loss"] for h in halves) / 2 - want["loss"]) > 100 * REL * want["loss"]
    # the updated weights moved: the loss trained the model
    assert any(not torch.equal(a, b) for a, b in zip(initial.parameters(), trainer.model.parameters()))
    # evaluation: the objective of the whole evaluated set at the new weights, at any eval batch size (5
    # rows: batches of 1, and of 4 + 1, whose own objectives weigh their numeric positions differently)
    evaluated = H.rows(tok, 5)
    trained = H.whole_batch_objective(trainer.model, vocab, H.SPEC, _collator(tok)(copy.deepcopy(evaluated)))
    for batch_size in (1, 4):
        trainer.args.per_device_eval_batch_size = batch_size
        _assert_logged(_unprefixed(trainer.evaluate(eval_dataset=evaluated)), trained)


def test_trainer_on_two_processes_logs_the_whole_batch_objective(tok, tmp_path):
    from numloss import NumericVocab

    from tests.distributed import run_ranks
    from tests.numloss.integrations.hf_trainer_ranks import launched_rank

    tok.save_pretrained(str(tmp_path / "tok"))
    # the script torchrun would run (hf_trainer_ranks.py), on pre-started ranks with torchrun's variables
    run_ranks(2, launched_rank, str(tmp_path / "tok"), str(tmp_path), timeout=300)
    logged = json.loads((tmp_path / "log_history.json").read_text())[0]
    initial = H.model(tok)
    initial.load_state_dict(torch.load(tmp_path / "init.pt"))
    vocab = NumericVocab.from_tokenizer(tok, policy="digits")
    want = H.whole_batch_objective(initial, vocab, H.SPEC, _collator(tok)(H.rows(tok, 4)))
    _assert_logged(logged, want, TRAINED)
    # the evaluation of 5 rows at batch 1 per rank (3 batches each: accelerate repeats a row on rank 1, which
    # counts once) is the whole set's objective at the trained weights
    trained = H.model(tok)
    trained.load_state_dict(torch.load(tmp_path / "trained.pt"))
    want = H.whole_batch_objective(trained, vocab, H.SPEC, _collator(tok)(H.rows(tok, 5)))
    _assert_logged(_unprefixed(json.loads((tmp_path / "eval.json").read_text())), want)


def test_sft_trainer_completion_only_equals_the_objective_on_its_labels(tok, tmp_path):
    from datasets import Dataset
    from trl import SFTConfig

    from numloss import NumericVocab

    model = H.model(tok)
    initial = copy.deepcopy(model)
    vocab = NumericVocab.from_tokenizer(tok, policy="digits")
    sft_config = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, logging_steps=1,
                           learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                           disable_tqdm=True, log_level="error", completion_only_loss=True,
                           bf16=False)  # SFTConfig defaults to bf16 (CPU autocast); the check is in fp32
    namespace = {"tokenizer": tok, "model": model, "vocab": vocab, "sft_config": sft_config,
                 "chat_dataset": Dataset.from_list(H.chat_rows(4))}
    exec(H.trainer_snippets()[1], namespace)
    trainer = namespace["trainer"]
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])  # TRL's own labels
    answers = [tok(a + "\n", add_special_tokens=False)["input_ids"] for _, a in H.PROBLEMS[:4]]
    for labels, answer in zip(batch["labels"].tolist(), answers):  # the prompt is masked out
        assert [t for t in labels if t != -100] == answer
    want = H.whole_batch_objective(initial, vocab, {"terms": {"ntl_was": {}}}, batch)
    logged = trainer.state.log_history[0]
    for key in ("loss", "ce", "term/ntl_was", "numeric_positions"):
        assert logged[key] == pytest.approx(want[key], rel=REL), (key, logged[key], want[key])
    assert "mean_token_accuracy" in logged  # TRL's own metrics are still logged


def test_zero_weights_leave_plain_ce_training_unchanged(tok, tmp_path):
    """Over 3 steps at accumulation 2: every term at weight 0 logs bit-identical losses and gradient
    norms and ends at bit-identical weights to the integration without terms; the stock Trainer's CE
    (F.cross_entropy: another formula and summation order, so ~1 ulp apart, which Adam then amplifies
    in weights whose gradient is near 0) logs the same losses within float rounding."""
    from transformers import Trainer

    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericTrainer

    base, dataset = H.model(tok), H.rows(tok, 8)
    vocab = NumericVocab.from_tokenizer(tok, policy="digits")
    zero = {"terms": {"smmd": {"weight": 0}, "ntl_was": {"weight": 0}, "dist2": {"weight": 0}}}
    runs = {}
    for name, objective in (("zero", zero), ("plain", None), ("stock", "stock")):
        kwargs = dict(model=copy.deepcopy(base), train_dataset=dataset, data_collator=_collator(tok),
                      args=_args(tmp_path / name, max_steps=3, per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2))
        trainer = (Trainer(**kwargs) if objective == "stock"
                   else NumericTrainer(**kwargs, numeric_vocab=vocab, objective=objective))
        trainer.train()
        runs[name] = ([(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h],
                      [p.detach().clone() for p in trainer.model.parameters()])
    assert len(runs["zero"][0]) == 3
    assert runs["zero"][0] == runs["plain"][0]
    assert all(torch.equal(a, b) for a, b in zip(runs["zero"][1], runs["plain"][1]))
    for (loss, norm), (stock_loss, stock_norm) in zip(runs["zero"][0], runs["stock"][0]):
        assert loss == pytest.approx(stock_loss, rel=1e-6) and norm == pytest.approx(stock_norm, rel=1e-5)


def test_importing_the_integration_imports_neither_transformers_nor_trl():
    code = ("import sys, numloss, numloss.integrations.hf_trainer as m; "
            "assert 'transformers' not in sys.modules and 'trl' not in sys.modules, "
            "[k for k in sys.modules if k.split('.')[0] in ('transformers', 'trl')][:3]; "
            "assert callable(m.numeric_trainer_class)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=H.REPO,
                   env={**os.environ, "PYTHONPATH": str(H.REPO)})


def test_refuses_a_compute_loss_func_and_a_non_trainer(tok, tmp_path):
    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericTrainer, numeric_trainer_class

    vocab = NumericVocab.from_tokenizer(tok, policy="digits")
    with pytest.raises(ValueError, match="compute_loss_func"):
        NumericTrainer(model=H.model(tok), args=_args(tmp_path), numeric_vocab=vocab, compute_loss_func=len)
    with pytest.raises(TypeError, match="not a transformers.Trainer"):
        numeric_trainer_class(dict)


def test_a_term_many_times_ce_is_named_before_the_first_optimizer_step(tmp_path, caplog):
    """NTL-WAS at its default weight over a Llama-3-style 'integers' vocabulary (0-999) on a random model:
    its first micro-batch's value, over that micro-batch's own counts (at accumulation 2 the step's counts
    are twice as large), is many times CE; the warning names it and the weight that would match, before
    the optimizer's first step, and training goes on."""
    from transformers import TrainerCallback

    from numloss import NumericVocab, Objective
    from numloss.integrations.hf_trainer import NumericTrainer
    from numloss.labels import shift_labels
    from recipes.experiments.tiny import train_tokenizer

    tok = train_tokenizer(["the sum is 731 and 12 of 998 and 405 . = +"], tmp_path / "tok", "groups3")
    rows = []
    for text in ("12+30=42", "500+499=999", "731+12=743", "998-405=593"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": ids})
    said_at_step: list[int] = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            said_at_step.append(sum("term ntl_was" in r.getMessage() for r in caplog.records))

    vocab = NumericVocab.from_tokenizer(tok, policy="integers")
    model = H.model(tok)
    initial = copy.deepcopy(model)
    trainer = NumericTrainer(model=model, args=_args(tmp_path / "out", per_device_train_batch_size=2,
                                                     gradient_accumulation_steps=2),
                             train_dataset=rows, data_collator=_collator(tok), numeric_vocab=vocab,
                             objective={"terms": {"ntl_was": {}}}, callbacks=[Watch()])
    with caplog.at_level("WARNING", logger="numloss.integrations.hf_trainer"):
        trainer.train()
    assert said_at_step == [1], said_at_step  # said once, before the first step ended
    line = next(r.getMessage() for r in caplog.records if "term ntl_was" in r.getMessage())
    # the first micro-batch (the Trainer's random sampler with seed 0 picks it) over its own counts
    first = trainer.get_train_dataloader()
    batch = next(iter(first))
    out = Objective(vocab, {"terms": {"ntl_was": {}}})(initial(input_ids=batch["input_ids"],
                                                               attention_mask=batch["attention_mask"]).logits,
                                                       shift_labels(batch["labels"]))
    ce, value = float(out.ce), float(out.terms["ntl_was"])
    assert 0.3 * value > 5 * ce, (ce, value)
    assert f"term ntl_was = {value:.4g} x weight 0.3" in line and f"weight {ce / value:.3g} would make" in line, line


@pytest.mark.parametrize("found,accepted", [("5.19.0", True), ("5.25.0", True), ("5.99.1", True), ("5.18.2", False),
                                            ("4.57.1", False), ("6.0.0", False)])
def test_the_transformers_version_floor_is_checked_when_the_trainer_is_made(tok, tmp_path, monkeypatch, found, accepted):
    """transformers 5.x from 5.19 (whose Trainer reads `loss_is_scaled_for_ga`): another version installed
    (the version lookup answering it) is refused by NumericTrainer before anything is built, naming it."""
    import importlib.metadata

    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericTrainer, check_transformers

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: found if name == "transformers" else real(name))
    if accepted:
        check_transformers()
        return
    with pytest.raises(RuntimeError, match=rf"needs transformers 5.x from 5.19 \(tested with 5.25.0\); found {found}"):
        NumericTrainer(model=H.model(tok), args=_args(tmp_path), train_dataset=H.rows(tok, 4),
                       data_collator=_collator(tok), numeric_vocab=NumericVocab.from_tokenizer(tok, policy="digits"))


def test_without_transformers_the_trainer_names_the_extra_to_install(monkeypatch):
    import importlib.metadata

    from numloss.integrations.hf_trainer import check_transformers

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ImportError, match=r"needs transformers: pip install -e '\.\[hf\]'"):
        check_transformers()
