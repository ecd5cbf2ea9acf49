"""launch.sweep: a 2x2 grid's expansion, and one backbone of it (two losses, one seed) as tiny Ray jobs on
the simulated cluster, evaluated with recipes.evaluation.evaluate, collected into one CSV + Markdown table;
the table's comparison against the baseline loss from hand-made job directories (no training)."""

from __future__ import annotations

import csv
import hashlib
import json
import time
from dataclasses import asdict

import pytest
import yaml

import launch.sweep
from launch.sweep import collect, load_sweep, main
from recipes.evaluation.placement import Placement
from recipes.reliability.export_writer import RECORD, ExportRecord
from tests.recipes import plugin_helpers

pytestmark = pytest.mark.timeout(400)


def test_a_grid_runs_on_ray_and_writes_the_table(workspace, cluster, tmp_path, monkeypatch, capsys):
    """A 2 x 2 spec expands to its 4 jobs in order; one backbone's row of it (2 jobs: training on the Ray
    cluster, export, evaluation) runs and fills the table, and a second start skips the finished jobs.
    The table's comparisons across backbones and seeds are checked on synthetic results below; here
    the run is what matters, and one backbone with both losses exercises all of it (the backbone's
    override reaches the model: the base recipe has 1 layer, the exported `l2` models 2)."""
    root, recipe = workspace
    spec = {
        "name": "tiny-grid", "base": str(recipe), "out_dir": str(tmp_path / "sweep"),
        "overrides": ["train.steps=2", "train.save_every=0", "train.export=true", f"data.eval={root / 'data'}",
                      "eval.max_new_tokens=4", "eval.batch_size=8"],
        "backbones": {"l1": ["model.config.num_hidden_layers=1"], "l2": ["model.config.num_hidden_layers=2"]},
        "losses": {"ce": ["loss.objective={terms: {}}"], "smmd": ["loss.objective={terms: {smmd: {}}}"]},
        "seeds": [0], "num_workers": 1, "eval_limit": 8,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert [j.name for j in load_sweep(path).jobs] == ["l1-ce-s0", "l1-smmd-s0", "l2-ce-s0", "l2-smmd-s0"]
    del spec["backbones"]["l1"]
    path.write_text(yaml.safe_dump(spec))
    sweep = load_sweep(path)
    assert [j.name for j in sweep.jobs] == ["l2-ce-s0", "l2-smmd-s0"]
    t0 = time.time()
    assert main([str(path)]) == 0
    print(f"sweep: {time.time() - t0:.1f}s")

    rows = list(csv.DictReader((tmp_path / "sweep" / "results.csv").open()))
    assert [r["job"] for r in rows] == [j.name for j in sweep.jobs]
    for r in rows:
        assert r["steps"] == "2" and float(r["train_loss"]) > 0
        assert r["eval_n"] == "8" and r["eval_parse_rate"] != ""
        config = json.loads((tmp_path / "sweep" / r["job"] / "final" / "config.json").read_text())
        assert config["num_hidden_layers"] == 2
    smmd = next(r for r in rows if r["loss"] == "smmd")
    ce = next(r for r in rows if r["loss"] == "ce")
    assert float(smmd["train_loss"]) != float(smmd["train_ce"]) and float(ce["train_loss"]) == float(ce["train_ce"])
    table = (tmp_path / "sweep" / "results.md").read_text()
    assert "| l2-smmd-s0 | l2 | smmd | 0 | 2 |" in table and "Mean ± std over seeds" in table
    assert "| l2 | smmd | 1 | " in table and "1 seed: no ranking" in table  # one seed ranks nothing
    # a second run skips the finished jobs: none trains or is evaluated again, and the table is rebuilt
    calls = []
    monkeypatch.setattr(launch.sweep, "run_job", lambda sweep, job, address=None: calls.append(("train", job.name)))
    monkeypatch.setattr(launch.sweep, "EVALUATE", lambda sweep, job: calls.append(("evaluate", job.name)))
    (tmp_path / "sweep" / "results.md").unlink()
    assert main([str(path)]) == 0
    assert calls == []
    assert (tmp_path / "sweep" / "results.md").read_text() == table
    assert capsys.readouterr().out.count(": done already") == 2


def test_the_table_compares_each_loss_with_the_baseline_of_its_backbone(tmp_path):
    # Three backbones x (ce, smmd) x seeds 0-2, 10 test problems; ce solves problems 0-4 at every seed.
    # b1: smmd solves 5 + s + 1 at seed s: differences +10, +20, +30 points, t interval
    #     20 ± 4.302653 * 10 / sqrt(3) = [-4.8, +44.8].
    # b2: seed 2 not evaluated: two seeds, no ranking, no interval.
    # b3: evaluations without examples: per-seed exact match only, the seed-level interval only.
    spec = {"name": "versus", "base": "unused.yaml", "out_dir": str(tmp_path / "sweep"), "seeds": [0, 1, 2],
            "backbones": {"b1": [], "b2": [], "b3": []}, "losses": {"ce": [], "smmd": []}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    sweep = load_sweep(tmp_path / "sweep.yaml")
    assert sweep.baseline == "ce"
    for job in sweep.jobs:
        if job.backbone == "b2" and job.seed == 2:
            continue
        solved = 5 + (job.seed + 1 if job.loss == "smmd" else 0)
        examples = [{"example_id": f"p{i}", "correct": i < solved} for i in range(10)]
        job.out_dir.mkdir(parents=True)
        (job.out_dir / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 1.0, "ce": 1.0}) + "\n")
        results = {"metrics": {"n": 10, "exact_match": solved / 10}}
        if job.backbone != "b3":
            results["examples"] = examples
        (job.out_dir / "eval_results.json").write_text(json.dumps(results))
    collect(sweep)
    table = (sweep.out_dir / "results.md").read_text()
    b1 = next(line for line in table.splitlines() if line.startswith("| b1 | smmd | 3 | +20.0 ["))
    assert b1.endswith("| +10.0, +20.0, +30.0 | [-4.8, +44.8] |")
    assert "| b2 | smmd | 2 | +15.0, 2 seeds: no ranking | +10.0, +20.0 | – |" in table
    assert "| b3 | smmd | 3 | +20.0 (seed level only) | +10.0, +20.0, +30.0 | [-4.8, +44.8] |" in table
    assert not any(line.startswith("| b1 | ce | 3 | +") for line in table.splitlines())  # no row for the baseline


def test_evaluate_job_places_a_70b_export_on_several_gpus(tmp_path, monkeypatch):
    # A job whose export holds 141 GB of weights (a sparse file) on a node of 8 x 80 GiB: evaluate gets
    # tensor parallel 4 / device_map auto (32.9 GiB a GPU), never one GPU; the recipe's eval backend and
    # section ride along. On a node with no GPU the GPU recipe's job is left unevaluated, with a line.
    spec = {"name": "big", "base": "unused.yaml", "out_dir": str(tmp_path / "sweep"), "seeds": [0],
            "backbones": {"l70": []}, "losses": {"ce": []}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    sweep = load_sweep(tmp_path / "sweep.yaml")
    job = sweep.jobs[0]
    final = job.out_dir / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text(json.dumps({"num_attention_heads": 64}))
    with open(final / "model.safetensors", "wb") as fh:
        fh.truncate(141_107_412_992)
    recipe = {"model": {"name_or_path": "meta-llama/Llama-3.1-70B"}, "data": {"train": "d", "eval": "e"},
              "eval": {"backend": "hf"}, "cluster": {"gpus_per_node": 8}}
    (job.out_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    calls = []
    monkeypatch.setattr(launch.sweep, "evaluate",
                        lambda *args, **kwargs: calls.append((args, kwargs)) or {"metrics": {}})
    monkeypatch.setattr(launch.sweep, "local_gpus", lambda: (8, 80 * 2**30))
    launch.sweep.evaluate_job(sweep, job)
    (args, kwargs), = calls
    assert args == (str(final), "e") and kwargs["backend"] == "hf" and kwargs["eval_section"].backend == "hf"
    assert kwargs["placement"] == Placement(4, 4, "auto", 141_107_412_992)
    monkeypatch.setattr(launch.sweep, "local_gpus", lambda: (0, None))
    assert launch.sweep.evaluate_job(sweep, job) is None and len(calls) == 1


def test_jobs_of_del_and_of_a_users_term_build_and_a_bad_loss_stops_the_sweep_before_any_job(tmp_path, monkeypatch,
                                                                                              capsys):
    """Losses ce, del and a term of the user's (`loss.plugins`, tests/recipes/plugin_helpers.py): every job's
    recipe loads as its run will, with its objective (DEL at 0.01, the user's term at its registered
    default); a loss whose plugin is not importable stops the sweep naming the job, exit 2, before any job
    trains or anything is written."""
    monkeypatch.syspath_prepend(str(plugin_helpers.write_package(tmp_path / "user_code")))
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"model": {"config": {"model_type": "llama"}, "tokenizer": "tok"},
                                    "data": {"train": "data"}}))
    spec = {"name": "terms", "base": str(base), "out_dir": str(tmp_path / "sweep"), "seeds": [0, 1],
            "backbones": {"tiny": []},
            "losses": {"ce": ["loss.objective={terms: {}}"], "del": ["loss.objective={terms: {del: {}}}"],
                       "mine": [f"loss.plugins=[{plugin_helpers.MODULE}]",
                                f"loss.objective={{terms: {{{plugin_helpers.TERM}: {{}}}}}}"]}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    try:
        sweep = load_sweep(tmp_path / "sweep.yaml")
        recipes = launch.sweep.job_recipes(sweep)
        assert list(recipes) == [f"tiny-{loss}-s{s}" for loss in ("ce", "del", "mine") for s in (0, 1)]
        terms = {name: {t: c.weight for t, c in r.loss.objective.terms.items()} for name, r in recipes.items()}
        assert terms["tiny-ce-s0"] == {} and terms["tiny-del-s1"] == {"del": 0.01}
        assert terms["tiny-mine-s0"] == {plugin_helpers.TERM: plugin_helpers.WEIGHT}
        assert recipes["tiny-mine-s0"].loss.plugins == [plugin_helpers.MODULE]
        assert recipes["tiny-del-s1"].train.seed == 1 and recipes["tiny-del-s1"].name == "tiny-del-s1"

        spec["losses"]["lost"] = ["loss.plugins=[numloss_user_terms.gone]"]
        (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
        monkeypatch.setattr(launch.sweep, "run_job", lambda *a, **k: pytest.fail("a job ran"))
        assert main([str(tmp_path / "sweep.yaml")]) == 2
        err = capsys.readouterr().err
        assert "job tiny-lost-s0 (tiny x lost): recipe " in err
        assert "loss.plugins[0]: no module named 'numloss_user_terms.gone'" in err
        assert not (tmp_path / "sweep").exists()
    finally:
        plugin_helpers.forget_package()


def test_a_job_whose_final_does_not_hold_its_last_checkpoint_runs_and_is_evaluated_again(tmp_path, monkeypatch):
    """Every job of this sweep logged and saved its last step (6) and was evaluated; `final/` records step 6
    (the checkpoint's checkpoint.json by its sha256) for seed 0, step 4 for seed 1 (an export cut short
    after the last save), and step 6 of an earlier save of that step (another checkpoint.json) for seed 2.
    The sweep asks the resume policy: seed 0 is done; seeds 1 and 2 are started again (their start exports
    the last checkpoint) and their earlier evaluations, of another model, are redone."""

    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"model": {"config": {"model_type": "llama"}, "tokenizer": "tok"},
                                    "data": {"train": "data"}, "train": {"steps": 6, "export": True}}))
    spec = {"name": "stale", "base": str(base), "out_dir": str(tmp_path / "sweep"), "seeds": [0, 1, 2],
            "backbones": {"tiny": []}, "losses": {"ce": []}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    sweep = load_sweep(tmp_path / "sweep.yaml")
    for job, (step, same_save) in zip(sweep.jobs, [(6, True), (4, True), (6, False)]):
        checkpoint = job.out_dir / "checkpoints" / "step_00000006"
        checkpoint.mkdir(parents=True)
        (checkpoint / "checkpoint.json").write_text(json.dumps({"files": {"model.pt": "a"}}))
        (job.out_dir / "checkpoints" / "latest").write_text("step_00000006")
        sha = hashlib.sha256((checkpoint / "checkpoint.json").read_bytes()).hexdigest()
        record = ExportRecord(step, f"step_{step:08d}", sha if same_save else hashlib.sha256(b"earlier").hexdigest(),
                              "recipe", "deepspeed")
        (job.out_dir / "final").mkdir()
        (job.out_dir / "final" / RECORD).write_text(json.dumps(asdict(record)))
        (job.out_dir / "metrics.jsonl").write_text(json.dumps({"step": 6, "loss": 1.0, "ce": 1.0}) + "\n")
        (job.out_dir / "eval_results.json").write_text(json.dumps({"metrics": {"n": 10, "exact_match": 0.1}}))
    ran, evaluated = [], []
    monkeypatch.setattr(launch.sweep, "run_job", lambda sweep, job, address=None: ran.append(job.name))
    monkeypatch.setattr(launch.sweep, "EVALUATE", lambda sweep, job: evaluated.append(job.name))
    launch.sweep.run_sweep(sweep)
    assert ran == evaluated == ["tiny-ce-s1", "tiny-ce-s2"]
    # without export, the last checkpoint alone finishes a job
    monkeypatch.setattr(launch.sweep, "job_recipes", lambda sweep, only=None: {
        job.name: launch.sweep.load_recipe(base, [*job.overrides, "train.export=false"]) for job in sweep.jobs})
    ran.clear()
    launch.sweep.run_sweep(sweep)
    assert ran == []
