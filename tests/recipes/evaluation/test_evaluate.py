"""recipes.evaluation.evaluate: prompts from shards, batched greedy generation, scoring, the results file."""

import json
import re

import pyarrow.parquet as pq
import pytest

from recipes.evaluate import main as evaluate_cli
from recipes.evaluation import evaluate as E
from recipes.evaluation import report as R


def _last_number(text):
    found = re.findall(r"-?\d+(?:\.\d+)?", text or "")
    return float(found[-1]) if found else None


def test_prompt_is_the_part_before_the_first_label(rec_data_dir):
    rows = E.load_rows(rec_data_dir)
    manifest = E.read_manifest(rec_data_dir)
    table = pq.read_table(f"{rec_data_dir}/{manifest['shards'][0]['file']}").to_pylist()
    assert len(rows) == 24
    by_id = {r["example_id"]: r for r in table}
    for r in rows:
        src = by_id.get(r["example_id"])
        if src is None:
            continue
        assert r["prompt_ids"] == src["input_ids"][:src["num_prompt_tokens"]]
    assert len(E.load_rows(rec_data_dir, limit=5)) == 5


def test_evaluate_random_model_results_match_an_independent_computation(rec_model_dir, rec_data_dir, tmp_path):
    out = tmp_path / "res.json"
    res = E.evaluate(rec_model_dir, rec_data_dir, out=str(out), batch_size=5, max_new_tokens=4, name="tiny")
    saved = json.loads(out.read_text())
    assert saved["name"] == "tiny" and saved["metrics"] == res["metrics"]
    ex = saved["examples"]
    assert len(ex) == saved["metrics"]["n"] == 24
    parsed = [_last_number(e["prediction"]) for e in ex]
    hits = sum(p is not None and p == e["target"] for p, e in zip(parsed, ex))
    errs = [abs(p - e["target"]) for p, e in zip(parsed, ex) if p is not None]
    m = saved["metrics"]
    assert m["exact_match"] == pytest.approx(hits / len(ex))
    assert m["parse_rate"] == pytest.approx(sum(p is not None for p in parsed) / len(ex))
    if errs:
        assert m["mae"] == pytest.approx(sum(errs) / len(errs))
    else:
        assert m["mae"] is None


def test_left_padded_batches_generate_what_single_rows_do(rec_model_dir, rec_data_dir):
    model, tok, _ = E.load_model(rec_model_dir)
    rows = E.load_rows(rec_data_dir, limit=12)
    single = E.generate_texts(model, tok, rows, batch_size=1, max_new_tokens=6)
    batched = E.generate_texts(model, tok, rows, batch_size=5, max_new_tokens=6)
    assert single == batched
    assert any(s for s in single)


def _oracle(offset=0):
    def generate(model, tokenizer, rows, **kwargs):
        return [f"so the answer is {r['answer'] + offset:g}" for r in rows]
    return generate


def test_perfect_and_off_by_one_predictions(rec_data_dir, tmp_path):
    perfect = E.evaluate("unused", rec_data_dir, model_and_tokenizer=(None, None), generate=_oracle(0),
                         out=str(tmp_path / "p.json"))["metrics"]
    assert perfect["exact_match"] == 1.0 and perfect["mae"] == 0.0 and perfect["parse_rate"] == 1.0
    assert perfect["r2"] == 1.0 and perfect["relaxed_accuracy"] == 1.0
    off = E.evaluate("unused", rec_data_dir, model_and_tokenizer=(None, None), generate=_oracle(1))["metrics"]
    assert off["exact_match"] == 0.0 and off["mae"] == pytest.approx(1.0) and off["parse_rate"] == 1.0


def test_time_answers_use_the_circular_gap():
    rows = [{"example_id": str(i), "prompt_ids": [1], "answer": float(a), "answer_text": t}
            for i, (a, t) in enumerate([(10, "12:10"), (710, "11:50"), (180, "3:00"), (0, "12:00")])]
    metrics, examples = E.score(["12:10", "0:10", "3:05", "no idea"], rows, answer_format="time")
    assert [e["time_gap"] for e in examples] == [0.0, 20.0, 5.0, None]
    assert metrics["exact_match"] == 0.25 and metrics["parse_rate"] == 0.75
    assert metrics["time_gap"] == pytest.approx(25 / 3)


def test_text_answers_count_in_exact_match_by_their_text_and_relaxed_accuracy():
    rows = [{"example_id": "a", "prompt_ids": [], "answer": None, "answer_text": "Yes"},
            {"example_id": "b", "prompt_ids": [], "answer": 100.0, "answer_text": "100"}]
    metrics, _ = E.score(["yes.", "104"], rows)
    assert metrics["n"] == 2 and metrics["n_numeric"] == 1 and metrics["n_exact_match"] == 2
    assert metrics["exact_match"] == 0.0 and metrics["relaxed_accuracy"] == 1.0  # 4 % off is "relaxed" right


def test_surds_and_base_numerals_are_scored_by_exact_text_and_left_out_of_mae():
    # DeepMind-Math rows as data_prep keeps them: answer None, answer_text the expression. Hand-computed:
    # exact 3 of 5 (-8, the surd, -191b); MAE over the two numeric rows = (0 + 2) / 2; R² with targets
    # -8, 10 (mean 1, SS_tot 162) and SS_res 4 is 1 - 4/162.
    cases = [(-8.0, "-8", "-8"), (10.0, "10", "so 12"), (None, "-14 + 4*sqrt(7)", "-14 + 4*sqrt(7)"),
             (None, "7*sqrt(17)/6", "7*sqrt(17)/5"), (None, "-191b", "-191b")]
    rows = [{"example_id": str(i), "prompt_ids": [1], "answer": a, "answer_text": t}
            for i, (a, t, _) in enumerate(cases)]
    metrics, examples = E.score([p for *_, p in cases], rows)
    assert [e["correct"] for e in examples] == [True, False, True, False, True]
    assert "abs_error" not in examples[2] and examples[1]["abs_error"] == 2.0
    assert metrics["exact_match"] == pytest.approx(3 / 5) and metrics["n_exact_match"] == 5
    assert metrics["mae"] == pytest.approx(1.0) and metrics["n_mae_r2"] == 2
    assert metrics["r2"] == pytest.approx(1 - 4 / 162)
    assert metrics["parse_rate"] == 1.0 and metrics["n_numeric"] == 2 and metrics["n_text"] == 3
    table = R.markdown_table([{"name": "dm", "metrics": metrics}]).splitlines()
    assert table[0] == ("| run | n | parse rate | n parse | exact match | n exact | MAE | R² | n MAE/R² "
                        "| relaxed acc. |")
    assert table[2].startswith("| dm | 5 | 1 | 2 | 0.6 | 5 | 1 | 0.9753 | 2 |")


def test_cli_writes_results_and_the_table_has_a_row_per_run(rec_model_dir, rec_data_dir, tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert E.main(["--model", rec_model_dir, "--data", rec_data_dir, "--out", str(a), "--limit", "6",
                   "--batch-size", "3", "--max-new-tokens", "3", "--name", "run-a"]) == 0
    E.evaluate("unused", rec_data_dir, model_and_tokenizer=(None, None), generate=_oracle(0), out=str(b),
               name="oracle")
    capsys.readouterr()
    assert evaluate_cli(["table", str(a), str(b)]) == 0  # `python -m recipes.evaluate table ...`
    table = capsys.readouterr().out.strip().splitlines()
    assert len(table) == 4 and table[0].startswith("| run |") and "exact match" in table[0]
    assert table[2].startswith("| run-a |") and table[3].startswith("| oracle |")
    assert json.loads(a.read_text())["metrics"]["n"] == 6


def test_bad_answer_format_is_refused(rec_data_dir):
    with pytest.raises(ValueError, match="answer_format"):
        E.evaluate("unused", rec_data_dir, answer_format="date")


def test_the_results_carry_a_wilson_interval_and_the_table_shows_it_from_the_command_line(rec_data_dir, tmp_path,
                                                                                            capsys):
    """7 of 10 rows right: 95% Wilson interval [0.3968, 0.8922] (the published value for 7/10, e.g.
    statsmodels' proportion_confint(7, 10, method="wilson")), in the results and in
    `python -m recipes.evaluate table --interval`."""
    def seven_of_ten(model, tokenizer, rows, **kwargs):
        return [f"{r['answer'] + (0 if i < 7 else 1):g}" for i, r in enumerate(rows)]

    out = tmp_path / "res.json"
    E.evaluate("unused", rec_data_dir, model_and_tokenizer=(None, None), generate=seven_of_ten, out=str(out),
               limit=10, name="seven")
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["exact_match"] == 0.7 and metrics["n_exact_match"] == 10
    assert metrics["exact_match_95ci"] == pytest.approx([0.3968, 0.8922], abs=5e-5)
    capsys.readouterr()
    assert evaluate_cli(["table", "--interval", str(out)]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert "exact match [95% CI]" in table[0] and "| 0.7 [0.397, 0.892] |" in table[2], table
    assert evaluate_cli(["table", str(out)]) == 0 and "[0.397" not in capsys.readouterr().out  # without: the value
