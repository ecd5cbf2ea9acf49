"""Each term's scale against CE before a run's first update (`recipes.training.scale_check`).

Through `python -m recipes.train` on 2 gloo ranks, on both engines, with a tiny Llama whose attention has
dropout (so a forward left in eval mode, or one that moved the RNG, would change the training):

- rank 0 says once, before step 1, that SMMD at weight 200 is many times CE, with the weight that would make
  it equal CE; its CE is that of the first step's rows (both ranks, both micro-batches) at the starting
  weights without dropout, computed here with transformers in float64 (step 1 itself logs another: dropout);
- the training is unchanged: loss, ce, term/smmd and grad_norm of steps 1-2 equal those of the same run with
  the check replaced by a no-op (`scale_check_off/sitecustomize.py`, which also shows the line is gone), to
  the bit;
- a resumed run (DeepSpeed) does not say it again.

In one process: a CE-only recipe (or a term at weight 0, or rescaled to CE) runs no forward; an engine that
cannot run a forward outside a step (`eval_problem`) leaves it to step 1's logged row; `scale_advice`'s line.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch
import yaml

from numloss import ObjectiveConfig
from recipes.config import Recipe
from recipes.training.scale_check import WHERE, first_step_scale, scale_advice

STEPS, WEIGHT, MICRO, ACCUM, WORLD = 2, 200.0, 2, 2, 2
ENGINES = {"deepspeed": ["deepspeed.zero_stage=3"]}
if importlib.util.find_spec("megatron.core"):
    ENGINES["megatron"] = ["train.engine=megatron"]
TRAINING_KEYS = ("loss", "ce", "term/smmd", "grad_norm")
CHECK_OFF = Path(__file__).parent / "scale_check_off"
LINE = re.compile(r"term smmd = (\S+) x weight (\S+) = (\S+) is (\S+)x CE \((\S+)\) on (.*?): its scale, not its "
                  r"weight, will drive the update; weight (\S+) would make it equal CE")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    pytest.importorskip("deepspeed")
    from data_prep import BuildConfig, SourceConfig, TokenizeConfig, build
    from recipes.experiments.tiny import train_tokenizer
    from tests.recipes.torchrun_helpers import save_tiny_llama

    root = tmp_path_factory.mktemp("scale_check")
    train_tokenizer(["Calculate 0123456789 + - * / = . ( ) What is"], root / "tok", "digits")
    tokenize = TokenizeConfig(str(root / "tok"), template="plain", max_length=48)
    source = SourceConfig("arithmetic", options={"n": 64, "max_digits": 2, "negatives": False, "seed": 0})
    build(BuildConfig(sources=[source], tokenize=tokenize), str(root / "train"), workers=0, progress=False)
    save_tiny_llama(root / "tok", root / "model", attention_dropout=0.1)
    recipe = {"name": "scale-check", "model": {"name_or_path": str(root / "model"), "dtype": "float32"},
              "data": {"train": str(root / "train")},
              "loss": {"objective": {"terms": {"smmd": {"weight": WEIGHT}}}},
              "optim": {"lr": 3e-3, "schedule": "constant"},
              "train": {"steps": STEPS, "save_every": 0, "progress": False, "seed": 3, "micro_batch_size": MICRO,
                        "grad_accum": ACCUM, "export": False, "tensorboard": False}}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return root, path


def _run(workspace, name: str, *overrides: str, site: Path | None = None) -> tuple[str, list[dict]]:
    from tests.recipes.torchrun_helpers import launch, read_metrics

    root, recipe = workspace
    proc = launch(recipe, root / name, *overrides, nproc=WORLD, site=site)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{name}:\n{output[-4000:]}"
    return output, read_metrics(root / name)


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
@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_terms_scale_is_said_before_step_1_and_the_training_is_unchanged(workspace, engine):
    root, recipe = workspace
    output, checked = _run(workspace, f"{engine}-checked", *ENGINES[engine])
    quiet_output, unchecked = _run(workspace, f"{engine}-unchecked", *ENGINES[engine], site=CHECK_OFF)

    lines = [line for line in output.splitlines() if "term smmd" in line]
    assert len(lines) == 1, output[-4000:]  # rank 0 only, once
    assert not [line for line in quiet_output.splitlines() if "term smmd" in line]
    value, weight, weighted, ratio, ce, where, matching = LINE.search(lines[0]).groups()
    value, weight, weighted, ratio, ce, matching = map(float, (value, weight, weighted, ratio, ce, matching))
    assert where == WHERE and weight == WEIGHT
    reference = _first_step_ce(recipe)
    assert abs(ce - reference) <= 0.5 * 10 ** (math.floor(math.log10(ce)) - 3) + 1e-6  # printed to 4 digits
    for run in (checked, unchecked):  # step 1 itself trains under dropout: its CE is another
        assert abs(run[0]["ce"] - reference) > 1e-5 * reference
    assert weighted == pytest.approx(value * weight, rel=2e-3) and ratio == pytest.approx(weighted / ce, rel=2e-2)
    assert ratio > 5 and matching == pytest.approx(ce / value, rel=5e-3)

    assert [r["step"] for r in checked] == [r["step"] for r in unchecked] == list(range(1, STEPS + 1))
    for a, b in zip(checked, unchecked):
        for key in TRAINING_KEYS:
            assert a[key] == b[key], (engine, a["step"], key, a[key], b[key])

    if engine == "deepspeed":  # the loop decides, the same for every engine
        resumed, rows = _run(workspace, f"{engine}-checked", *ENGINES[engine], f"train.steps={STEPS + 1}")
        assert "resumed scale-check from step 2" in resumed
        assert [r["step"] for r in rows] == list(range(1, STEPS + 2))
        assert not [line for line in resumed.splitlines() if "term smmd" in line]


class _Engine:
    """Only what `first_step_scale` may ask before it runs a forward."""

    def __init__(self, problem: str | None = None):
        self.problem, self.forwards = problem, 0

    def eval_problem(self):
        return self.problem

    def eval_step(self, window, answers=True):
        self.forwards += 1
        raise AssertionError("no forward expected")


@pytest.mark.parametrize("terms", [{}, {"smmd": {"weight": 0}}, {"smmd": {"rescale_to_ce": True}}])
def test_no_forward_when_no_term_can_be_named(terms):
    recipe = Recipe(name="r")
    recipe.loss.objective = ObjectiveConfig.from_dict({"terms": terms})
    engine = _Engine()
    assert first_step_scale(recipe, engine, [], torch.device("cpu")) == [] and engine.forwards == 0


def test_an_engine_without_a_forward_outside_a_step_leaves_it_to_step_1():
    recipe = Recipe(name="r")
    recipe.loss.objective = ObjectiveConfig.from_dict({"terms": {"smmd": {}}})
    engine = _Engine(problem="no forward outside a training step")
    assert first_step_scale(recipe, engine, [], torch.device("cpu")) is None and engine.forwards == 0


def test_scale_advice_names_a_term_many_times_ce():
    recipe = Recipe(name="r")
    recipe.loss.objective = ObjectiveConfig.from_dict({"terms": {"ntl_was": {}, "smmd": {}}})
    values = {"ce": 10.0, "term/ntl_was": 200.0, "term/smmd": 1.0}
    lines = scale_advice(recipe, values, "step 1's global batch")
    assert len(lines) == 1 and "term ntl_was = 200 x weight 0.3 = 60 is 6.0x CE (10)" in lines[0]
    assert "weight 0.05 would make it equal CE" in lines[0] and "on step 1's global batch:" in lines[0]
    assert scale_advice(recipe, {**values, "term/ntl_was": 100.0}, "step 1's global batch") == []
