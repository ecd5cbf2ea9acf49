"""lm-evaluation-harness on any export: the benchmarks the papers report, run through lm-eval's Python API, the
results written in numloss's results format so they sit in the same tables as numloss's own metrics.

    python -m recipes.evaluate harness --model runs/llama8b-smmd/final --tasks gsm8k,gsm8k_cot --name smmd
    python -m recipes.evaluate harness --model DIR --tasks my_task --include-path tasks/   # local task YAMLs
    python -m recipes.evaluate table runs/*/final/eval_results.json runs/*/final/harness_results.json  # one row per run

- Backend: lm-eval's vLLM backend where vllm imports (`--backend auto`), tensor-parallel over the GPUs that
  `recipes.evaluation.placement` gives the export (a 70B bf16 export on 80 GiB GPUs: 4), else its Hugging Face
  backend (`parallelize=True`, layers spread over the GPUs, when the export needs more than one). The same
  call runs the standard tasks on a cluster and a local task (JSONL files + a task YAML) offline.
- Tasks run as lm-eval defines them (prompt, few-shot, stop sequences, filters, metrics), so the numbers are
  the published kind. A local task's prompt is what its YAML's `doc_to_text` writes, not data_prep's
  template: no BOS, no plain separator, no chat template unless `--apply-chat-template`; a model trained
  on data_prep's rows may answer it differently from `python -m recipes.evaluate` on the same problems
  (that one scores the rows' own prompt tokens). To compare the two, write the YAML's `doc_to_text` as the
  build's template writes the prompt. lm-eval's version, the backend and its arguments, and each task's version, shots,
  sample count and whole config (with its sha256) are recorded beside the metrics.
- Metrics: "<task> <metric>" (filter "none") or "<task> <metric> (<filter>)", e.g. "gsm8k exact_match
  (strict-match)"; stderr beside them under "harness". For generated-answer tasks numloss also reads each
  response and target with `data_prep.answers.parse_answer` ("<task> numloss exact match", over the samples
  whose target reads as a number): the reader numloss's own evaluation uses, on the harness's outputs. The
  per-document records are kept in "examples" (the raw response, not lm-eval's filtered one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from data_prep.answers import parse_answer

from .exported import ModelRefused, export_of
from .placement import Placement, place_here
from .vllm_generation import vllm_importable

BACKENDS = {"hf": "hf", "vllm": "vllm"}  # numloss's backend name -> lm-eval's model name
NUMLOSS_EXACT = "numloss exact match"


def model_args(backend: str, model_dir: str, placement: Placement, dtype: str | None = None,
               trust_remote_code: bool = False) -> dict[str, Any]:
    """lm-eval's model_args for an export on its placement."""
    args: dict[str, Any] = {"pretrained": str(model_dir), "trust_remote_code": trust_remote_code}
    if backend == "vllm":
        return {**args, "tensor_parallel_size": placement.tensor_parallel_size, "dtype": dtype or "bfloat16",
                "gpu_memory_utilization": 0.9}
    args["dtype"] = dtype or ("bfloat16" if placement.gpus else "float32")
    if placement.gpus > 1:
        args["parallelize"] = True  # lm-eval's HF backend: device_map "auto" over the visible GPUs
    return args


def _config_sha256(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def _first_text(value) -> str:
    while isinstance(value, (list, tuple)):  # [[text]] (resps) or [text] (filtered_resps)
        value = value[0] if value else ""
    return value if isinstance(value, str) else str(value)


def examples_of(task: str, samples: Sequence[dict]) -> list[dict]:
    """One record per document of a generated-answer task: the model's raw response, the target, and both read
    with `parse_answer` ("correct": the response's number is the target's; None where the target has none)."""
    out = []
    for s in samples:
        prediction = _first_text(s.get("resps") or [""])
        target_text = _first_text(s.get("target"))
        target, parsed = parse_answer(target_text), parse_answer(prediction)
        correct = None if target is None else (
            parsed is not None and math.isclose(parsed, target, rel_tol=1e-9, abs_tol=1e-12))
        out.append({"example_id": f"{task}/{s.get('doc_id')}", "task": task, "prediction": prediction,
                    "target_text": target_text, "target": target, "parsed": parsed, "correct": correct})
    return out


def to_results(raw: dict, model_dir: str, name: str, backend: str, settings: dict) -> dict:
    """numloss's results dict from lm-eval's simple_evaluate output."""
    metrics: dict[str, Any] = {}
    stderr: dict[str, Any] = {}
    for task, values in raw["results"].items():
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, filt = key.split(",", 1)
            column = f"{task} {metric.replace('_stderr', '')}" + ("" if filt == "none" else f" ({filt})")
            (stderr if metric.endswith("_stderr") else metrics)[column] = value
        n = (raw.get("n-samples", {}).get(task) or {}).get("effective")
        if n is not None:
            metrics[f"{task} n"] = n
    examples = []
    for task, samples in (raw.get("samples") or {}).items():
        if raw.get("configs", {}).get(task, {}).get("output_type") == "generate_until":
            records = examples_of(task, samples)
            scored = [e["correct"] for e in records if e["correct"] is not None]
            if scored:
                metrics[f"{task} {NUMLOSS_EXACT}"] = sum(scored) / len(scored)
            examples += records
    tasks = {}
    for task, config in raw.get("configs", {}).items():
        tasks[task] = {"version": raw.get("versions", {}).get(task), "n_shot": raw.get("n-shot", {}).get(task),
                       "n_samples": raw.get("n-samples", {}).get(task), "config_sha256": _config_sha256(config),
                       "config": config}
    cfg = raw.get("config", {})
    return {
        "name": name, "model": str(model_dir),
        "harness": {"lm_eval_version": raw.get("lm_eval_version"), "backend": backend,
                    "model_args": cfg.get("model_args"), "transformers_version": raw.get("transformers_version"),
                    "tasks": tasks, "stderr": stderr},
        "settings": settings,
        "metrics": metrics,
        "examples": examples,
    }


def _task_manager(task_manager_class, tasks: Sequence[str], include_path: str | None):
    """lm-eval's task index: the include path's alone when it holds every task asked for (indexing lm-eval's
    ~15,000 built-in tasks takes a minute on a busy CPU), else the built-in tasks as well."""
    if include_path:
        local = task_manager_class(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    return task_manager_class(include_path=include_path)


def run_harness(model_dir: str, tasks: Sequence[str], out: str | None = None, name: str | None = None,
                backend: str = "auto", include_path: str | None = None, num_fewshot: int | None = None,
                limit: int | float | None = None, batch_size: int | str = 8, device: str | None = None,
                dtype: str | None = None, placement: Placement | None = None, gen_kwargs: str | None = None,
                apply_chat_template: bool = False, trust_remote_code: bool = False) -> dict:
    """Run lm-eval `tasks` on an export; returns (and, with `out`, writes) numloss's results dict."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ValueError("harness: no tasks given (e.g. --tasks gsm8k)")
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"harness backend: {backend!r} is not one of {['auto', *BACKENDS]}")
    chosen = ("vllm" if vllm_importable() else "hf") if backend == "auto" else backend
    if chosen == "vllm" and not vllm_importable():
        raise ValueError("harness backend vllm: `import vllm` fails here; install vllm or use --backend hf")
    export, stale = export_of(model_dir)  # the step scored (recipes.evaluation.exported)
    if stale:
        print(f"[numloss] warning: {stale}", file=sys.stderr, flush=True)
    placement = placement or place_here(model_dir)
    manager = _task_manager(TaskManager, tasks, include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"harness: unknown task(s) {unknown} (lm-eval {lm_eval.__version__}"
                         f"{', include path ' + include_path if include_path else ''})")
    args = model_args(chosen, model_dir, placement, dtype, trust_remote_code)
    if device is None and chosen == "hf":
        device = "cuda" if placement.gpus else "cpu"  # lm-eval's HF backend would take cuda
    t0 = time.time()
    raw = lm_eval.simple_evaluate(model=BACKENDS[chosen], model_args=args, tasks=list(tasks), num_fewshot=num_fewshot,
                                  limit=limit, batch_size=batch_size, device=device, task_manager=manager,
                                  log_samples=True, gen_kwargs=gen_kwargs, apply_chat_template=apply_chat_template)
    if raw is None:  # lm-eval returns None on the ranks other than 0
        return {}
    settings = {"tasks": list(tasks), "num_fewshot": num_fewshot, "limit": limit, "batch_size": batch_size,
                "gen_kwargs": gen_kwargs, "apply_chat_template": apply_chat_template, "include_path": include_path,
                "placement": placement.to_dict()}
    results = to_results(raw, model_dir, name or Path(str(model_dir)).resolve().parent.name or str(model_dir),
                         chosen, settings)
    results["export"] = export
    results["seconds"] = round(time.time() - t0, 3)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1, default=str))
    return results


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipes.evaluate harness",
                                description=" ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph, whole
    p.add_argument("--model", required=True, help="a model directory (e.g. <train.out_dir>/final)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (e.g. gsm8k,minerva_math)")
    p.add_argument("--out", default=None, help="results JSON (default: <model>/harness_results.json)")
    p.add_argument("--name", default=None, help="run name in tables (default: the model's parent dir)")
    p.add_argument("--backend", choices=("auto", *BACKENDS), default="auto",
                   help="auto: lm-eval's vLLM backend where vllm imports, else its HF backend")
    p.add_argument("--include-path", default=None,
                   help="a folder of task YAMLs (local tasks); their prompts are what each YAML's doc_to_text "
                        "writes, not data_prep's template (no BOS or plain separator): see the module docs")
    p.add_argument("--num-fewshot", type=int, default=None, help="default: each task's own")
    p.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if < 1)")
    p.add_argument("--batch-size", default="8")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None)
    p.add_argument("--gen-kwargs", default=None, help='lm-eval\'s, e.g. "max_gen_toks=512"')
    p.add_argument("--apply-chat-template", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    limit = None if a.limit is None else (int(a.limit) if a.limit >= 1 else a.limit)
    batch = int(a.batch_size) if a.batch_size.isdigit() else a.batch_size
    out = a.out or str(Path(a.model) / "harness_results.json")
    try:
        export_of(a.model)  # a missing final/ is refused before lm-eval starts
    except ModelRefused as err:
        print(f"[numloss] {err}", file=sys.stderr, flush=True)
        return 2
    res = run_harness(a.model, tasks, out=out, name=a.name, backend=a.backend, include_path=a.include_path,
                      num_fewshot=a.num_fewshot, limit=limit, batch_size=batch, device=a.device, dtype=a.dtype,
                      gen_kwargs=a.gen_kwargs, apply_chat_template=a.apply_chat_template,
                      trust_remote_code=a.trust_remote_code)
    if res:
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in res["metrics"].items()))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
