"""Experiment trackers beside metrics.jsonl: Weights & Biases and MLflow, each sent the rows metrics.jsonl
gets (`MetricsLog.log`), on rank 0.

Settings (`train.tracking`, `recipes.sections.TrackingSection`): `backends` (wandb, mlflow), `project` (the W&B
project / MLflow experiment; default the recipe's name), `entity`, `group`, `tags`, `mode` (online, offline)
and MLflow's `tracking_uri`. `train.wandb_project: P` is shorthand for `backends: [wandb], project: P`.

One run, one tracker run: the ids are made when the run directory first starts and kept in
`<run dir>/tracking.json`, so every resume of that run directory (a restart, a requeue, a preemption) logs
into the same W&B run and MLflow run, and another run directory (another lr, another seed) gets runs of
its own, even under the same recipe name. tracking.json also keeps the last step sent: a resume from an
older checkpoint re-runs steps the trackers already hold (with the same values: resumes are bit-exact),
and those are not sent twice (W&B drops steps below its last one; MLflow would keep both).

A resume's recipe changes (a term's weight, the lr, ... as the resume policy lets them change) are recorded
in both: W&B's run config is updated to the recipe in effect; MLflow's params cannot change once logged, so
the first start's stay, each changed key is logged again as `from_step_<N>/<key>` (N: the resume's first
step; a prefix, not a suffix: MLflow's file store keeps a param as a file named by its key) and the tag `numloss.recipe_changes` lists every change as `step N: key: old -> new`.

Offline: W&B's `mode: offline` writes its files under `<run dir>/wandb` (`wandb sync` uploads them later
with the same id); MLflow offline logs to the run directory's file store (`<run dir>/mlruns`; MLflow 3 keeps
that store in maintenance mode, so MLFLOW_ALLOW_FILE_STORE=true is set for it; `mlflow ui
--backend-store-uri <run dir>/mlruns` reads it), which is also where it logs online when neither
`tracking_uri` nor MLFLOW_TRACKING_URI names a server.

wandb and mlflow are optional (extras `numloss[wandb]`, `numloss[mlflow]`): imported only when a recipe
names them, with the install line in the error when absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
import uuid
from pathlib import Path

STATE = "tracking.json"
INSTALL = {"wandb": "pip install -e '.[wandb]'", "mlflow": "pip install -e '.[mlflow]'"}


def settings(recipe) -> dict:
    """The trackers a recipe asks for and their settings, `train.wandb_project` folded in."""
    tracking = recipe.train.tracking
    backends = list(tracking.backends)
    project = tracking.project
    if recipe.train.wandb_project:
        if "wandb" not in backends:
            backends.append("wandb")
        if project is not None and project != recipe.train.wandb_project:
            raise ValueError(f"train.wandb_project ({recipe.train.wandb_project!r}) and train.tracking.project"
                             f" ({project!r}) disagree: give one")
        project = recipe.train.wandb_project
    return {"backends": backends, "project": project or recipe.name, "entity": tracking.entity,
            "group": tracking.group, "tags": list(tracking.tags), "mode": tracking.mode,
            "tracking_uri": tracking.tracking_uri}


def tracking_problems(recipe) -> list[str]:
    """What stops the recipe's trackers before any model is built: settings that disagree, a tracker
    package that is not installed (each with its install line)."""
    try:
        wanted = settings(recipe)
    except ValueError as err:
        return [str(err)]
    return [f"train.tracking: {name} is not installed: {INSTALL[name]}" for name in wanted["backends"]
            if importlib.util.find_spec(name) is None]


def tracker_row(row: dict) -> dict[str, float | None]:
    """The numbers of a (strict JSON) metrics row, without its step: what a tracker takes."""
    return {k: (None if v is None else float(v)) for k, v in row.items()
            if k != "step" and (v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)))}


def _flat(data: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, name + "."))
        else:
            out[name] = json.dumps(value, sort_keys=True, default=str)
    return out


FROM_STEP = re.compile(r"from_step_(\d+)(?:\.(\d+))?/(.+)")
CHANGES_TAG = "numloss.recipe_changes"


def _record_changes(client, run_id: str, recipe: dict[str, str], first_step: int) -> None:
    """MLflow: the keys of `recipe` (flat, as logged) whose value differs from the one in effect in the run
    (its first params, then each `from_step_<N>/<key>` in order), logged as `from_step_<first_step>/<key>`,
    and the `numloss.recipe_changes` tag extended (module docstring)."""
    from mlflow.entities import Param, RunTag

    run = client.get_run(run_id)
    logged = run.data.params
    in_effect = {k: v for k, v in logged.items() if not FROM_STEP.fullmatch(k)}
    later = sorted(((int(m.group(1)), int(m.group(2) or 0)), m.group(3), v)
                   for k, v in logged.items() if (m := FROM_STEP.fullmatch(k)))
    for _, key, value in later:
        in_effect[key] = value
    changed = {k: v[:6000] for k, v in recipe.items() if in_effect.get(k) != v[:6000]}
    if not changed:
        return
    params = []
    for key, value in sorted(changed.items()):
        name, again = f"from_step_{first_step}/{key}", 1
        while name in logged:  # a second resume from the same step with other values: params never change
            name, again = f"from_step_{first_step}.{again}/{key}", again + 1
        params.append(Param(name, value))
    said = [f"step {first_step}: {k}: {in_effect.get(k, '(unset)')} -> {v}" for k, v in sorted(changed.items())]
    before = run.data.tags.get(CHANGES_TAG)
    tag = RunTag(CHANGES_TAG, "\n".join(([before] if before else []) + said)[-5000:])
    for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(run_id, params=params[start:start + 100], tags=[tag] if start == 0 else [])


def _import(name: str):
    try:
        return __import__(name)
    except ImportError as err:
        raise ImportError(f"train.tracking names {name}, which is not installed: {INSTALL[name]}") from err


class Trackers:
    """The run's trackers (none when the recipe names none). `log(row)` after metrics.jsonl's line."""

    def __init__(self, recipe, out: Path, resumed_step: int = 0):
        self.settings = settings(recipe)
        self.resumed_step = resumed_step
        self.path = Path(out) / STATE
        self.state = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.sent = int(self.state.get("logged_step", 0))
        self.wandb = self.mlflow = None
        self.skipped = 0
        if not self.settings["backends"]:
            return
        self.state.setdefault("ids", {})
        if "wandb" in self.settings["backends"]:
            self.wandb = self._start_wandb(recipe, Path(out))
        if "mlflow" in self.settings["backends"]:
            self.mlflow = self._start_mlflow(recipe, Path(out))
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps({**self.state, "logged_step": self.sent}, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def _start_wandb(self, recipe, out: Path):
        wandb = _import("wandb")
        s = self.settings
        ids = self.state["ids"]
        resumed = "wandb" in ids
        if not resumed:  # W&B run ids: letters, digits, - and _; unique per run directory
            ids["wandb"] = f"{re.sub(r'[^A-Za-z0-9_-]', '-', recipe.name)[:48]}-{uuid.uuid4().hex[:8]}"
        run = wandb.init(project=s["project"], entity=s["entity"], group=s["group"], tags=s["tags"] or None,
                         name=recipe.name, id=ids["wandb"], resume="allow", dir=str(out), mode=s["mode"],
                         config=None if resumed else recipe.to_dict())
        if resumed:  # a resume may change what the resume policy lets change (lr, logging, ...)
            run.config.update(recipe.to_dict(), allow_val_change=True)
        return run

    def _start_mlflow(self, recipe, out: Path):
        _import("mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        s = self.settings
        uri = s["tracking_uri"]
        if uri is None and (s["mode"] == "offline" or not os.environ.get("MLFLOW_TRACKING_URI")):
            uri = (out / "mlruns").resolve().as_uri()
            # MLflow 3 keeps its file store in maintenance mode and refuses it unless asked: it is the
            # store that needs no server and no database package, inside the run directory
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(tracking_uri=uri)
        ids = self.state["ids"]
        if "mlflow" in ids:
            client.update_run(ids["mlflow"], status="RUNNING")
            _record_changes(client, ids["mlflow"], _flat(recipe.to_dict()), self.resumed_step + 1)
            return client
        experiment = client.get_experiment_by_name(s["project"])
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(s["project"])
        tags = {"numloss.recipe": recipe.name, **({"numloss.group": s["group"]} if s["group"] else {}),
                **{tag: "true" for tag in s["tags"]}}
        run = client.create_run(experiment_id, run_name=recipe.name, tags=tags)
        ids["mlflow"] = run.info.run_id
        ids["mlflow_tracking_uri"] = uri
        params = [Param(k, v[:6000]) for k, v in _flat(recipe.to_dict()).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(run.info.run_id, params=params[start:start + 100])
        return client

    def log(self, row: dict) -> None:
        """Send `row` (metrics.jsonl's strict row) to every tracker, unless its step was sent before."""
        if self.wandb is None and self.mlflow is None:
            return
        step = int(row["step"])
        if step <= self.sent:
            self.skipped += 1
            return
        values = tracker_row(row)
        if self.wandb is not None:
            self.wandb.log(values, step=step)
        if self.mlflow is not None:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            metrics = [Metric(k, v, now, step) for k, v in values.items() if v is not None]
            for start in range(0, len(metrics), 1000):
                self.mlflow.log_batch(self.state["ids"]["mlflow"], metrics=metrics[start:start + 1000])
        self.sent = step
        self._write()

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.set_terminated(self.state["ids"]["mlflow"])
