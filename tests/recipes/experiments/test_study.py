"""recipes.experiments.study: the aggregation over seeds against a hand computation, and the whole grid at tiny size."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from recipes.evaluation.metrics import closeness
from recipes.experiments import regimes, study

pytest.importorskip("deepspeed")


def _record(tokenizer, loss, seed, em, mae, parse=1.0):
    return {"tokenizer": tokenizer, "loss": loss, "seed": seed, "final": {"ce": 1.0 + seed},
            "metrics": {"exact_match": em, "mae": mae, "r2": None if mae is None else 0.5, "parse_rate": parse}}


def test_aggregate_means_and_spreads_over_seeds():
    records = [_record("digits", "ce", 0, 0.1, 10.0), _record("digits", "ce", 1, 0.3, 20.0),
               _record("digits", "ce", 2, 0.2, None, parse=0.0),  # nothing parsed: no MAE for this seed
               _record("digits", "smmd", 0, 0.5, 4.0)]
    rows = study.aggregate(records)
    ce, smmd = rows
    assert (ce["loss"], ce["seeds"], smmd["loss"], smmd["seeds"]) == ("ce", 3, "smmd", 1)
    assert ce["exact_match"] == pytest.approx(0.2) and ce["exact_match_sd"] == pytest.approx(0.1)
    assert ce["mae"] == pytest.approx(15.0) and ce["mae_n"] == 2
    assert ce["mae_sd"] == pytest.approx(statistics.stdev([10.0, 20.0]))
    assert ce["final_ce"] == pytest.approx(2.0)
    table = study.markdown(rows)
    assert "| digits | ce | 3 | 20.0 ± 10.0 | 15.00 ± 7.07 (2 seeds) |" in table
    assert "| digits | smmd | 1 | 50.0 (1 seed) | 4.00 (1 seed) |" in table


def test_log_mae_against_ce_pairs_every_answer_by_seed_and_problem():
    # targets 10, 20; CE answers "10" and "oops" (a miss at the span, 10), the term "10" and "21" at every
    # seed: the term's log error on problem 2 is log 2 against CE's log 11
    targets = [10.0, 20.0]

    def run(loss, seed, answers):
        record = _record("digits", loss, seed, 0.5, 1.0)
        return {**record, "eval_ids_sha256": "x", "answers": answers, "targets": targets,
                "closeness": closeness(answers, targets)}

    records = [run("ce", s, ["10", "oops"]) for s in range(3)] + [run("smmd", s, ["10", "21"]) for s in range(3)]
    rows = {r["loss"]: r for r in study.aggregate(records)}
    assert rows["ce"]["log_mae"] == pytest.approx(math.log(11) / 2)
    v = rows["smmd"]["log_mae_vs_ce"]
    assert v["diff"] == pytest.approx((math.log(2) - math.log(11)) / 2) and v["n_seeds"] == 3
    assert v["per_seed"] == pytest.approx([(math.log(2) - math.log(11)) / 2] * 3)
    # old records without answers compare nothing
    assert study.log_mae_versus_ce([_record("digits", "smmd", 0, 0.5, 1.0)], [_record("digits", "ce", 0, 0.5, 1.0)]) is None


def test_comparison_against_ce_uses_the_seeds_both_have_and_ranks_nothing_below_three(tmp_path):
    # 4 test problems. CE seeds 0 and 1 solve "1100" and "1000"; SMMD seeds 0, 1 and 2 solve "1110",
    # "1100" and "1111". Seed 2 has no CE partner and is left out: at seeds 0 and 1 SMMD solves one
    # problem more than CE, a difference of 0.25 at each; two seeds can rank nothing, so no interval.
    def run(loss, seed, correct):
        return {**_record("smollm2", loss, seed, correct.count("1") / 4, 1.0), "name": f"smollm2-{loss}-s{seed}",
                "correct": correct, "eval_ids_sha256": "same", "tokens_per_s": 50.0 + seed}

    records = [run("ce", 0, "1100"), run("ce", 1, "1000"),
               run("smmd", 0, "1110"), run("smmd", 1, "1100"), run("smmd", 2, "1111")]
    ce, smmd = study.aggregate(records)
    assert ce["vs_ce"] is None and ce["tokens_per_s"] == pytest.approx(50.5)
    v = smmd["vs_ce"]
    assert v["diff"] == pytest.approx(0.25) and v["n_seeds"] == 2 and v["per_seed"] == pytest.approx([0.25, 0.25])
    assert v["low"] is None and v["seed_t"]["low"] is None
    table = study.markdown([ce, smmd])
    assert "| +25.0, 2 seeds: no ranking | +25.0, +25.0 | – | – | – | – | 51 |" in table and "[" not in table.split("\n")[-1]
    # CE's seed 2 ("1110"): three seeds in common, each +0.25; the t interval has no spread, the two-level
    # one comes from the problems (per seed one won problem of four, a different one at each seed)
    ce, smmd = study.aggregate(records + [run("ce", 2, "1110")])
    v = smmd["vs_ce"]
    assert v["n_seeds"] == 3 and v["per_seed"] == pytest.approx([0.25] * 3)
    assert 0.0 <= v["low"] < 0.25 < v["high"] <= 1.0
    assert (v["seed_t"]["low"], v["seed_t"]["high"]) == pytest.approx((0.25, 0.25))
    assert f"| +25.0 [{100 * v['low']:+.1f}, {100 * v['high']:+.1f}] | +25.0, +25.0, +25.0 | [+25.0, +25.0] |" \
        in study.markdown([ce, smmd])
    records[-1]["eval_ids_sha256"] = "other"
    records[2]["eval_ids_sha256"] = "other"
    with pytest.raises(ValueError, match="different test problems"):
        study.aggregate(records)


def test_records_without_per_problem_outcomes_give_the_seed_level_interval():
    # the tiny study's records hold each run's exact match only: per-seed differences 0.1, 0.2, 0.3,
    # t interval 0.2 ± 4.302653 * 0.1 / sqrt(3) = [-0.048, 0.448]
    records = [_record("digits", "ce", s, 0.1, 1.0) for s in range(3)]
    records += [_record("digits", "smmd", s, 0.2 + 0.1 * s, 1.0) for s in range(3)]
    v = study.aggregate(records)[1]["vs_ce"]
    assert v["low"] is None and v["per_seed"] == pytest.approx([0.1, 0.2, 0.3])
    assert (v["seed_t"]["low"], v["seed_t"]["high"]) == pytest.approx((-0.048414, 0.448414), abs=1e-6)
    assert "| +20.0 (seed level only) | +10.0, +20.0, +30.0 | [-4.8, +44.8] |" in study.markdown(study.aggregate(records))


def test_study_grid_end_to_end_at_tiny_size(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    assert study.main(["--out", str(out), "--work", str(work), "--seeds", "1", "--steps", "2",
                       "--losses", "ce,smmd", "--tokenizers", "digits", "--train-examples", "200",
                       "--eval-examples", "16"]) == 0
    names = sorted(p.stem for p in (out / "runs").glob("*.json"))
    assert names == ["digits-ce-s0", "digits-smmd-s0"]
    record = json.loads((out / "runs" / "digits-smmd-s0.json").read_text())
    assert [r["step"] for r in record["curve"]] == [1, 2] and record["metrics"]["n"] == 16
    assert "term/smmd" in record["final"]
    # the record keeps each step's gradient diagnostics (on by default at every logged step), the norms
    # included: the regimes' gradient table reads the off-block bound relative to them
    assert all(0 <= r["grad/smmd/share"] <= 1 and r["clipped"] in (0, 1) for r in record["curve"])
    assert record["objective"] == study.LOSSES["smmd"]
    for part in ("ce", "smmd"):
        ratios = [r[f"grad/{part}/off_block_max"] / r[f"grad/{part}/norm"] for r in record["curve"]]
        # CE reaches every column; SMMD reads the distribution renormalised over the numeric tokens, so
        # its gradient off them is exactly 0
        assert all(x > 0 for x in ratios) if part == "ce" else ratios == [0.0] * len(ratios)
        row = regimes.gradient_rows([record], ["smmd"])[0]
        assert row[f"{'ce' if part == 'ce' else 'term'}_off"] == pytest.approx(statistics.mean(ratios))
    results = (out / "results.md").read_text()
    assert results.count("| digits |") == 2
    assert "Runs done: 2 of 2 planned." in results and "Missing" not in results
    assert len(record["correct"]) == 16 and record["tokens_per_s"] > 0
    assert len(record["answers"]) == len(record["targets"]) == 16 and record["closeness"]["n"] == 16
    for plot in ("curves-digits.png", "probe-digits.png"):
        assert (out / plot).stat().st_size > 1000
    # a second start finds every run done and only rebuilds the report
    before = (out / "runs" / "digits-ce-s0.json").stat().st_mtime_ns
    assert study.main(["--out", str(out), "--work", str(work), "--seeds", "1", "--losses", "ce,smmd",
                       "--tokenizers", "digits", "--train-examples", "200", "--eval-examples", "16"]) == 0
    assert (out / "runs" / "digits-ce-s0.json").stat().st_mtime_ns == before


def test_probe_models_come_from_one_seed_the_one_with_the_most_models(tmp_path):
    def model(name, complete=True):
        d = tmp_path / "runs" / name / "final"
        d.mkdir(parents=True)
        if complete:
            (d / "config.json").write_text("{}")

    assert study.probe_models(tmp_path, "smollm2") == (None, {})
    # seed 0 trained elsewhere (no models here); seed 1: two losses; seed 2: three, one still being written
    model("smollm2-smmd-s1"), model("smollm2-ce-s1")
    model("smollm2-smmd_smooth-s2"), model("smollm2-ce-s2"), model("smollm2-dist2-s2", complete=False)
    model("digits-ntil-s2"), model("digits-gce-s2")  # another tokenizer's models do not count
    assert study.probe_models(tmp_path, "smollm2") == (1, {
        "ce": tmp_path / "runs" / "smollm2-ce-s1" / "final",
        "smmd": tmp_path / "runs" / "smollm2-smmd-s1" / "final"})  # a tie: the lower seed, LOSSES order
    (tmp_path / "runs" / "smollm2-dist2-s2" / "final" / "config.json").write_text("{}")
    seed, models = study.probe_models(tmp_path, "smollm2")
    assert seed == 2 and list(models) == ["ce", "dist2", "smmd_smooth"]
    assert sorted(study.models_by_seed(tmp_path, "digits")) == [2]


def test_plan_leaves_out_a_loss_whose_terms_need_what_a_tokenizers_policy_cannot_give():
    """The tiny setup's tokenizers: digits (policy digits) and groups3 (policy integers). NTIL and DEL need
    digits by their registrations, so every loss holding one is left out for groups3, a caller's own objective
    (smmd_del) as well as the study's."""
    objectives = {**study.LOSSES, "smmd_del": {"terms": {"smmd": {}, "del": {}}}}
    grid = study.plan(study.SETUPS["tiny"], 2, ["ce", "ntil", "del", "smmd_del", "smmd"], ["digits", "groups3"],
                      objectives)
    kept = [("digits", loss) for loss in ("ce", "ntil", "del", "smmd_del", "smmd")] + [("groups3", "ce"),
                                                                                        ("groups3", "smmd")]
    assert grid == [(t, loss, s) for s in range(2) for t, loss in kept]
    assert study.LOSSES["del"] == {"terms": {"del": {}}}  # the authors' weight: the term's default
