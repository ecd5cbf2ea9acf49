"""Mixture-of-experts through the whole Megatron engine: `recipes.train`'s loop on pre-started gloo ranks
(`tests.distributed.train_in_ranks`; fp32; 2 each, one resume on 4) on a tiny random Qwen3-MoE and a tiny Mixtral (hidden 64, 2 layers, 4 experts, top-2, routers
with random weights so every expert is used; `test_moe.save_moe`), CE + SMMD + NTL-WAS on arithmetic rows
of 16-32 tokens, 8 rows a step, Adam at lr 3e-3.

| run       | model     | ranks | layout                       | micro x accum | steps | what it shows                    |
|-----------|-----------|-------|------------------------------|---------------|-------|----------------------------------|
| q_ep2     | qwen3_moe | 2     | EP 2 (DP 2)                  | 1 x 4         | 1-3   | the uninterrupted run, export    |
| q_tp2_sp  | qwen3_moe | 2     | TP 2 + SP (DP 1)             | 1 x 8         | 1-3   | another layout, export           |
| q_stopped | qwen3_moe | 2     | EP 2 (DP 2)                  | 1 x 4         | 1     | saved at step 1, stopped         |
| q_to_ep1  | qwen3_moe | 2     | EP 1 (DP 2)                  | 1 x 4         | 2-3   | q_stopped's step 1 at another EP |
| q_stopped | qwen3_moe | 4     | EP 2, DP 4 (expert-DP 2)     | 1 x 2         | 2-4   | = q_ep2; step 4: q_ep2's export  |
| q_tp2_ep2 | qwen3_moe | 4     | TP 2 + SP, EP 2 (DP 2)       | 1 x 4         | 1-3   | EP x TP (expert-TP 2) = q_ep2    |
| q_pp2_ep2 | qwen3_moe | 4     | PP 2, EP 2 (DP 2)            | 1 x 4         | 1-3   | EP x PP = q_ep2                  |
| m_ep2     | mixtral   | 2     | EP 2 (DP 2)                  | 2 x 2         | 1-3   | the run, export                  |
| m_tp2_sp  | mixtral   | 2     | TP 2 + SP (DP 1)             | 2 x 4         | 1-4   | another layout; m_ep2's export   |

router/aux is a mean over micro-batches of a per-micro-batch value, so runs compared step by step deal the
same micro-batches: one row each for Qwen3-MoE (any DP size), two for Mixtral.

Checked: every metrics row carries `router/aux` (> 0) and `loss` = CE + Σ weight x term + router/aux; step 1
of every run equals an independent computation on the HF model (its logits through numloss's objective
with the step's global counts, its router logits through the router/aux definition written out in
`test_moe.router_aux_reference`, on the micro-batches the run's reader dealt to each data-parallel rank;
loss, CE, terms, router/aux and the gradient norm of their sum within 1e-5); EP 2 and TP 2 + SP log the
same curve; the final export is an HF directory with the initial checkpoint's keys and shapes, every
tensor trained, and the HF model loaded from it reproduces what the engine logs on the next step (the
loss, CE, router/aux and gradient norm of step 4 on step 4's rows, computed from the exported weights,
equal the step-4 row of a run that continued from the same weights: for Qwen3-MoE the resumed run,
1e-5; for Mixtral the TP 2 + SP run, whose step-3 weights differ from EP 2's by the layouts' rounding:
1e-5 on the values, 1e-4 on the norm). A run stopped after its step-1 checkpoint (written by 2 ranks at
EP 2) and resumed on 4 (DP 4: each expert's weights and Adam state now on 2 expert-data-parallel ranks)
logs the uninterrupted run's steps 2 and 3 within 1e-6 (step 3's loss reads step 2's update, which used
the restored Adam moments; measured 5e-8; resumed at the saving layout it is the same to the bit,
measured by hand at DP 2 and DP 4). A copy of that step-1 directory resumed at another expert-parallel
size (EP 1 on the same 2 ranks: every expert, its weights and Adam moments, now whole on each rank,
gathered from the two EP 2 shards) logs the same steps 2 and 3 within 1e-6.

The layout refusals `recipes.validate` (exit 2) and preflight (`recipes.train`, before any model is built)
give for an MoE model: TP > 1 without sequence parallelism (megatron-core builds no MoE layer under it),
EP not dividing the experts or the data-parallel size.

The runs are made once (module fixture); the tests read them.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

if importlib.util.find_spec("megatron.core") is None:
    raise ImportError("tests/recipes/engines/megatron needs megatron-core (pip install -e '.[megatron]')")

from tests.recipes.engines.megatron.runtime.test_moe import MIXTRAL, QWEN3_MOE, router_aux_reference, save_moe  # noqa: E402
from tests.distributed import train_in_ranks  # noqa: E402
from tests.recipes.torchrun_helpers import read_metrics  # noqa: E402

TERMS = {"smmd": 3.0, "ntl_was": 0.3}  # weights: the logged loss is CE + Σ weight x term + router/aux
MODELS = {"qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}
EP2 = ("megatron.ep_size=2", "train.micro_batch_size=2", "train.grad_accum=2")
TP2_SP = ("megatron.tp_size=2", "megatron.sequence_parallel=true", "train.micro_batch_size=2", "train.grad_accum=4")
Q_EP2 = ("megatron.ep_size=2", "train.micro_batch_size=1", "train.grad_accum=4")
Q_TP2_SP = ("megatron.tp_size=2", "megatron.sequence_parallel=true", "train.micro_batch_size=1", "train.grad_accum=8")
# name: (model, data-parallel size, overrides)
RUNS = {
    "q_ep2": ("qwen3_moe", 2, (*Q_EP2, "train.steps=3", "train.export=true")),
    "q_tp2_sp": ("qwen3_moe", 1, (*Q_TP2_SP, "train.steps=3", "train.export=true")),
    "m_ep2": ("mixtral", 2, (*EP2, "train.steps=3", "train.export=true")),
    "m_tp2_sp": ("mixtral", 1, (*TP2_SP, "train.steps=4", "train.export=false")),
}
# on 4 ranks: EP composed with TP (the experts' TP is the model's: expert-TP 2, expert-DP 1) and with PP
WIDE_RUNS = {
    "q_tp2_ep2": ("qwen3_moe", 2, ("megatron.tp_size=2", "megatron.sequence_parallel=true", *Q_EP2, "train.steps=3")),
    "q_pp2_ep2": ("qwen3_moe", 2, ("megatron.pp_size=2", *Q_EP2, "train.steps=3")),
}
FIRST_STEP = ("q_ep2", "q_tp2_sp", "m_ep2", "m_tp2_sp", *WIDE_RUNS)


def _run(root: Path, name: str, model: str, *overrides: str, nproc: int = 2) -> dict:
    """`recipes.train`'s loop on `nproc` pre-started ranks into root/<name> (`train_in_ranks`: what is
    checked is numbers and what the run says); returns its status (0, or 1 with the ranks' errors appended
    to the output) and every rank's output."""
    log = root / f"{name}.{len(list(root.glob(f'{name}.*.log')))}.log"
    outcomes = train_in_ranks(nproc, [str(root / "recipe.yaml"), f"train.out_dir={root / name}",
                                      f"model.name_or_path={root / model}", *overrides], log=log, timeout=300)
    errors = "".join(f"\nrank {r}: {o['error']}: {o['message']}" for r, o in enumerate(outcomes) if o["error"])
    return {"code": 1 if errors else 0, "output": log.read_text() + errors}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from data_prep import BuildConfig, SourceConfig, TokenizeConfig, build
    from recipes.experiments.tiny import train_tokenizer

    root = tmp_path_factory.mktemp("moe_engine")
    tok = train_tokenizer(["Calculate 0123456789 + - * / = . ( ) What is"], root / "tok", "digits")
    source = SourceConfig("arithmetic", options={"n": 64, "max_digits": 3, "negatives": False})
    build(BuildConfig(sources=[source], tokenize=TokenizeConfig(str(root / "tok"), template="plain", max_length=48)),
          str(root / "data"), workers=0, progress=False)
    for kind, config in MODELS.items():
        save_moe(kind, {**config, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id}, root / kind)
        tok.save_pretrained(str(root / kind))
    recipe = {"name": "moe-engine", "model": {"name_or_path": "set per run", "dtype": "float32"},
              "data": {"train": str(root / "data"), "shuffle_window": 64},
              "loss": {"objective": {"terms": {k: {"weight": w} for k, w in TERMS.items()}}},
              "optim": {"lr": 3e-3, "schedule": "constant", "grad_clip": 100.0},
              "train": {"engine": "megatron", "save_every": 0, "progress": False, "seed": 7, "tensorboard": False}}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))

    out = {"root": root}
    for name, (model, _, overrides) in RUNS.items():
        out[name] = _run(root, name, model, *overrides)
        assert out[name]["code"] == 0, f"{name}:\n{out[name]['output'][-4000:]}"
    for name, (model, _, overrides) in WIDE_RUNS.items():
        out[name] = _run(root, name, model, *overrides, "train.export=false", nproc=4)
        assert out[name]["code"] == 0, f"{name}:\n{out[name]['output'][-4000:]}"
    # stopped after its step-1 checkpoint; a copy resumed at EP 1, the run itself on 4 ranks (another
    # data-parallel size and split of the same global batch, the same one-row micro-batches)
    out["q_stopped_1"] = _run(root, "q_stopped", "qwen3_moe", *Q_EP2, "train.steps=1", "train.export=false")
    assert out["q_stopped_1"]["code"] == 0, out["q_stopped_1"]["output"][-4000:]
    out["q_stopped_1"]["rows"] = read_metrics(root / "q_stopped")
    shutil.copytree(root / "q_stopped", root / "q_to_ep1", ignore=shutil.ignore_patterns("*lock*"))
    out["q_to_ep1"] = _run(root, "q_to_ep1", "qwen3_moe", "megatron.ep_size=1", "train.micro_batch_size=1",
                           "train.grad_accum=4", "train.steps=3", "train.export=false")
    out["q_stopped"] = _run(root, "q_stopped", "qwen3_moe", "megatron.ep_size=2", "train.micro_batch_size=1",
                            "train.grad_accum=2", "train.steps=4", "train.export=false", nproc=4)
    for name in ("q_to_ep1", "q_stopped"):
        assert out[name]["code"] == 0, out[name]["output"][-4000:]
    for name in (*RUNS, *WIDE_RUNS, "q_to_ep1", "q_stopped"):
        out[name]["rows"] = read_metrics(root / name)
    return out


def hf_step(run_dir: Path, dp: int, step: int, model_dir: Path | None = None) -> dict[str, float]:
    """The reference for step `step` of the run in `run_dir` (its recipe.yaml; `dp` data-parallel ranks),
    on the HF model in `model_dir` (default: the recipe's): the micro-batches the run's reader deals each
    rank for that step (as `recipes.train` reads them), numloss's objective of each on the HF logits with
    the step's global counts, router/aux = the mean over the step's micro-batches of
    `router_aux_reference` on its real tokens, the loss = their sum, and the gradient norm of that loss
    over every HF parameter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_prep.reader import ShardDataset
    from numloss import NumericVocab, Objective
    from numloss.normalization import LossCounts
    from recipes.config import load_recipe

    recipe = load_recipe(str(run_dir / "recipe.yaml"), [])
    t, d = recipe.train, recipe.data
    path = str(model_dir or recipe.model.name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    tok = AutoTokenizer.from_pretrained(path)
    objective = Objective(NumericVocab.from_tokenizer(tok, policy=recipe.loss.numeric_policy,
                                                      vocab_size=model.config.vocab_size), recipe.loss.objective)
    window = []
    for rank in range(dp):
        reader = iter(ShardDataset(d.train, batch_size=t.micro_batch_size, rank=rank, world_size=dp, seed=t.seed,
                                   global_batch_size=t.micro_batch_size * t.grad_accum * dp,
                                   shuffle_window=d.shuffle_window, seq_len=d.seq_len,
                                   pad_to_multiple_of=d.pad_to_multiple_of, pad_id=tok.pad_token_id,
                                   length_bucketing=d.length_bucketing))
        batches = [next(reader) for _ in range(step * t.grad_accum)]
        window += batches[-t.grad_accum:]
    counts = LossCounts.total(objective.counts(b["labels"][:, 1:]) for b in window)
    coeff = model.config.router_aux_loss_coef if recipe.loss.router_aux_coeff is None else recipe.loss.router_aux_coeff
    loss, aux = 0.0, 0.0
    values = {"ce": 0.0, **{f"term/{k}": 0.0 for k in TERMS}}
    for b in window:
        out = model(b["input_ids"], attention_mask=b["attention_mask"], output_router_logits=True)
        part = objective(out.logits[:, :-1], b["labels"][:, 1:], counts=counts)
        loss = loss + part.loss
        values["ce"] += float(part.ce)
        for k in TERMS:
            values[f"term/{k}"] += float(part.terms[k])
        aux = aux + router_aux_reference(out.router_logits, b["attention_mask"], coeff,
                                         model.config.num_experts_per_tok) / len(window)
    (loss + aux).backward()
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None))
    return {**values, "loss": float(loss + aux), "router/aux": float(aux), "grad_norm": float(norm)}


def _dp(name: str) -> int:
    """The data-parallel size of the run's last launch (the one its recipe.yaml describes)."""
    runs = {**RUNS, **WIDE_RUNS}
    return runs[name][1] if name in runs else 4


def _close(got: dict, want: dict, keys, rel: float, where: str) -> None:
    for key in keys:
        assert got[key] == pytest.approx(want[key], rel=rel), f"{where} {key}: {got[key]} != {want[key]}"


# ---- end to end ----------------------------------------------------------------------------------------


def test_every_row_logs_router_aux_and_the_loss_includes_it(runs):
    for name in (*RUNS, *WIDE_RUNS, "q_stopped"):
        rows = runs[name]["rows"]
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), name
        for row in rows:
            objective = row["ce"] + sum(w * row[f"term/{k}"] for k, w in TERMS.items())
            assert row["router/aux"] > 0, (name, row["step"])
            assert row["loss"] == pytest.approx(objective + row["router/aux"], rel=1e-6), (name, row["step"])  # fp32 sums
            assert row["term/ntl_was"] > 0 and row["numeric_positions"] > 0, (name, row["step"])
    output = runs["q_ep2"]["output"]
    assert "megatron MoE: 4 experts, top-2, EP 2, dispatcher allgather, router/aux coeff 0.05, dropless" in output
    assert "'expert_parallel': 2" in output and "'data_parallel': 2" in output
    assert "'tensor_parallel': 2" in runs["m_tp2_sp"]["output"] and "'sequence_parallel': True" in runs["m_tp2_sp"]["output"]


@pytest.mark.parametrize("name", FIRST_STEP)
def test_step_one_equals_the_hf_reference(runs, name):
    model = {**RUNS, **WIDE_RUNS}[name][0]
    want = hf_step(runs["root"] / name, _dp(name), 1, runs["root"] / model)
    got = runs[name]["rows"][0]
    assert want["router/aux"] > 0.05  # two layers, each >= coeff 0.05 x (1 when balanced)
    _close(got, want, ("loss", "ce", "router/aux", "grad_norm", *(f"term/{k}" for k in TERMS)), 1e-5, name)


@pytest.mark.parametrize("family", ["q", "m"])
def test_ep2_and_tp2_sp_log_the_same_curve(runs, family):
    """Step 1 within 1e-5; steps 2-3 read Adam's first updates, which amplify the layouts' rounding (TP
    splits the matmuls' sums; measured up to 5e-6 on the norm): 1e-4."""
    ep2, tp2 = runs[f"{family}_ep2"]["rows"], runs[f"{family}_tp2_sp"]["rows"]
    assert ep2[-1]["loss"] < ep2[0]["loss"]  # it trains
    for a, b in zip(ep2, tp2):
        keys = ("loss", "ce", "router/aux", "grad_norm", "term/smmd", "numeric_positions", "lr")
        _close(b, a, keys, 1e-5 if a["step"] == 1 else 1e-4, f"{family} step {a['step']}")


@pytest.mark.parametrize("name", WIDE_RUNS)
def test_ep_composed_with_tp_or_pp_logs_the_ep2_curve(runs, name):
    """EP 2 with TP 2 + SP (expert-TP 2) or with PP 2, on 4 ranks, against EP 2 alone on 2: step 1
    within 1e-5, steps 2-3 (after Adam's first updates, which amplify the layouts' rounding) 1e-4."""
    ep2, wide = runs["q_ep2"]["rows"], runs[name]["rows"]
    assert len(wide) == 3
    assert "'expert_parallel': 2" in runs[name]["output"] and "'data_parallel': 2" in runs[name]["output"]
    for a, b in zip(ep2, wide):
        keys = ("loss", "ce", "router/aux", "grad_norm", "term/smmd", "numeric_positions", "lr")
        _close(b, a, keys, 1e-5 if a["step"] == 1 else 1e-4, f"{name} step {a['step']}")


@pytest.mark.parametrize("family, continued", [("q", "q_stopped"), ("m", "m_tp2_sp")])
def test_the_export_gives_the_engines_next_step(runs, family, continued):
    """The EP 2 run's final/ (after step 3): the initial checkpoint's keys and shapes, every tensor
    trained; in transformers it computes the step-4 row of a run that continued from the same weights
    (see the module docstring for the tolerances)."""
    from safetensors.torch import load_file

    root = runs["root"]
    final = root / f"{family}_ep2" / "final"
    model = RUNS[f"{family}_ep2"][0]

    def tensors(directory: Path) -> dict:
        return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    exported, initial = tensors(final), tensors(root / model)
    assert set(exported) == set(initial)
    for key, value in exported.items():
        assert value.shape == initial[key].shape, key
        assert not torch.equal(value, initial[key]), f"{key} did not train"
    want = hf_step(root / continued, _dp(continued), 4, final)
    got = runs[continued]["rows"][3]
    assert got["step"] == 4
    _close(got, want, ("loss", "ce", "router/aux", "term/smmd"), 1e-5, f"{continued} step 4")
    _close(got, want, ("grad_norm",), 1e-5 if continued == "q_stopped" else 1e-4, f"{continued} step 4")



def test_the_tp2_sp_export_equals_the_ep2_export(runs):
    """The same training at another layout: the exports agree within 1e-4. Adam's first steps divide each
    gradient element by its own size, so an element whose gradient is near zero (a rarely routed expert's)
    moves by about lr whatever its rounding: measured, one element of an expert's gate 4.7e-5 apart, all
    others within 1e-5, where three steps at lr 3e-3 moved the weights by up to 9e-3."""
    from transformers import AutoModelForCausalLM

    root = runs["root"]
    ep2 = AutoModelForCausalLM.from_pretrained(str(root / "q_ep2" / "final")).state_dict()
    tp2 = AutoModelForCausalLM.from_pretrained(str(root / "q_tp2_sp" / "final")).state_dict()
    assert set(ep2) == set(tp2)
    for key, value in ep2.items():
        torch.testing.assert_close(tp2[key], value, rtol=1e-4, atol=1e-4, msg=key)


# ---- checkpoints under EP ------------------------------------------------------------------------------


def test_a_run_stopped_at_ep2_resumes_on_four_ranks_to_the_uninterrupted_curve(runs):
    resumed, uninterrupted = runs["q_stopped"]["rows"], runs["q_ep2"]["rows"]
    output = runs["q_stopped"]["output"]
    assert "resumed moe-engine from step 1" in output and "'data_parallel': 4, " in output
    assert "'expert_parallel': 2" in output
    assert len(resumed) == 4 and resumed[1].get("recipe_changed")  # steps, split: applied from step 2
    assert resumed[0] == runs["q_stopped_1"]["rows"][0]  # the stopped run's row, kept
    assert resumed[0]["loss"] == uninterrupted[0]["loss"]  # the same layout up to there: to the bit
    for got, want in zip(resumed[1:3], uninterrupted[1:]):
        keys = ("loss", "ce", "router/aux", "grad_norm", "term/smmd", "term/ntl_was", "lr")
        _close(got, want, keys, 1e-6, f"resumed step {got['step']}")


def test_a_run_stopped_at_ep2_resumes_at_ep1_to_the_uninterrupted_curve(runs):
    resumed, uninterrupted = runs["q_to_ep1"]["rows"], runs["q_ep2"]["rows"]
    output = runs["q_to_ep1"]["output"]
    assert "resumed moe-engine from step 1" in output and "'expert_parallel': 1" in output
    assert "megatron.ep_size: 2 -> 1" in output  # the change is named in the resume's report
    assert [r["step"] for r in resumed] == [1, 2, 3] and resumed[0] == runs["q_stopped_1"]["rows"][0]
    for got, want in zip(resumed[1:], uninterrupted[1:]):
        keys = ("loss", "ce", "router/aux", "grad_norm", "term/smmd", "term/ntl_was", "lr")
        _close(got, want, keys, 1e-6, f"resumed at EP 1, step {got['step']}")


# ---- refusals before any model is built --------------------------------------------------------------------


def _tiny_recipe(tmp_path: Path, kind: str, **megatron) -> Path:
    config = {**MODELS[kind], "vocab_size": 97} if kind in MODELS else {
        "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
    path = tmp_path / f"{kind}.yaml"
    path.write_text(yaml.safe_dump({
        "name": kind, "model": {"config": {"model_type": kind, **config}, "tokenizer": "unused"},
        "data": {"train": "unused"}, "train": {"engine": "megatron", "micro_batch_size": 1, "grad_accum": 1},
        "megatron": megatron, "cluster": {"nodes": 1, "gpus_per_node": 8}}))
    return path


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_tp_without_sequence_parallelism_on_an_moe_model_is_refused(tmp_path, kind, capsys):
    from recipes.checks.preflight import RecipeCheckError, preflight
    from recipes.config import load_recipe
    from recipes.validation import validate as V

    bad = _tiny_recipe(tmp_path, kind, tp_size=2, ep_size=2, sequence_parallel=False)
    assert V.main([str(bad), "--offline"]) == 2
    assert "megatron.sequence_parallel: an MoE model" in capsys.readouterr().out
    with pytest.raises(RecipeCheckError, match="megatron.sequence_parallel: an MoE model"):
        preflight(load_recipe(str(bad), []), world_size=8)
    good = _tiny_recipe(tmp_path, kind, tp_size=2, ep_size=2, sequence_parallel=True)
    assert V.main([str(good), "--offline"]) == 0
    capsys.readouterr()
    dense = _tiny_recipe(tmp_path, "qwen3", tp_size=2, sequence_parallel=False)  # a dense model may
    assert V.main([str(dense), "--offline"]) == 0


@pytest.mark.parametrize("ep, world, refusal", [
    (3, 6, "megatron.ep_size: 3 does not divide the model's 4 experts"),
    (4, 6, "megatron.ep_size: 4 does not divide the data-parallel size 6"),
])
def test_preflight_refuses_an_ep_the_experts_or_data_parallel_size_cannot_take(tmp_path, ep, world, refusal):
    """recipes.train's preflight (what runs before any model is built on every rank), at the world the
    job has; recipes.validate's exit 2 for these is tests/recipes/planning/test_moe.py's."""
    from recipes.checks.preflight import RecipeCheckError, preflight
    from recipes.config import load_recipe

    path = _tiny_recipe(tmp_path, "mixtral", ep_size=ep)
    with pytest.raises(RecipeCheckError, match=re.escape(refusal)):
        preflight(load_recipe(str(path), []), world_size=world)
