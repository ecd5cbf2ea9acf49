"""The run's trackers (`recipes.training.tracking`, through `MetricsLog`): W&B in offline mode and MLflow on
a file store get the rows metrics.jsonl gets; the ids are made once per run directory and kept in
tracking.json, so a resume logs into the same runs (and never sends a step twice) while another run
directory of the same recipe name gets runs of its own; entity/project/group/tags come from the recipe."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from numloss import ObjectiveConfig
from recipes.config import Recipe
from recipes.sections import TrackingSection
from recipes.training.run_log import MetricsLog
from recipes.training.runtime import Runtime

MAIN = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def _rows(steps) -> list[dict]:
    return [{"step": s, "loss": 3.0 - 0.25 * s, "ce": 2.0 - 0.1 * s, "term/smmd": 0.5 / s, "grad_norm": None,
             "lr": 1e-3, "recipe_changed": ["optim.lr"]} for s in steps]


def _recipe(backends, **tracking) -> Recipe:
    recipe = Recipe(name="tiny/run")
    recipe.train.tensorboard = False
    recipe.train.tracking = TrackingSection(backends=backends, **tracking)
    return recipe


def _run(recipe, out: Path, resumed: int, steps) -> None:
    log = MetricsLog(recipe, out, MAIN, resumed)
    try:
        for row in _rows(steps):
            log.log(row)
    finally:
        log.close()


def _wandb_records(path: Path):
    """The protobuf records of a W&B transaction log (`run-<id>.wandb`): a 7-byte ":W&B" header, then
    LevelDB-log framing in 32 KiB blocks (per chunk: CRC32, 2-byte length, type full/first/middle/last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        payload, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield payload
        elif kind in (2, 3):
            pending += payload
        elif kind == 4:
            yield pending + payload
            pending = b""


def _wandb_history(out: Path, attempts: int) -> dict[str, list[dict]]:
    """Every offline W&B run under `out/wandb`: its id -> the history rows it recorded, in order. W&B's
    service may still be writing a log's last records when `finish()` returns: waits (30 s at most) until
    each of the `attempts` logs has its exit record."""
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + 30
    while True:
        paths = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
        records = [[wandb_internal_pb2.Record.FromString(d) for d in _wandb_records(p)] for p in paths]
        done = [any(r.WhichOneof("record_type") == "exit" for r in rs) for rs in records]
        if (len(paths) == attempts and all(done)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    runs: dict[str, list[dict]] = {}
    for path, rs in zip(paths, records):
        for record in rs:
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
                runs.setdefault(run.run_id, [])
                runs[run.run_id + "/meta"] = [{"project": run.project, "group": run.run_group,
                                               "tags": list(run.tags), "name": run.display_name}]
            elif kind == "history":
                runs.setdefault(path.stem.removeprefix("run-"), []).append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return runs


def test_wandb_offline_one_run_per_run_directory_across_resumes(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = _recipe(["wandb"], project="numloss-tests", group="sweep-a", tags=["cpu", "tiny"], mode="offline")
    out = tmp_path / "run"
    out.mkdir()
    _run(recipe, out, 0, [1, 2, 3])
    state = json.loads((out / "tracking.json").read_text())
    run_id = state["ids"]["wandb"]
    assert run_id.startswith("tiny-run-") and state["logged_step"] == 3
    _run(recipe, out, 2, [3, 4])  # resumed from the step-2 checkpoint: step 3 again, then 4
    assert json.loads((out / "tracking.json").read_text())["ids"]["wandb"] == run_id
    history = _wandb_history(out, attempts=2)
    assert set(history) == {run_id, run_id + "/meta"}  # both attempts are the same W&B run
    assert history[run_id + "/meta"] == [{"project": "numloss-tests", "group": "sweep-a", "tags": ["cpu", "tiny"],
                                          "name": "tiny/run"}]
    steps = [row["_step"] for row in history[run_id]]
    assert steps == [1, 2, 3, 4], steps  # step 3 sent once
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    for sent, row in zip(history[run_id], metrics):
        assert sent["loss"] == row["loss"] and sent["term/smmd"] == row["term/smmd"] and sent["grad_norm"] is None
    # another run directory, same recipe name: its own run
    other = tmp_path / "other"
    other.mkdir()
    _run(recipe, other, 0, [1])
    assert json.loads((other / "tracking.json").read_text())["ids"]["wandb"] != run_id


def test_mlflow_file_store_one_run_per_run_directory_across_resumes(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    recipe = _recipe(["mlflow"], project="numloss-tests", group="sweep-a", tags=["cpu"], mode="offline")
    out = tmp_path / "run"
    out.mkdir()
    _run(recipe, out, 0, [1, 2, 3])
    _run(recipe, out, 2, [3, 4])
    state = json.loads((out / "tracking.json").read_text())
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    run = client.get_run(state["ids"]["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny/run"
    assert client.get_experiment(run.info.experiment_id).name == "numloss-tests"
    assert run.data.tags["numloss.group"] == "sweep-a" and run.data.tags["cpu"] == "true"
    assert run.data.params["train.tracking.backends"] == '["mlflow"]'
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "term/smmd"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == [(r["step"], r[key]) for r in metrics], (key, history)
    assert client.get_metric_history(run.info.run_id, "grad_norm") == []  # null: not a number to plot
    assert len(client.search_runs([run.info.experiment_id])) == 1
    assert "numloss.recipe_changes" not in run.data.tags  # the same recipe resumed: nothing changed

    # a resume at step 4 with a lower lr and another term weight (as the resume policy lets them change):
    # the first start's params stay (MLflow never changes one), each change is logged from its step
    recipe.optim.lr = 1e-4
    recipe.loss.objective = ObjectiveConfig.from_dict({"terms": {"smmd": {"weight": 1.0}}})
    _run(recipe, out, 4, [5])
    run = client.get_run(state["ids"]["mlflow"])
    assert run.data.params["optim.lr"] == "1e-05" and run.data.params["from_step_5/optim.lr"] == "0.0001"
    weight = "loss.objective.terms.smmd.weight"
    assert run.data.params[f"from_step_5/{weight}"] == "1.0", sorted(run.data.params)
    assert "step 5: optim.lr: 1e-05 -> 0.0001" in run.data.tags["numloss.recipe_changes"].splitlines()
    recipe.optim.lr = 3e-5  # a later resume: compared with the value in effect, not the first start's
    _run(recipe, out, 5, [6])
    run = client.get_run(state["ids"]["mlflow"])
    assert run.data.tags["numloss.recipe_changes"].splitlines()[-1] == "step 6: optim.lr: 0.0001 -> 3e-05"
    assert sum(k.endswith(weight) for k in run.data.params) == 1  # unchanged since step 5: not logged again
    other = tmp_path / "other"
    other.mkdir()
    _run(recipe, other, 0, [1])
    assert json.loads((other / "tracking.json").read_text())["ids"]["mlflow"] != run.info.run_id


def test_settings_fold_in_wandb_project_and_refuse_bad_values():
    from recipes.training.tracking import settings

    recipe = _recipe([])
    recipe.train.wandb_project = "p"
    assert settings(recipe)["backends"] == ["wandb"] and settings(recipe)["project"] == "p"
    assert settings(_recipe([]))["backends"] == [] and settings(_recipe([]))["project"] == "tiny/run"
    with pytest.raises(ValueError, match="train.tracking.backends"):
        TrackingSection(backends=["comet"])
    with pytest.raises(ValueError, match="train.tracking.mode"):
        TrackingSection(mode="sometimes")


def test_a_tracker_that_is_not_installed_is_refused_before_any_model(monkeypatch):
    import importlib.util

    from recipes.training.tracking import tracking_problems

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    assert tracking_problems(_recipe(["mlflow"])) == ["train.tracking: mlflow is not installed: pip install -e '.[mlflow]'"]
    recipe = _recipe(["wandb"], project="a")
    recipe.train.wandb_project = "b"
    assert "disagree" in tracking_problems(recipe)[0]
