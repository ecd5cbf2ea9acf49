"""recipes.experiments.regimes: which runs a regime plans, which it takes from the base study, how the best
weights are chosen and kept, the gradient table and the breakdown by problem kind, on synthetic records
computed by hand. The training
path itself is `recipes.experiments.study.run_one`, run end to end in test_study.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from recipes.experiments import regimes, study


@pytest.fixture()
def folders(tmp_path, monkeypatch):
    """The base study's records in tmp_path/base, the regimes' in tmp_path/regimes."""
    base = replace(regimes.BASE, out=tmp_path / "base", work=tmp_path / "work", eval_examples=2)
    (base.out / "runs").mkdir(parents=True)
    monkeypatch.setattr(regimes, "BASE", base)
    monkeypatch.setattr(regimes, "OUT", tmp_path / "regimes")
    # work folders of their own (a machine that ran the study has the real ones), 2 test problems each
    monkeypatch.setattr(regimes, "REGIMES", {k: replace(r, work=tmp_path / f"work-{k}", train_examples=20)
                                             for k, r in regimes.REGIMES.items()})
    return base.out / "runs", tmp_path / "regimes"


def _record(loss, seed, correct, objective=None, curve=None, name=None):
    return {"name": name or f"smollm2-{loss}-s{seed}", "tokenizer": "smollm2", "loss": loss, "seed": seed,
            "metrics": {"exact_match": correct.count("1") / len(correct), "mae": 1.0, "r2": 0.5, "parse_rate": 1.0},
            "correct": correct, "eval_ids_sha256": "same", "final": {"ce": 1.0},
            **({"objective": objective} if objective is not None else {}),
            "curve": curve or [{"step": 1, "ce": 1.0, "loss": 1.0}]}


def _write(folder, record):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{record['name']}.json").write_text(json.dumps(record))


def test_weight_regime_takes_ce_and_the_default_weights_from_the_base_study(folders):
    base_runs, _ = folders
    for seed in range(3):
        for loss in ("ce", "smmd", "dist2", "ntl_mse"):  # ntl_mse is not the weight regime's
            _write(base_runs, _record(loss, seed, "1100"))
    found = regimes.records(regimes.REGIMES["weight"])
    assert sorted({r["loss"] for r in found}) == ["ce", "dist2_w0.1", "smmd_w3"]
    smmd = next(r for r in found if r["loss"] == "smmd_w3" and r["seed"] == 1)
    assert smmd["name"] == "smollm2-smmd_w3-s1" and smmd["objective"] == {"terms": {"smmd": {"weight": 3.0}}}
    # the relabelled names are the grid's, so the plan counts them as done
    grid = regimes.losses(regimes.REGIMES["weight"])
    assert list(grid) == ["ce", "numeric_smoothing", "smmd_w0.3", "smmd_w1", "smmd_w3", "dist2_w0.1", "dist2_w0.3", "dist2_w1"]
    assert grid["smmd_w0.3"] == {"terms": {"smmd": {"weight": 0.3}}}
    assert {r["name"] for r in found} >= {f"smollm2-{loss}-s{s}" for loss in ("ce", "smmd_w3") for s in range(3)}
    # other regimes change the setting, so nothing of the base study is theirs
    assert regimes.records(regimes.REGIMES["data"]) == []


def test_the_control_regime_adds_ce_at_a_lower_lr_to_the_base_studys_ce_and_smmd_3(folders):
    base_runs, _ = folders
    for seed in range(3):
        for loss in ("ce", "smmd", "dist2"):
            _write(base_runs, _record(loss, seed, "1100"))
    control = regimes.REGIMES["control"]
    grid = regimes.losses(control)
    assert grid == {"ce": {"terms": {}}, "numeric_smoothing": {"terms": {"numeric_smoothing": {}}}, "ce_lr0.4": {"terms": {}},
                    "smmd_w3": {"terms": {"smmd": {"weight": 3.0}}}}
    assert not (control.out / "choice.json").exists()  # a fixed grid: question 1's choice plays no part
    # the plan's names: CE and SMMD 3 are done (the base study's runs), CE at 0.4x the lr is not
    done = {r["name"] for r in regimes.records(control)}
    todo = [f"smollm2-{loss}-s{s}" for loss, s in regimes.plan_runs(list(grid), 3) if f"smollm2-{loss}-s{s}" not in done]
    assert todo == [f"smollm2-{loss}-s{s}" for s in range(3) for loss in ("numeric_smoothing", "ce_lr0.4")]
    assert regimes.run_overrides(control, "ce_lr0.4") == ("optim.lr=8.0e-05",)
    assert regimes.run_overrides(control, "smmd_w3") == regimes.run_overrides(control, "ce") == ()
    # the recipe those runs read: the base study's lr, scaled
    from recipes.config import load_recipe

    base = load_recipe(str(study.SETUPS["smollm2"].recipe))
    assert base.optim.lr == regimes.BASE_LR
    lowered = load_recipe(str(study.SETUPS["smollm2"].recipe), [*control.overrides, *regimes.run_overrides(control, "ce_lr0.4")])
    assert lowered.optim.lr == pytest.approx(0.4 * base.optim.lr) and lowered.train.steps == base.train.steps


def test_regimes_at_the_base_setting_share_their_ce_runs_and_nothing_else(folders):
    """CE at seed 3 made by the control is the weight regime's CE at seed 3 (and the reverse); a term's
    run or CE at another lr is not, and a regime at another setting sees none of them."""
    base_runs, out = folders
    _write(base_runs, _record("ce", 0, "10"))
    _write(out / "control" / "runs", _record("ce", 3, "01"))
    _write(out / "control" / "runs", _record("ce_lr0.4", 3, "11"))
    _write(out / "weight" / "runs", _record("ce", 4, "11"))
    _write(out / "weight" / "runs", _record("dist2_w1", 4, "11", {"terms": {"dist2": {"weight": 1.0}}}))
    weight = {r["name"]: r for r in regimes.records(regimes.REGIMES["weight"])}
    assert sorted(weight) == ["smollm2-ce-s0", "smollm2-ce-s3", "smollm2-ce-s4", "smollm2-dist2_w1-s4"]
    assert weight["smollm2-ce-s3"]["shared_from"] == "control/runs/smollm2-ce-s3.json"
    assert weight["smollm2-ce-s3"]["correct"] == "01" and "shared_from" not in weight["smollm2-ce-s4"]
    control = {r["name"] for r in regimes.records(regimes.REGIMES["control"])}
    assert control == {"smollm2-ce-s0", "smollm2-ce-s3", "smollm2-ce_lr0.4-s3", "smollm2-ce-s4"}
    assert regimes.records(regimes.REGIMES["data"]) == []


def test_best_weights_need_three_seeds_of_every_weight_and_take_the_highest_mean(folders):
    base_runs, out = folders
    weight_runs = out / "weight" / "runs"
    with pytest.raises(ValueError, match="0 seed"):
        regimes.best_weights()
    # exact match by weight over seeds 0, 1, 2 (4 problems each): smmd 0.3 -> 1/4 at every seed;
    # smmd 1 -> 3/4, 1/4, 1/4 (mean 5/12); smmd 3 (base study) -> 2/4 at every seed (mean 6/12: the best);
    # dist2 0.1 (base) -> 1/4; dist2 0.3 -> 1/4, 2/4, 4/4 (mean 7/12: the best); dist2 1 -> 0/4.
    outcomes = {"smmd_w0.3": ["1000"] * 3, "smmd_w1": ["1110", "1000", "0100"], "dist2_w0.3": ["1000", "1100", "1111"],
                "dist2_w1": ["0000"] * 3}
    for seed in range(3):
        for loss, base_loss, correct in (("ce", "ce", "1000"), ("smmd_w3", "smmd", "1100"), ("dist2_w0.1", "dist2", "0001")):
            _write(base_runs, _record(base_loss, seed, correct))
        for loss, by_seed in outcomes.items():
            if not (loss == "dist2_w1" and seed == 2):
                _write(weight_runs, _record(loss, seed, by_seed[seed]))
    with pytest.raises(ValueError, match="2 seed.*dist2_w1"):
        regimes.best_weights()
    _write(weight_runs, _record("dist2_w1", 2, "0000"))
    assert regimes.best_weights() == {"smmd": 3.0, "dist2": 0.3}

    # a later regime fixes that choice once, in choice.json, and keeps it when the weight records change
    data = regimes.REGIMES["data"]
    assert regimes.losses(data) == {"ce": {"terms": {}}, "numeric_smoothing": {"terms": {"numeric_smoothing": {}}},
                                    "smmd_w3": {"terms": {"smmd": {"weight": 3.0}}},
                                    "dist2_w0.3": {"terms": {"dist2": {"weight": 0.3}}}}
    assert json.loads((out / "data" / "choice.json").read_text())["best_weights"] == {"smmd": 3.0, "dist2": 0.3}
    for seed in range(3):
        _write(weight_runs, _record("dist2_w1", seed, "1111"))
    assert regimes.best_weights()["dist2"] == 1.0
    assert "dist2_w0.3" in regimes.losses(data)


def test_the_gradient_table_averages_each_run_then_the_runs(folders):
    # run 0: two diagnosed steps with shares 0.2, 0.4 (mean 0.3), cos 0.5, -0.1 (0.2), clipped 1, 0 (0.5),
    # pre-clip norms 2, 4 and an undiagnosed step with norm 9 (median of 2, 4, 9 = 4);
    # run 1: one diagnosed step: share 0.5, cos 0.0, clipped 1, norm 6. Means: 0.4, 0.1, 0.75, 5.
    # The off-block bound over the block's norm: run 0's CE 0.25 and 0.5 (0.375), SMMD 0 at step 1 and
    # not logged at step 2; run 1 from before the bound: the means are run 0's.
    # The turn from CE (the angle between CE's block and CE's + SMMD's, from the shares' ratio r and the
    # cosine c: atan2(r·sqrt(1 - c²), 1 + r·c)): run 0 atan2(0.25·0.866, 1.125) = 10.89° and
    # atan2(0.667·0.995, 0.933) = 35.40° (mean 23.15°), run 1 atan2(1, 1) = 45°: 34.07°.
    objective = {"terms": {"smmd": {"weight": 1.0}}}
    curve0 = [{"step": 1, "grad_norm": 2.0, "clipped": 1, "grad/ce/share": 0.8, "grad/smmd/share": 0.2, "grad/smmd/cos_ce": 0.5,
               "grad/ce/norm": 2.0, "grad/ce/off_block_max": 0.5, "grad/smmd/norm": 1.0, "grad/smmd/off_block_max": 0.0},
              {"step": 2, "grad_norm": 4.0, "clipped": 0, "grad/ce/share": 0.6, "grad/smmd/share": 0.4, "grad/smmd/cos_ce": -0.1,
               "grad/ce/norm": 4.0, "grad/ce/off_block_max": 2.0},
              {"step": 3, "grad_norm": 9.0}]
    curve1 = [{"step": 1, "grad_norm": 6.0, "clipped": 1, "grad/ce/share": 0.5, "grad/smmd/share": 0.5, "grad/smmd/cos_ce": 0.0}]
    found = [_record("smmd_w1", 0, "1", objective, curve0), _record("smmd_w1", 1, "1", objective, curve1),
             _record("ce", 0, "1", {"terms": {}}, [{"step": 1, "ce": 1.0}])]  # a record from before the diagnostics
    smmd, ce = regimes.gradient_rows(found, ["smmd_w1", "ce", "dist2_w1"])
    assert (smmd["runs"], smmd["diagnosed"]) == (2, 2)
    assert smmd["share"] == pytest.approx(0.4) and smmd["cos_ce"] == pytest.approx(0.1)
    assert smmd["clipped"] == pytest.approx(0.75) and smmd["grad_norm"] == pytest.approx(5.0)
    assert smmd["ce_off"] == pytest.approx(0.375) and smmd["term_off"] == 0.0
    assert smmd["turn"] == pytest.approx(34.0738, abs=1e-4)
    assert (ce["diagnosed"], ce["share"], ce["turn"], ce["ce_off"], ce["clipped"], ce["grad_norm"]) == (0,) + (None,) * 5
    table = regimes.gradient_markdown([smmd, ce])
    assert "| smmd_w1 | 2 | 2 | 0.40 | +0.10 | 34° | 0.38 | 0.00 | 75% | 5.0 |" in table
    assert "| ce | 1 | 0 | n/a | n/a | n/a | n/a | n/a | n/a | n/a |" in table


def test_a_regime_resumes_by_run_and_publishes_after_each(folders, monkeypatch):
    """main's plan over a fake run_one (writes the record training would): seed by seed, the base study's
    runs skipped, a budget stops before the next run, and a second start runs only what is missing."""
    base_runs, out = folders
    for seed in range(2):
        for loss in ("ce", "smmd", "dist2"):
            _write(base_runs, _record(loss, seed, "10"))
    ran = []

    def fake_run(setup, work, out_dir, tokenizer, loss, seed, steps, objective=None, overrides=(), keep_model=None):
        ran.append((loss, seed))
        record = _record(loss, seed, "11", objective, [{"step": 1, "ce": 1.0, "grad_norm": 3.0, "clipped": 1,
                                                        "grad/ce/share": 0.5, f"grad/{loss.split('_')[0]}/share": 0.5}])
        _write(out_dir / "runs", record)
        return {**record, "train_seconds": 1.0}

    monkeypatch.setattr(regimes, "run_one", fake_run)
    monkeypatch.setattr(regimes, "build_data", lambda *a, **k: None)
    monkeypatch.setattr(regimes, "zero_shot", lambda *a, **k: pytest.fail("the weight regime shares the base's test set"))
    monkeypatch.setattr(regimes.time, "time", lambda: 1e6 if len(ran) >= 3 else 0.0)  # the budget ends after 3 runs
    assert regimes.main(["--regime", "weight", "--seeds", "2", "--budget-min", "1"]) == 0
    assert ran == [("numeric_smoothing", 0), ("smmd_w0.3", 0), ("smmd_w1", 0)]
    results = (out / "weight" / "results.md").read_text()
    assert "Runs done: 9 of 16 planned." in results
    assert "smollm2-dist2_w1-s0" in results.split("Missing")[1]
    ran.clear()
    assert regimes.main(["--regime", "weight", "--seeds", "2"]) == 0
    assert ran == [("dist2_w0.3", 0), ("dist2_w1", 0), ("numeric_smoothing", 1), ("smmd_w0.3", 1), ("smmd_w1", 1),
                   ("dist2_w0.3", 1), ("dist2_w1", 1)]
    assert "Runs done: 16 of 16 planned." in (out / "weight" / "results.md").read_text()
    # below 3 seeds the comparison shows no interval (study.markdown's rule)
    assert "[" not in (out / "weight" / "results.md").read_text().split("| smmd_w1 |")[1].split("\n")[0]


def test_the_lr_regime_takes_ce_at_its_lr_from_the_control_and_nothing_at_the_base_lr(folders):
    """CE at 0.4x the lr is the control's ce_lr0.4 run (the same recipe: the control's overrides are the
    base's, the lr run's own is this regime's), relabelled as the lr regime's CE; CE at the base lr and
    the control's SMMD 3 are not this regime's."""
    base_runs, out = folders
    _write(base_runs, _record("ce", 0, "10"))
    for seed in range(2):
        _write(out / "control" / "runs", _record("ce_lr0.4", seed, "11" if seed else "01"))
    _write(out / "control" / "runs", _record("ce", 3, "00"))
    _write(out / "control" / "runs", _record("smmd_w3", 0, "00"))
    _write(out / "lr" / "runs", _record("smmd_w0.3", 0, "10", {"terms": {"smmd": {"weight": 0.3}}}))
    lr = regimes.REGIMES["lr"]
    found = {r["name"]: r for r in regimes.records(lr)}
    assert sorted(found) == ["smollm2-ce-s0", "smollm2-ce-s1", "smollm2-smmd_w0.3-s0"]
    assert found["smollm2-ce-s0"]["loss"] == "ce" and found["smollm2-ce-s0"]["correct"] == "01"
    assert found["smollm2-ce-s1"]["shared_from"] == "control/runs/smollm2-ce_lr0.4-s1.json"
    # the recipes agree: the control's ce_lr0.4 and this regime's CE read the same overrides
    control = regimes.REGIMES["control"]
    assert control.overrides + regimes.run_overrides(control, "ce_lr0.4") == lr.overrides + regimes.run_overrides(lr, "ce")
    assert lr.train_examples == control.train_examples and lr.mix == control.mix
    # the weight regime does not see them (another lr), nor the lr regime's term runs
    weight = {r["name"] for r in regimes.records(regimes.REGIMES["weight"])}
    assert "smollm2-smmd_w0.3-s0" not in weight and weight == {"smollm2-ce-s0", "smollm2-ce-s3"}


def test_later_regimes_refuse_to_start_before_the_weight_regime_has_three_seeds(folders):
    with pytest.raises(SystemExit, match="regime 'length'.*weight regime"):
        regimes.main(["--regime", "length", "--report-only"])


def test_every_regime_setting_is_a_valid_recipe():
    """The regimes' overrides and data mixes are ones the recipe and data_prep's generator accept."""
    from data_prep.sources.arithmetic_gen import generate
    from recipes.config import load_recipe

    for regime in regimes.REGIMES.values():
        recipe = load_recipe(str(study.SETUPS["smollm2"].recipe), list(regime.overrides))
        assert recipe.train.steps * recipe.train.global_batch_size >= 960
        for i, (module, options) in enumerate(regime.mix):
            question, answer = generate(module, i, {"seed": 0, **options})
            assert question and answer
    length = load_recipe(str(study.SETUPS["smollm2"].recipe), list(regimes.REGIMES["length"].overrides))
    assert (length.train.steps, length.optim.lr) == (240, 1.0e-4)
    # the lr regime trains on the base study's data, as the control whose CE runs it reads
    lr, control = regimes.REGIMES["lr"], regimes.REGIMES["control"]
    assert lr.work == control.work == regimes.BASE.work and lr.base_test_set and not regimes.REGIMES["data"].base_test_set
    # 240 steps of 16 problems never repeat one of the 5,000
    assert length.train.steps * length.train.global_batch_size < regimes.REGIMES["length"].train_examples


PROBLEMS = [{"prompt": "Multiply -3 and 2.", "target": "-6"}, {"prompt": "Calculate 1*2.", "target": "2"},
            {"prompt": "What is 4 times 5?", "target": "20"}, {"prompt": "Calculate -9 - 633.5.", "target": "-642.5"},
            {"prompt": "What is 646.6 + 82.6?", "target": "729.2"}]


def test_problem_kinds_split_by_operation_and_sign():
    assert [regimes.problem_kind(p) for p in PROBLEMS] == [
        "product, answer < 0", "product, answer >= 0", "product, answer >= 0", "add/sub, answer < 0",
        "add/sub, answer >= 0"]


def test_the_kind_breakdown_scores_each_kind_per_seed_and_pairs_with_ce():
    found = [_record("ce", 0, "01101"), _record("ce", 1, "11100"), _record("smmd_w0.3", 0, "11111"),
             _record("smmd_w0.3", 1, "00000")]
    rows = {(r["loss"], r["kind"]): r for r in regimes.kind_rows(found, ["ce", "smmd_w0.3"], PROBLEMS)}
    ce, smmd = rows["ce", "product, answer >= 0"], rows["smmd_w0.3", "product, answer >= 0"]
    assert (ce["problems"], ce["seeds"], ce["mean"], ce["sd"], ce["delta"]) == (2, 2, 1.0, 0.0, None)
    assert (smmd["mean"], smmd["delta_per_seed"], smmd["delta"]) == (0.5, [0.0, -1.0], -0.5)
    neg = rows["smmd_w0.3", "product, answer < 0"]  # CE: 0 then 1; SMMD: 1 then 0
    assert (neg["mean"], neg["delta_per_seed"], neg["delta"]) == (0.5, [1.0, -1.0], 0.0)
    assert (rows["ce", "add/sub, answer < 0"]["mean"], rows["ce", "add/sub, answer >= 0"]["mean"]) == (0.0, 0.5)
    table = regimes.kind_markdown(regimes.kind_rows(found, ["ce", "smmd_w0.3"], PROBLEMS))
    assert "| smmd_w0.3 | product, answer >= 0 | 2 | 2 | 50.0 ± 70.7 | -50.0 (+0.0, -100.0) |" in table
    with pytest.raises(ValueError, match="4 answers for 5 test problems"):
        regimes.kind_rows([_record("ce", 0, "0110")], ["ce"], PROBLEMS)


def test_eval_problems_are_made_again_and_checked_against_the_kept_copy(folders):
    regime = regimes.REGIMES["task"]
    problems = regimes.eval_problems(regime)
    assert len(problems) == 2 and problems == regimes.eval_problems(regime)  # deterministic
    kept = regime.work / "problems" / "eval.jsonl"
    kept.parent.mkdir(parents=True)
    kept.write_text("".join(json.dumps(p) + "\n" for p in problems))
    assert regimes.eval_problems(regime) == problems
    kept.write_text("".join(json.dumps({**p, "target": "1"}) + "\n" for p in problems))
    with pytest.raises(ValueError, match="no longer makes these test problems"):
        regimes.eval_problems(regime)


def test_the_seed_table_plans_from_the_per_seed_differences_and_the_mean_run_time():
    """A loss 1.0 point above CE on average with per-seed SD 1.8 (points) needs 15 seeds
    (`seeds_to_exclude_zero`, checked by hand in evaluation/test_stats.py): 12 more seeds of it and of CE,
    24 runs, at the mean of the records' training times (1,800 and 3,600 s: 0.75 h) 18 hours. A loss with
    2 seeds, or CE itself, has no row."""
    found = [{"train_seconds": 1800.0}, {"train_seconds": 3600.0}, {}]
    rows = [{"loss": "ce"},
            {"loss": "smmd_w0.3", "vs_ce": {"seed_t": {"mean": 0.010, "sd": 0.018, "n": 3}}},
            {"loss": "dist2_w0.1", "vs_ce": {"seed_t": {"mean": 0.020, "sd": 0.010, "n": 2}}}]
    got = regimes.seed_rows(rows, found)
    assert [r["loss"] for r in got] == ["smmd_w0.3"]
    r = got[0]
    assert (r["mean"], r["sd"], r["need"], r["runs"]) == (pytest.approx(1.0), pytest.approx(1.8), 15, 24)
    assert r["hours"] == pytest.approx(24 * 2700 / 3600)
    assert "| smmd_w0.3 | 3 | +1.0 | 1.8 | 15 | 24 | 18 |" in regimes.seed_markdown(got)


def test_more_seeds_of_one_comparison_run_only_its_losses(folders, monkeypatch):
    """--seeds 4 --losses ce,dist2_w1 after a complete 3-seed weight grid: only CE and DIST2 1 at seed 3
    run, the report counts the 3-seed grid and those two as planned, and a name outside the grid is
    refused before anything runs."""
    base_runs, out = folders
    for seed in range(3):
        for loss in ("ce", "smmd", "dist2"):
            _write(base_runs, _record(loss, seed, "10"))
        for loss in ("numeric_smoothing", "smmd_w0.3", "smmd_w1", "dist2_w0.3", "dist2_w1"):
            _write(out / "weight" / "runs", _record(loss, seed, "11", {"terms": {loss.split("_")[0]: {}}}))
    ran = []

    def fake_run(setup, work, out_dir, tokenizer, loss, seed, steps, objective=None, overrides=(), keep_model=None):
        ran.append((loss, seed))
        _write(out_dir / "runs", _record(loss, seed, "11", objective))
        return {**_record(loss, seed, "11", objective), "train_seconds": 1.0}

    monkeypatch.setattr(regimes, "run_one", fake_run)
    monkeypatch.setattr(regimes, "build_data", lambda *a, **k: None)
    with pytest.raises(SystemExit, match="--losses dist2_w2: not in this regime's grid"):
        regimes.main(["--regime", "weight", "--seeds", "4", "--losses", "ce,dist2_w2"])
    assert ran == []
    assert regimes.main(["--regime", "weight", "--seeds", "4", "--losses", "ce,dist2_w1"]) == 0
    assert ran == [("ce", 3), ("dist2_w1", 3)]
    assert "Runs done: 26 of 26 planned." in (out / "weight" / "results.md").read_text()
