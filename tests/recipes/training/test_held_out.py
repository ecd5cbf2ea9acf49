"""Evaluation during training (`eval.every`, recipes.training.held_out) on both engines, 2 gloo ranks on CPU:

- the training is unchanged: loss, ce, terms and gradient norm of every step equal the run without it, to the bit;
- the held-out values land in metrics.jsonl at the steps asked for (and in TensorBoard): at the last step they
  equal an independent computation on the exported model with transformers (CE over the held-out label
  tokens; the teacher-forced answers read with data_prep.answers: exact match, MAE, parse rate);
- whole global batches only: 36 held-out rows at 4 x 2 per global batch score 32.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import yaml

pytest.importorskip("deepspeed")

from tests.recipes.torchrun_helpers import launch, read_metrics, save_tiny_llama  # noqa: E402

STEPS, EVERY, HELD_OUT, SCORED = 4, 2, 36, 32
ENGINES = {"deepspeed": ["deepspeed.zero_stage=3"]}
if importlib.util.find_spec("megatron.core"):
    ENGINES["megatron"] = ["train.engine=megatron"]
TRAINING_KEYS = ("loss", "ce", "term/smmd", "grad_norm")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from data_prep import BuildConfig, SourceConfig, TokenizeConfig, build
    from recipes.experiments.tiny import train_tokenizer

    root = tmp_path_factory.mktemp("held_out")
    train_tokenizer(["Calculate 0123456789 + - * / = . ( ) What is"], root / "tok", "digits")
    tokenize = TokenizeConfig(str(root / "tok"), template="plain", max_length=48)
    for name, n, seed in (("train", 64, 0), ("held_out", HELD_OUT, 1)):
        source = SourceConfig("arithmetic", options={"n": n, "max_digits": 2, "negatives": False, "seed": seed})
        build(BuildConfig(sources=[source], tokenize=tokenize), str(root / name), workers=0, progress=False)
    save_tiny_llama(root / "tok", root / "model")
    recipe = {"name": "held-out", "model": {"name_or_path": str(root / "model"), "dtype": "float32"},
              "data": {"train": str(root / "train"), "eval": str(root / "held_out")},
              "loss": {"objective": {"terms": {"smmd": {}}}},
              "optim": {"lr": 3e-3, "schedule": "constant"},
              "train": {"steps": STEPS, "save_every": 0, "progress": False, "seed": 3, "micro_batch_size": 4,
                        "grad_accum": 1}}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return root, path


def _run(workspace, name: str, *overrides: str) -> list[dict]:
    root, recipe = workspace
    proc = launch(recipe, root / name, *overrides, nproc=2)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{name}:\n{output[-4000:]}"
    return read_metrics(root / name)


def _reference(model_dir, held_out) -> dict:
    """CE and the teacher-forced answers' metrics of the first SCORED held-out rows, with transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_prep.answers import parse_answer
    from recipes.evaluation.evaluate import load_rows

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ce_sum, tokens, hits, parsed, errors = 0.0, 0, 0, 0, 0.0
    rows = load_rows(str(held_out), limit=SCORED)
    for r in rows:
        ids = torch.tensor([r["input_ids"]])
        labels = torch.tensor(r["labels"][1:])
        with torch.no_grad():
            logits = model(ids).logits[0, :-1]
        keep = labels != -100
        ce_sum += float(torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum"))
        tokens += int(keep.sum())
        value = parse_answer(tok.decode(logits[keep].argmax(-1).tolist(), skip_special_tokens=True))
        if value is not None:
            parsed += 1
            errors += abs(value - r["answer"])
            hits += math.isclose(value, r["answer"], abs_tol=1e-9)
    return {"eval/ce": ce_sum / tokens, "eval/exact_match": hits / len(rows), "eval/parse_rate": parsed / len(rows),
            "eval/mae": errors / parsed if parsed else None, "eval/n": len(rows)}


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_held_out_evaluation_leaves_the_training_unchanged_and_is_right(workspace, engine):
    root, _ = workspace
    plain = _run(workspace, f"{engine}-plain", *ENGINES[engine], "train.export=false", "train.tensorboard=false")
    evaluated = _run(workspace, f"{engine}-eval", *ENGINES[engine], f"eval.every={EVERY}", "train.export=true")
    assert [r["step"] for r in plain] == [r["step"] for r in evaluated] == list(range(1, STEPS + 1))
    for a, b in zip(plain, evaluated):
        for key in TRAINING_KEYS:
            assert a[key] == b[key], (engine, a["step"], key, a[key], b[key])
        assert ("eval/loss" in b) == (b["step"] % EVERY == 0) and "eval/loss" not in a

    last = evaluated[-1]
    expected = _reference(root / f"{engine}-eval" / "final", root / "held_out")
    assert last["eval/n"] == SCORED == expected["eval/n"]
    assert last["eval/ce"] == pytest.approx(expected["eval/ce"], rel=1e-5)
    assert last["eval/loss"] > last["eval/ce"]  # CE + smmd
    for key in ("eval/exact_match", "eval/parse_rate"):
        assert last[key] == pytest.approx(expected[key], abs=1e-12), key
    if expected["eval/mae"] is None:
        assert last["eval/mae"] is None
    else:
        assert last["eval/mae"] == pytest.approx(expected["eval/mae"], rel=1e-9)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / f"{engine}-eval" / "tb"))
    events.Reload()
    assert [s.step for s in events.Scalars("eval/loss")] == [EVERY, STEPS]
    assert events.Scalars("eval/loss")[-1].value == pytest.approx(last["eval/loss"], rel=1e-6)


def _argmax_ranks(rank, world):
    import torch.distributed as dist

    from recipes.training.held_out import vocab_parallel_argmax

    torch.manual_seed(0)
    full = torch.randint(-3, 4, (3, 5, 11)).float()  # small integers: many ties across the two ranks' columns
    full[0, 0, 10] = 100.0  # a padded column: never the answer
    widths = [6, 5]  # uneven split, ranks in order
    start = sum(widths[:rank])
    local = full[..., start:start + widths[rank]]
    got = vocab_parallel_argmax(local, group=dist.group.WORLD, real_vocab_size=10)
    assert torch.equal(got, full[..., :10].argmax(-1)), (got, full[..., :10].argmax(-1))


def test_vocab_parallel_argmax_equals_torch_argmax_over_the_whole_vocabulary():
    from tests.distributed import run_ranks

    run_ranks(2, _argmax_ranks)


def test_answer_tokens_and_sums():
    from types import SimpleNamespace

    from recipes.training.held_out import answer_sums, answer_tokens

    labels = torch.tensor([[-100, -100, 5, 6], [-100, 7, 8, -100]])
    predicted = torch.tensor([[0, 1, 5, 9], [3, 7, 4, 2]])
    assert answer_tokens(predicted, labels) == [[5, 9], [7, 4]]
    words = {1: "12", 2: "1,200", 3: "x", 4: "-3/4"}
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(words[i] for i in ids))
    # "12" right, "1,200" read as 1200 against 1000, "x" no number, "-3/4" right, a row without an answer
    sums = answer_sums([[1], [2], [3], [4], [1]], [12.0, 1000.0, 5.0, -0.75, float("nan")], tok)
    assert sums == {"n": 4.0, "hits": 2.0, "parsed": 3.0, "abs_error": 200.0}
