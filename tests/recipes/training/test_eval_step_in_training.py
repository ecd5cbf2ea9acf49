"""The engine's forward without an update inside a training run (`Engine.eval_step`), both of its users at
once: the terms' scale against CE before step 1 (`recipes.training.scale_check`) and the held-out
evaluation every `eval.every` steps (`recipes.training.held_out`).

Through the loop of `python -m recipes.train` on 2 gloo ranks (pre-started: `tests.distributed.train_in_ranks`), on both engines, a tiny Llama whose attention has dropout
(so a forward left in eval mode, or one that moved the RNG, would change the training), SMMD at weight 200,
micro-batch 2 x grad_accum 2. Per engine two runs of 4 steps:

- checked: the scale check and `eval.every: 2`, exported, with TensorBoard;
- baseline: the scale check replaced by a no-op in the ranks' processes and no `eval.every`.

What they show:

- the training is unchanged: loss, ce, term/smmd and grad_norm of every step equal the baseline's, to the bit;
- rank 0 says once, before step 1, that SMMD at weight 200 is many times CE, with the weight that would make
  it equal CE; its CE is that of the first step's rows (both ranks, both micro-batches) at the starting
  weights without dropout, computed here with transformers in float64 (step 1 itself logs another: dropout);
  the baseline says nothing;
- the held-out values land in metrics.jsonl at steps 2 and 4 only (and in TensorBoard): at the last step they
  equal an independent computation on the exported model with transformers (CE over the held-out label
  tokens; the teacher-forced answers read with data_prep.answers: exact match, MAE, parse rate); whole
  evaluation batches only: 38 held-out rows at 2 x 2 per batch score 36;
- a resumed run (DeepSpeed; the loop decides, the same for every engine) does not say the scale again.

Neither feature moves the other's observable: the scale check runs before step 1 (the held-out evaluation
first runs after step 2, on weights the bitwise comparison shows equal to the baseline's), and the held-out
evaluation runs after step 1's update, when the scale line has been said.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from recipes.training.scale_check import WHERE

STEPS, EVERY, WEIGHT, MICRO, ACCUM, WORLD = 4, 2, 200.0, 2, 2, 2
HELD_OUT, SCORED = 38, 36  # MICRO x WORLD rows per evaluation batch: 9 whole batches
ENGINES = {"deepspeed": ["deepspeed.zero_stage=3"]}
if importlib.util.find_spec("megatron.core"):
    ENGINES["megatron"] = ["train.engine=megatron"]
TRAINING_KEYS = ("loss", "ce", "term/smmd", "grad_norm")
LINE = re.compile(r"term smmd = (\S+) x weight (\S+) = (\S+) is (\S+)x CE \((\S+)\) on (.*?): its scale, not its "
                  r"weight, will drive the update; weight (\S+) would make it equal CE")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    pytest.importorskip("deepspeed")
    from data_prep import BuildConfig, SourceConfig, TokenizeConfig, build
    from recipes.experiments.tiny import train_tokenizer
    from tests.recipes.torchrun_helpers import save_tiny_llama

    root = tmp_path_factory.mktemp("eval_step")
    train_tokenizer(["Calculate 0123456789 + - * / = . ( ) What is"], root / "tok", "digits")
    tokenize = TokenizeConfig(str(root / "tok"), template="plain", max_length=48)
    for name, n, seed in (("train", 64, 0), ("held_out", HELD_OUT, 1)):
        source = SourceConfig("arithmetic", options={"n": n, "max_digits": 2, "negatives": False, "seed": seed})
        build(BuildConfig(sources=[source], tokenize=tokenize), str(root / name), workers=0, progress=False)
    save_tiny_llama(root / "tok", root / "model", attention_dropout=0.1)
    recipe = {"name": "eval-step", "model": {"name_or_path": str(root / "model"), "dtype": "float32"},
              "data": {"train": str(root / "train"), "eval": str(root / "held_out")},
              "loss": {"objective": {"terms": {"smmd": {"weight": WEIGHT}}}},
              "optim": {"lr": 3e-3, "schedule": "constant"},
              "train": {"steps": STEPS, "save_every": 0, "progress": False, "seed": 3, "micro_batch_size": MICRO,
                        "grad_accum": ACCUM, "export": False, "tensorboard": False}}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return root, path


def without_the_scale_check(rank: int):
    """`train_in_ranks` hooks: the loop's `first_step_scale` replaced by one that runs no forward and says
    nothing (in this rank's process only), so the run trains as one without the check would."""
    import recipes.train

    recipes.train.first_step_scale = lambda *args, **kwargs: []


def _run(workspace, name: str, *overrides: str, check: bool = True) -> tuple[str, list[dict]]:
    """`python -m recipes.train`'s loop on WORLD pre-started ranks (`train_in_ranks`: the properties are
    numbers and lines said); (every rank's output, metrics rows)."""
    from tests.distributed import train_in_ranks
    from tests.recipes.torchrun_helpers import read_metrics

    root, recipe = workspace
    log = root / f"{name}.{len(list(root.glob(f'{name}.*.log')))}.log"
    outcomes = train_in_ranks(WORLD, [str(recipe), f"train.out_dir={root / name}", *overrides], log=log,
                              hooks=None if check else f"{__name__}:without_the_scale_check")
    output = log.read_text()
    assert all(o["error"] is None for o in outcomes), f"{name}: {outcomes}\n{output[-4000:]}"
    return output, read_metrics(root / name)


@pytest.fixture(scope="module", params=list(ENGINES))
def runs(request, workspace) -> dict:
    """One engine's runs: checked (scale check, eval.every, export, TensorBoard) and baseline (neither),
    each as (output, metrics rows); on DeepSpeed also the checked run resumed to one more step. The resume
    exports nothing and writes no TensorBoard, so the checked run's final/ and tb/ stay those of step 4."""
    engine = request.param
    found = {"engine": engine,
             "checked": _run(workspace, f"{engine}-checked", *ENGINES[engine], f"eval.every={EVERY}",
                             "train.export=true", "train.tensorboard=true"),
             "baseline": _run(workspace, f"{engine}-baseline", *ENGINES[engine], check=False)}
    if engine == "deepspeed":  # the loop decides, the same for every engine
        found["resumed"] = _run(workspace, f"{engine}-checked", *ENGINES[engine], f"train.steps={STEPS + 1}")
    return found


def _scale_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "term smmd" in line]


@pytest.mark.timeout(1500)
def test_the_training_is_unchanged_to_the_bit(runs):
    (_, checked), (_, baseline) = runs["checked"], runs["baseline"]
    assert [r["step"] for r in checked] == [r["step"] for r in baseline] == list(range(1, STEPS + 1))
    for a, b in zip(checked, baseline):
        for key in TRAINING_KEYS:
            assert a[key] == b[key], (runs["engine"], a["step"], key, a[key], b[key])


def _first_step_ce(recipe_path: Path) -> float:
    """CE over the label tokens of step 1's global batch (every rank's micro-batches, as the reader gives
    them) at the starting weights, in eval mode, with transformers in float64."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_prep.reader import ShardDataset
    from recipes.config import load_recipe

    recipe = load_recipe(str(recipe_path), [])
    model = AutoModelForCausalLM.from_pretrained(recipe.model.name_or_path, dtype=torch.float64).eval()
    pad_id = AutoTokenizer.from_pretrained(recipe.model.name_or_path).pad_token_id
    ce_sum, tokens = 0.0, 0
    for rank in range(WORLD):
        rows = ShardDataset(recipe.data.train, batch_size=MICRO, rank=rank, world_size=WORLD,
                            global_batch_size=MICRO * ACCUM * WORLD, seed=recipe.train.seed, shuffle=True,
                            drop_last=True, shuffle_window=recipe.data.shuffle_window, seq_len=recipe.data.seq_len,
                            pad_to_multiple_of=recipe.data.pad_to_multiple_of, pad_id=pad_id,
                            length_bucketing=recipe.data.length_bucketing)
        for _, batch in zip(range(ACCUM), rows):
            labels = batch["labels"][:, 1:]
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            keep = labels != -100
            ce_sum += float(torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum"))
            tokens += int(keep.sum())
    return ce_sum / tokens


@pytest.mark.timeout(1500)
def test_the_terms_scale_is_said_once_before_step_1(workspace, runs):
    _, recipe = workspace
    (output, checked), (quiet_output, baseline) = runs["checked"], runs["baseline"]
    lines = _scale_lines(output)
    assert len(lines) == 1, output[-4000:]  # rank 0 only, once
    assert not _scale_lines(quiet_output)
    value, weight, weighted, ratio, ce, where, matching = LINE.search(lines[0]).groups()
    value, weight, weighted, ratio, ce, matching = map(float, (value, weight, weighted, ratio, ce, matching))
    assert where == WHERE and weight == WEIGHT
    reference = _first_step_ce(recipe)
    assert abs(ce - reference) <= 0.5 * 10 ** (math.floor(math.log10(ce)) - 3) + 1e-6  # printed to 4 digits
    for run in (checked, baseline):  # step 1 itself trains under dropout: its CE is another
        assert abs(run[0]["ce"] - reference) > 1e-5 * reference
    assert weighted == pytest.approx(value * weight, rel=2e-3) and ratio == pytest.approx(weighted / ce, rel=2e-2)
    assert ratio > 5 and matching == pytest.approx(ce / value, rel=5e-3)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("runs", ["deepspeed"], indirect=True)  # the loop decides, the same for every engine
def test_a_resumed_run_does_not_say_it_again(runs):
    resumed, rows = runs["resumed"]
    assert f"resumed eval-step from step {STEPS}" in resumed
    assert [r["step"] for r in rows] == list(range(1, STEPS + 2))
    assert not _scale_lines(resumed)


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


@pytest.mark.timeout(1500)
def test_the_held_out_values_are_right_at_the_steps_asked_for(workspace, runs):
    root, _ = workspace
    engine, (_, checked), (_, baseline) = runs["engine"], runs["checked"], runs["baseline"]
    assert [r["step"] for r in checked] == list(range(1, STEPS + 1))
    for a, b in zip(checked, baseline):
        assert ("eval/loss" in a) == (a["step"] % EVERY == 0) and "eval/loss" not in b

    last = checked[-1]
    expected = _reference(root / f"{engine}-checked" / "final", root / "held_out")
    assert last["eval/n"] == SCORED == expected["eval/n"] < HELD_OUT
    assert last["eval/ce"] == pytest.approx(expected["eval/ce"], rel=1e-5)
    assert last["eval/loss"] > last["eval/ce"]  # CE + smmd
    for key in ("eval/exact_match", "eval/parse_rate"):
        assert last[key] == pytest.approx(expected[key], abs=1e-12), key
    if expected["eval/mae"] is None:
        assert last["eval/mae"] is None
    else:
        assert last["eval/mae"] == pytest.approx(expected["eval/mae"], rel=1e-9)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(root / f"{engine}-checked" / "tb"))
    events.Reload()
    assert [s.step for s in events.Scalars("eval/loss")] == [EVERY, STEPS]
    assert events.Scalars("eval/loss")[-1].value == pytest.approx(last["eval/loss"], rel=1e-6)
