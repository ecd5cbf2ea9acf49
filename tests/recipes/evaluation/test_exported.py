"""recipes.evaluation.exported, through `python -m recipes.evaluate`'s main: a missing `final/` is refused in
one line (exit 2) before anything is read; an export older than its run's last step is scored with a
warning and the results record the step scored; a current export scores without one."""

import json
import shutil
from dataclasses import asdict

import pytest

from recipes.evaluate import main as evaluate_cli
from recipes.reliability.export_writer import RECORD, ExportRecord


def _run_dir(tmp_path, rec_model_dir, exported: int, trained: int):
    """A run directory as recipes.train leaves it: final/ (the tiny model) recording step `exported`,
    checkpoints/latest naming step `trained`, metrics.jsonl up to it."""
    run = tmp_path / "run"
    shutil.copytree(rec_model_dir, run / "final")
    record = ExportRecord(exported, f"step_{exported:08d}", None, "0" * 64, "deepspeed")
    (run / "final" / RECORD).write_text(json.dumps(asdict(record)))
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text(f"step_{trained:08d}")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, trained + 1)))
    return run


def _evaluate(model, data, out, capfd):
    code = evaluate_cli(["--model", str(model), "--data", data, "--out", str(out), "--limit", "3",
                         "--batch-size", "3", "--max-new-tokens", "2", "--backend", "hf"])
    return code, capfd.readouterr().err


def test_a_missing_final_is_refused_in_one_line_naming_how_to_make_it(tmp_path, rec_data_dir, capfd):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    out = tmp_path / "results.json"
    code, err = _evaluate(run / "final", rec_data_dir, out, capfd)
    said = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and said == [f"[numloss] --model {run / 'final'}: no such directory; final/ is written by "
                                  "`python -m recipes.train RECIPE.yaml` when a run with train.export: true finishes "
                                  "(`train.out_dir`/final)"], err
    assert not out.exists()
    (run / "checkpoints" / "latest").write_text("step_00000008")  # trained, not exported: the same command exports
    code, err = _evaluate(run / "final", rec_data_dir, out, capfd)
    assert code == 2 and f"{run} has checkpoint step_00000008: run the same `python -m recipes.train" in err, err
    code, err = _evaluate("runs/nowhere/final", rec_data_dir, out, capfd)  # a relative path, not a Hub id
    assert code == 2 and "Traceback" not in err and "--model runs/nowhere/final: no such directory" in err, err


@pytest.mark.parametrize("exported, trained", [(6, 8), (8, 8)])
def test_the_results_record_the_step_scored_and_an_older_export_is_warned_of(tmp_path, rec_model_dir, rec_data_dir,
                                                                            capfd, exported, trained):
    run = _run_dir(tmp_path, rec_model_dir, exported, trained)
    out = tmp_path / "results.json"
    code, err = _evaluate(run / "final", rec_data_dir, out, capfd)
    assert code == 0, err
    saved = json.loads(out.read_text())
    assert saved["export"] == {"step": exported, "checkpoint": f"step_{exported:08d}", "engine": "deepspeed",
                               "run_last_step": trained}
    warned = [line for line in err.splitlines() if "holds the model of step" in line]
    if exported < trained:
        assert warned == [f"[numloss] warning: {run / 'final'} holds the model of step 6 (from checkpoint "
                          f"step_00000006), but its run {run} trained to step 8 (its checkpoints/latest, step_00000008): "
                          "scoring step 6. "
                          "To score step 8, run the run's `python -m recipes.train RECIPE.yaml` command again (it "
                          "exports its last checkpoint)"], err
    else:
        assert warned == [], err
