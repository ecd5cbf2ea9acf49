"""`launch.ray submit` leaves the recipe's data, run and local model directories inside the working dir
out of the upload (Ray zips the working dir for every job; data sets and runs would go with the code)."""

from __future__ import annotations

import json

import yaml

from launch.ray import SUBMIT_EXCLUDES, submit, submit_command, submit_excludes


def _recipe(root):
    (root / "data" / "gsm8k").mkdir(parents=True)
    (root / "models" / "tok").mkdir(parents=True)
    (root / "recipe.yaml").write_text(yaml.safe_dump({
        "model": {"name_or_path": "meta-llama/Meta-Llama-3-8B", "tokenizer": "models/tok"},
        "data": {"train": "data/gsm8k", "eval": "/elsewhere/eval"},
        "train": {"out_dir": "runs/x"}}))
    return root / "recipe.yaml"


def test_recipe_dirs_inside_the_working_dir_are_excluded(tmp_path):
    recipe = _recipe(tmp_path)
    got = submit_excludes(str(recipe), ["eval.data=data/svamp"], tmp_path)
    assert got[:len(SUBMIT_EXCLUDES)] == SUBMIT_EXCLUDES
    assert set(got[len(SUBMIT_EXCLUDES):]) == {"/data/gsm8k", "/runs/x", "/models/tok", "/data/svamp"}
    # relative recipe path, read from the working dir; an override moves the run outside it
    assert "/runs/x" not in submit_excludes("recipe.yaml", ["train.out_dir=/shared/runs/x"], tmp_path)


def test_submit_sends_them_to_ray(tmp_path):
    recipe = _recipe(tmp_path)

    class Client:  # records what would go to the Jobs API (no job server on this path)
        def submit_job(self, entrypoint, runtime_env):
            self.runtime_env = runtime_env
            return "job-1"

    client = Client()
    assert submit("http://x:8265", str(recipe), [], wait=False, working_dir=tmp_path, client=client)["job_id"] == "job-1"
    assert "/data/gsm8k" in client.runtime_env["excludes"] and client.runtime_env["working_dir"] == str(tmp_path)
    cmd = submit_command("http://x:8265", str(recipe))
    excludes = json.loads(cmd[cmd.index("--runtime-env-json") + 1])["excludes"]
    assert excludes[:len(SUBMIT_EXCLUDES)] == SUBMIT_EXCLUDES
