"""recipes.evaluation.harness: lm-evaluation-harness on a tiny export, offline (a local task: JSONL + task YAML,
lm-eval's HF backend), its results in numloss's format and in the same table as numloss's own metrics."""

import json

import pytest

from recipes.evaluate import main as evaluate_cli
from recipes.evaluation import harness as H
from recipes.evaluation.placement import Placement
from recipes.evaluation.report import markdown_table

TASK_YAML = """task: numloss_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["Question:"]
  do_sample: false
  max_gen_toks: 6
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 2.0
"""

QUESTIONS = ["What is 1 + 2?", "What is 3 + 4?", "What is 10 + 5?", "What is 7 + 8?"]


def _task(folder, answers):
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "test.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in zip(QUESTIONS, answers)))
    (folder / "numloss_tiny.yaml").write_text(TASK_YAML.format(data=data))
    return folder


@pytest.mark.timeout(600)
def test_a_local_task_on_a_tiny_export_through_the_cli_and_the_api(rec_model_dir, tmp_path, capsys):
    lm_eval = pytest.importorskip("lm_eval")
    first = tmp_path / "first.json"
    tasks = _task(tmp_path / "tasks1", ["3", "7", "15", "15"])
    assert evaluate_cli(["harness", "--model", rec_model_dir, "--tasks", "numloss_tiny", "--include-path",
                         str(tasks), "--backend", "hf", "--batch-size", "2", "--out", str(first), "--name", "tiny"]) == 0
    res = json.loads(first.read_text())
    h = res["harness"]
    assert h["lm_eval_version"] == lm_eval.__version__ and h["backend"] == "hf"
    assert h["model_args"]["pretrained"] == rec_model_dir and h["model_args"]["dtype"] == "float32"
    task = h["tasks"]["numloss_tiny"]
    assert task["version"] == 2.0 and task["n_shot"] == 0 and task["n_samples"]["effective"] == 4
    assert task["config"]["generation_kwargs"]["until"] == ["Question:"] and len(task["config_sha256"]) == 64
    assert res["metrics"]["numloss_tiny n"] == 4 and "numloss_tiny exact_match" in res["metrics"]
    responses = [e["prediction"] for e in res["examples"]]
    assert [e["example_id"] for e in res["examples"]] == [f"numloss_tiny/{i}" for i in range(4)]

    # The targets of documents 0 and 2 replaced by what the model answered: lm-eval's exact match is 1/2,
    # which the same greedy generation must reproduce.
    tasks2 = _task(tmp_path / "tasks2", [responses[0], "never", responses[2], "never"])
    again = H.run_harness(rec_model_dir, ["numloss_tiny"], include_path=str(tasks2), backend="hf", batch_size=2,
                          name="tiny", out=str(tmp_path / "second.json"))
    assert [e["prediction"] for e in again["examples"]] == responses
    assert again["metrics"]["numloss_tiny exact_match"] == 0.5
    assert again["harness"]["tasks"]["numloss_tiny"]["config_sha256"] != task["config_sha256"]  # another data file

    with pytest.raises(ValueError, match=r"unknown task\(s\) \['no_such_task'\]"):
        H.run_harness(rec_model_dir, ["no_such_task"], include_path=str(tasks), backend="hf")


def _raw(samples):
    """lm-eval's simple_evaluate output for one generated-answer task, by hand."""
    return {"results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25,
                                  "exact_match_stderr,strict-match": 0.2, "exact_match,flexible-extract": 0.5,
                                  "exact_match_stderr,flexible-extract": 0.25}},
            "configs": {"gsm8k": {"task": "gsm8k", "output_type": "generate_until", "num_fewshot": 5}},
            "versions": {"gsm8k": 3.0}, "n-shot": {"gsm8k": 5}, "n-samples": {"gsm8k": {"original": 4, "effective": 4}},
            "config": {"model_args": {"pretrained": "m"}}, "lm_eval_version": "0.4.13", "samples": {"gsm8k": samples}}


def test_results_in_numloss_format_with_the_reader_on_the_responses():
    samples = [  # (target, response): numloss reads 1,236 and 72 right, "six" is no number, "Yes" no target
        ("Each... #### 1,236", "So the answer is 1,236."), ("She sold 72.\n#### 72", "#### 72\n\nQuestion: next"),
        ("#### 5", "six"), ("Yes", "Yes")]
    raw = _raw([{"doc_id": i, "target": t, "resps": [[r]], "filtered_resps": ["[invalid]"]}
                for i, (t, r) in enumerate(samples)])
    res = H.to_results(raw, "m", "smmd", "hf", {"tasks": ["gsm8k"]})
    m = res["metrics"]
    assert m == {"gsm8k exact_match (strict-match)": 0.25, "gsm8k exact_match (flexible-extract)": 0.5,
                 "gsm8k n": 4, "gsm8k numloss exact match": 2 / 3}
    assert res["harness"]["stderr"] == {"gsm8k exact_match (strict-match)": 0.2,
                                        "gsm8k exact_match (flexible-extract)": 0.25}
    assert [e["correct"] for e in res["examples"]] == [True, True, False, None]
    assert [e["parsed"] for e in res["examples"]] == [1236.0, 72.0, None, None]

    own = {"name": "smmd", "metrics": {"n": 10, "exact_match": 0.7, "n_exact_match": 10}}
    table = markdown_table([own, res]).splitlines()
    assert table[0] == ("| run | n | exact match | n exact | gsm8k exact_match (flexible-extract) | "
                        "gsm8k exact_match (strict-match) | gsm8k n | gsm8k numloss exact match |")
    assert table[2] == "| smmd | 10 | 0.7 | 10 | 0.5 | 0.25 | 4 | 0.6667 |"  # one row for the run
    assert table[4].startswith("- smmd: lm-eval 0.4.13 (hf backend), gsm8k version 3.0, 5-shot, 4 documents, "
                               "config sha256 ")
    overlapping = markdown_table([own, dict(own, metrics={"n": 5})]).splitlines()
    assert len(overlapping) == 4  # the same metric twice: two rows, never one overwritten


def test_model_args_follow_the_placement():
    big = Placement(4, 4, "auto", 141 * 10**9)
    assert H.model_args("vllm", "m", big) == {"pretrained": "m", "trust_remote_code": False,
                                              "tensor_parallel_size": 4, "dtype": "bfloat16",
                                              "gpu_memory_utilization": 0.9}
    assert H.model_args("hf", "m", big) == {"pretrained": "m", "trust_remote_code": False, "dtype": "bfloat16",
                                            "parallelize": True}
    assert H.model_args("hf", "m", Placement(0, 1, None, 10)) == {"pretrained": "m", "trust_remote_code": False,
                                                                  "dtype": "float32"}
