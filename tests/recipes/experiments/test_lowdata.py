"""Study B's runner (recipes.experiments.lowdata): the data draws, the comparisons from records, and one
cell end to end through the real runner (recipes.train on one CPU rank, the evaluation, the record),
then the same command again, which the record makes skip the cell."""

from __future__ import annotations

import json
import math

import pytest

from recipes.evaluation.metrics import closeness as metrics_closeness
from recipes.evaluation.stats import holm, paired_t_p
from recipes.experiments import lowdata as L


def test_test_inputs_are_fixed_and_disjoint_and_training_draws_nest_over_n():
    test, rest = L.draws(1000)
    assert len(test) == 1000 and len(set(test)) == 1000 and not set(test) & set(rest)
    assert len(test) + len(rest) == 10000 and L.draws(1000)[0] == test  # the same every call
    small, large = L.training_inputs(rest, 3, 32), L.training_inputs(rest, 3, 2048)
    assert large[:32] == small and len(set(large)) == 2048
    assert L.training_inputs(rest, 4, 32) != small  # another seed draws another set
    targets = [L.target(a, b) for a, b in test + rest]
    assert min(targets) == 0 and max(targets) == 1000  # 0..1,000: answers of 1 to 4 digits
    assert L.target(10, 5) == 69  # 37 + 32
    with pytest.raises(ValueError, match="outside the test set"):
        L.training_inputs(rest, 0, 9001)


def test_grid_runs_every_seed_of_an_n_before_the_next_n():
    cells = L.grid(2, (32, 128), ("ce", "dist2"))
    assert cells[:4] == [(32, "ce", 0), (32, "dist2", 0), (32, "ce", 1), (32, "dist2", 1)]
    assert {n for n, _, _ in cells[4:]} == {128}


def _record(n, arm, seed, answers, targets):
    return {"name": L.cell_name(n, arm, seed), "n": n, "arm": arm, "seed": seed, "eval_ids_sha256": "same",
            "answers": answers, "targets": targets, "closeness": {"miss_error": 100.0}}


def test_comparisons_pair_by_seed_and_input_and_wait_for_every_seed():
    targets = [10, 20, 30, 40]
    ce = [_record(32, "ce", s, ["10", "0", "oops", "41"], targets) for s in range(5)]
    # the term answers input 1 exactly at seeds 0-2 and like CE at seeds 3-4
    term = [_record(32, "dist2", s, ["10", "20" if s < 3 else "0", "oops", "41"], targets) for s in range(5)]
    rows = {(r["arm"], r["endpoint"]): r for r in L.comparisons(ce + term)}
    em = rows[("dist2", "exact_match")]
    assert em["per_seed"] == pytest.approx([0.25, 0.25, 0.25, 0.0, 0.0]) and em["diff"] == pytest.approx(0.15)
    assert em["p"] == pytest.approx(paired_t_p([0.25, 0.25, 0.25, 0.0, 0.0]))
    gain = (math.log(1) - math.log(21)) / 4  # input 1: error 20 -> 0
    assert rows[("dist2", "log_mae")]["per_seed"] == pytest.approx([gain] * 3 + [0.0, 0.0])
    assert em["primary"] and em["holm_p"] is None  # the family of 32 is incomplete: no adjustment yet
    assert L.comparisons(ce + term[:4]) == []  # four seeds of the term: no comparison is reported


def test_holm_is_applied_to_the_whole_primary_family_once_complete():
    targets = [10, 20]
    records = []
    for n in L.N_VALUES:
        for arm in ("ce", *L.PRIMARY_TERMS):
            for s in range(5):
                right = arm != "ce" and s < 2 + L.PRIMARY_TERMS.index(arm) % 3
                records.append(_record(n, arm, s, ["10", "20" if right else "5"], targets))
    rows = L.comparisons(records)
    primary = [r for r in rows if r["primary"]]
    assert len(primary) == 32 and all(r["vs"] == "ce" for r in primary)
    expected = holm({(r["n"], r["arm"], r["endpoint"]): r["p"] for r in primary})
    assert all(r["holm_p"] == pytest.approx(expected[(r["n"], r["arm"], r["endpoint"])]) for r in primary)
    assert all(r["holm_p"] >= r["p"] for r in primary)


def test_one_cell_end_to_end_then_skipped_by_its_record(tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["--out", str(out), "--work", str(work), "--steps", "2", "--test-size", "20", "--n", "32",
            "--seeds", "1", "--arms", "numeric_smoothing"]
    assert L.main(argv) == 0
    path = out / "runs" / "n32-numeric_smoothing-s0.json"
    record = json.loads(path.read_text())
    assert record["objective"] == {"terms": {"numeric_smoothing": {"weight": 0.1}}} and record["steps"] == 2
    assert len(record["answers"]) == len(record["targets"]) == 20 == record["closeness"]["n"]
    test, _ = L.draws(20)
    assert sorted(record["targets"]) == sorted(float(L.target(a, b)) for a, b in test)
    assert record["closeness"]["miss_error"] == max(record["targets"]) - min(record["targets"])
    assert [r["step"] for r in record["curve"]][-1] == 2 and "term/numeric_smoothing" not in record["curve"][-1]
    assert not (work / "runs" / "n32-numeric_smoothing-s0").exists()  # the model is not kept
    first = path.read_bytes()
    capsys.readouterr()
    assert L.main(argv) == 0  # the same command again: the record says the cell is done
    assert "skip n32-numeric_smoothing-s0: its record exists" in capsys.readouterr().out
    assert path.read_bytes() == first
    results = (out / "results.md").read_text()
    assert "Cells done: 1 of 1 planned." in results
    assert "| 32 | numeric_smoothing | 1 | – (1 of 5 seeds) |" in results  # one seed shows no endpoint


def test_the_report_from_records_alone(tmp_path):
    targets = [10.0, 20.0, 30.0, 40.0]
    runs = tmp_path / "runs"
    runs.mkdir()
    for seed in range(5):
        for arm, answers in (("ce", ["10", "0", "oops", "41"]), ("dist2", ["10", "20", "oops", "41"])):
            record = _record(32, arm, seed, answers, targets)
            record.update(metrics={"exact_match": sum(a == str(int(t)) for a, t in zip(answers, targets)) / 4},
                          closeness=metrics_closeness(answers, targets), train_seconds=1.0,
                          convergence={"window": 1, "final_ce": 0.5, "change": 0.0})
            (runs / f"{record['name']}.json").write_text(json.dumps(record))
    table = L.report(tmp_path, [L.cell_name(32, arm, s) for s in range(5) for arm in ("ce", "dist2")])
    assert "Cells done: 10 of 10 planned." in table
    assert "| 32 | dist2 | 5 | 50.0 ± 0.0 |" in table and "| 32 | ce | 5 | 25.0 ± 0.0 |" in table
    row = next(line for line in table.splitlines() if line.startswith("| 32 | dist2 | ce | exact_match (primary)"))
    assert "| +25.0 | +25.0, +25.0, +25.0, +25.0, +25.0 |" in row and "| – |" in row  # no Holm: the family is not whole
    assert (tmp_path / "results.md").read_text().strip() == table.strip()
    assert (tmp_path / "closeness.png").stat().st_size > 1000 and (tmp_path / "results.csv").exists()
