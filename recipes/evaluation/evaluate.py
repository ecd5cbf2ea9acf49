"""Evaluate a trained model on data_prep shards: greedy answers, read with data_prep.answers and scored with
recipes.evaluation.metrics.

    python -m recipes.evaluate --model runs/demo/final --data runs/demo/data/test   # runs/demo/final/eval_results.json
    python -m recipes.evaluate --model DIR --data DIR --answer-format time --limit 500 --name ce
    torchrun --nproc_per_node 8 -m recipes.evaluate --model DIR --data DIR --backend hf   # data-parallel
    python -m recipes.evaluate harness --model DIR --tasks gsm8k    # lm-evaluation-harness (recipes.evaluation.harness)
    python -m recipes.evaluate table a.json b.json ... > table.md      # one Markdown row per run

    from recipes.evaluation.evaluate import evaluate
    results = evaluate("runs/demo/final", "runs/demo/data/test", out="results.json")

What it does, and the decisions behind it (docs/evaluation.md):
- Rows are read straight from the shards of a data_prep directory (manifest order, one example per
  row; packed shards are refused: the answer of a packed row is ambiguous). The prompt of a row is its
  tokens before the first label != -100: exactly the ids the model saw before its answer in training,
  chat template and generation prompt included, so nothing is re-tokenized.
- Generation (`recipes.evaluation.generation`): greedy, up to `max_new_tokens` (None: from the rows'
  longest target), stopping at EOS, at the special token that ends the rows' labels, and at the task's stop
  strings (the manifest's source kinds, `eval.stop`). Backend: vLLM where it imports (`recipes.evaluation.
  vllm_generation`, tensor-parallel over the GPUs `recipes.evaluation.placement` gives the export), else
  Hugging Face generate (layers spread with device_map "auto" when the export needs several GPUs), data-
  parallel over torchrun's ranks (`recipes.evaluation.data_parallel`). Images: Hugging Face only.
- Scoring: the generated text (special tokens dropped) is read with `data_prep.answers.parse_answer` (the
  reader the gold answers were read with; answer_format "number") or its last "H:MM" (answer_format "time"),
  against the row's numeric `answer` (for clock data: minutes past 12 on a 12-hour dial). Metrics: n,
  parse_rate, exact_match, mae, r2; for time: exact_match, parse_rate and time_gap (mean circular gap in
  minutes; mae is the same circular gap, r2 is not reported). Rows whose answer is not one number (a
  DeepMind-Math surd "-14 + 4*sqrt(7)" or base-16 numeral "-191b", a ChartQA text answer) are scored by
  exact match of the generated text against `answer_text` (whitespace around it aside) and count in
  exact_match, not in parse_rate, MAE or R²; `exact_match_95ci` is its 95% Wilson interval over those
  rows (`recipes.evaluation.stats`). The metrics say how many rows each used: n_numeric
  (parse_rate), n_text, n_exact_match, n_mae_r2 (time: n_time_gap). `relaxed_accuracy` (ChartQA's metric: a
  number within 5% relative, else a case-insensitive string match against `answer_text`) is over all rows.
- Vision: when the shards carry images (or `vision=True`), the model is loaded with
  AutoModelForImageTextToText and its AutoProcessor, and the inputs are built by
  `recipes.inputs.vision.vision_inputs`, the same function training uses (so the prompt is token for token
  the trained one): the image placeholder goes in front of the user turn and the processor expands it.
- The results file holds the metrics, the step scored (`export`: from `final/`'s record; a missing
  `final/` is refused, exit 2, one older than its run's last step scored with a warning:
  `recipes.evaluation.exported`), the settings (backend, placement, stop strings, length), and one record
  per example (id, prompt length, generated text, parsed value, target, whether it matched).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from data_prep.answers import parse_answer
from data_prep.shards import read_manifest
from recipes.sections import EVAL_BACKENDS

from . import metrics as M
from . import vllm_generation
from .data_parallel import ProcessGroup, Ranks, device_of, ranks_from_env, share
from .exported import ModelRefused, export_of
from .generation import IGNORE_INDEX, GenerationSettings, generate_texts, load_model, settings_for, task_kinds
from .placement import Placement, place_here
from .stats import wilson_interval

ANSWER_FORMATS = ("number", "time")


# ---- data ---------------------------------------------------------------------------------------------


def load_rows(data_dir: str | os.PathLike, limit: int | None = None) -> list[dict]:
    """The rows of a data_prep directory in manifest order: example_id, input_ids, labels, prompt_ids,
    answer (float or None), answer_text, image (bytes or None). At most `limit` rows."""
    import pyarrow.parquet as pq

    manifest = read_manifest(data_dir)
    if manifest.get("packed"):
        raise ValueError(f"{data_dir}: packed shards cannot be evaluated (several examples per row); "
                         "build the eval split without --pack-length")
    cols = ["example_id", "input_ids", "labels", "answer", "answer_text", "image"]
    rows: list[dict] = []
    for shard in manifest["shards"]:
        table = pq.read_table(os.path.join(data_dir, shard["file"]), columns=cols)
        for r in table.to_pylist():
            labels = r["labels"]
            first = next((i for i, lab in enumerate(labels) if lab != IGNORE_INDEX), len(labels))
            r["prompt_ids"] = r["input_ids"][:first]
            answer = r["answer"]
            r["answer"] = None if answer is None or not math.isfinite(answer) else float(answer)
            rows.append(r)
            if limit is not None and len(rows) >= limit:
                return rows
    return rows


# ---- scoring ------------------------------------------------------------------------------------------


def relaxed_match(prediction: str, answer: float | None, answer_text: str | None, tol: float = 0.05) -> bool:
    """ChartQA's relaxed accuracy: a numeric answer within `tol` relative error, else a string match."""
    if answer is not None:
        p = parse_answer(prediction)
        if p is None:
            return False
        if answer == 0:
            return p == 0
        return abs(p - answer) / abs(answer) <= tol
    if answer_text is None:
        return False
    return prediction.strip().rstrip(".").lower() == answer_text.strip().rstrip(".").lower()


def _finite(x: float) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else float(x)


def score(predictions: Sequence[str], rows: Sequence[dict], answer_format: str = "number") -> tuple[dict, list[dict]]:
    """(metrics, per-example records) for generated texts against the rows' answers."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format: {answer_format!r} is not one of {list(ANSWER_FORMATS)}")
    if len(predictions) != len(rows):
        raise ValueError(f"{len(predictions)} predictions for {len(rows)} rows")
    numeric = [(p, r) for p, r in zip(predictions, rows) if r["answer"] is not None]
    preds = [p for p, _ in numeric]
    targets = [r["answer"] for _, r in numeric]
    examples = []
    for p, r in zip(predictions, rows):
        rec: dict[str, Any] = {"example_id": r["example_id"], "prompt_tokens": len(r["prompt_ids"]),
                               "prediction": p, "target": r["answer"], "target_text": r["answer_text"]}
        if answer_format == "time":
            parsed = M.parse_clock(p)
            rec["parsed"] = parsed
            if r["answer"] is not None:
                gap = M.clock_gap_minutes(parsed, int(r["answer"]))
                rec["time_gap"] = gap
                rec["correct"] = parsed is not None and gap == 0
        else:
            parsed = parse_answer(p)
            rec["parsed"] = parsed
            if r["answer"] is not None:
                rec["correct"] = parsed is not None and abs(parsed - r["answer"]) <= 1e-9
                rec["abs_error"] = None if parsed is None else abs(parsed - r["answer"])
            elif r["answer_text"] is not None:
                rec["correct"] = M.exact_text_match(p, r["answer_text"])
        rec["relaxed"] = relaxed_match(p, r["answer"], r["answer_text"])
        examples.append(rec)

    out: dict[str, Any] = {"n": len(rows), "n_numeric": len(numeric)}
    if answer_format == "time":
        clock = [M.parse_clock(p) for p in preds]
        gaps = [M.clock_gap_minutes(c, int(t)) for c, t in zip(clock, targets)]
        out["parse_rate"] = _finite(sum(c is not None for c in clock) / len(clock)) if clock else None
        out["exact_match"] = (sum(g == 0 for g in gaps if g is not None) / len(gaps)) if gaps else None
        out["n_exact_match"] = len(gaps)
        out["time_gap"] = _finite(M.mean_clock_gap(clock, [int(t) for t in targets])) if clock else None
        out["n_time_gap"] = sum(g is not None for g in gaps)
        out["mae"] = out["time_gap"]
    else:
        s = M.summarize(predictions, [r["answer"] for r in rows], [r["answer_text"] for r in rows])
        for k in ("n_numeric", "n_text", "parse_rate", "exact_match", "n_exact_match", "mae", "r2",
                  "n_mae_r2"):
            out[k] = s[k] if k.startswith("n_") else _finite(s[k])
    out["relaxed_accuracy"] = sum(e["relaxed"] for e in examples) / len(examples) if examples else None
    if out.get("exact_match") is not None and out.get("n_exact_match"):  # its 95% Wilson interval over those rows
        out["exact_match_95ci"] = list(wilson_interval(sum(e.get("correct") is True for e in examples),
                                                       out["n_exact_match"]))
    return out, examples


# ---- entry points -------------------------------------------------------------------------------------


def choose_backend(backend: str, vision: bool, ranks: Ranks, own_generate: bool) -> str:
    """"vllm" or "hf" for `backend` (auto: vLLM where it imports, one process, no images, no model passed in)."""
    if backend not in EVAL_BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {list(EVAL_BACKENDS)}")
    if backend == "hf" or own_generate:
        return "hf"
    if backend == "auto":
        usable = not vision and ranks.world == 1 and vllm_generation.vllm_importable()
        return "vllm" if usable else "hf"
    if vision:
        raise ValueError("backend vllm: these rows have images; vision-language evaluation runs on the hf backend")
    if ranks.world > 1:
        raise ValueError(f"backend vllm under {ranks.world} ranks: vLLM spreads one model over the GPUs itself "
                         "(tensor_parallel_size); start it as one process, or use --backend hf for data parallelism")
    if not vllm_generation.vllm_importable():
        raise ValueError("backend vllm: `import vllm` fails here; install vllm or use backend auto/hf")
    return "vllm"


def evaluate(model_dir: str, data_dir: str, out: str | None = None, batch_size: int = 16,
             max_new_tokens: int | None = None, answer_format: str = "number", limit: int | None = None,
             name: str | None = None, vision: bool | None = None, device: str | None = None,
             dtype: str | None = None, device_map: str | None = None, trust_remote_code: bool = False,
             progress: bool = False, model_and_tokenizer=None,
             generate: Callable[..., list[str]] | None = None, backend: str = "auto",
             stop: Sequence[str] | None = None, eval_section=None, placement: Placement | None = None) -> dict:
    """Generate, score and (if `out`, on rank 0) write the results JSON. Returns the results dict:
    {"name", "model", "data", "settings", "metrics", "examples", "seconds"}.

    vision None: decided by the shards (any row with an image). max_new_tokens None: from the rows' targets.
    stop None: the tasks' stop strings (`eval_section`, a recipe's `eval`, else recipes.sections.EVAL_STOP).
    placement None: from the export's size and this node's GPUs (`recipes.evaluation.placement`); an export
    that fits them in no way is refused before loading. Under torchrun (hf backend) every rank generates a
    share of the rows and the results are those of one process. `model_and_tokenizer` = (model,
    tokenizer[, processor]) skips loading; `generate` replaces `generate_texts` (same signature)."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format: {answer_format!r} is not one of {list(ANSWER_FORMATS)}")
    t0 = time.time()
    export, stale = (None, None) if model_and_tokenizer is not None or generate is not None else export_of(model_dir)
    if stale and ranks_from_env().is_main:
        print(f"[numloss] warning: {stale}", file=sys.stderr, flush=True)
    rows = load_rows(data_dir, limit)
    if not rows:
        raise ValueError(f"{data_dir}: no rows to evaluate")
    kinds = task_kinds(read_manifest(data_dir))
    if vision is None:
        vision = any(r["image"] for r in rows)
    ranks = ranks_from_env()
    chosen = choose_backend(backend, vision, ranks, model_and_tokenizer is not None or generate is not None)
    if placement is None and model_and_tokenizer is None and generate is None:
        placement = place_here(model_dir)
    if placement is not None and placement.gpus > 1 and ranks.world > 1:
        raise ValueError(f"{model_dir}: needs {placement.gpus} GPUs per copy; data-parallel ranks hold one GPU "
                         "each: run it as one process (vLLM tensor parallelism or device_map auto)")

    llm, processor, model = None, None, None
    if model_and_tokenizer is not None:
        model, tokenizer, *rest = model_and_tokenizer
        processor = rest[0] if rest else None
    elif chosen == "vllm":
        tokenizer, generation_config = _tokenizer_and_generation_config(model_dir, trust_remote_code)
        llm = vllm_generation.load_llm(model_dir, placement.tensor_parallel_size, dtype, trust_remote_code)
    else:
        model, tokenizer, processor = load_model(
            model_dir, vision=vision, device=device_of(ranks, device), dtype=dtype,
            device_map=device_map or (placement.device_map if placement else None),
            trust_remote_code=trust_remote_code)
    if llm is None:
        generation_config = getattr(model, "generation_config", None)
    settings = settings_for(rows, generation_config, tokenizer, kinds, eval_section, max_new_tokens, batch_size,
                            stop)

    if chosen == "vllm":
        predictions = vllm_generation.generate_vllm(llm, rows, settings)
    else:
        predictions = _generate_hf(generate or generate_texts, model, tokenizer, processor, rows, settings,
                                   ranks, progress)
    scores, examples = score(predictions, rows, answer_format)
    results = {
        "name": name or Path(str(model_dir)).resolve().parent.name or str(model_dir),
        "model": str(model_dir),
        "export": export,  # the step scored, from final/'s record (recipes.evaluation.exported); None: no record
        "data": str(data_dir),
        "settings": {**settings.to_dict(), "answer_format": answer_format, "limit": limit, "vision": bool(vision),
                     "backend": chosen, "tasks": kinds, "data_parallel_ranks": ranks.world,
                     "placement": placement.to_dict() if placement else None},
        "metrics": scores,
        "seconds": round(time.time() - t0, 3),
        "examples": examples,
    }
    if out and ranks.is_main:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


def _tokenizer_and_generation_config(model_dir: str, trust_remote_code: bool):
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    try:
        generation_config = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # an export without generation_config.json: the tokenizer's EOS is the stop id
        generation_config = None
    return tokenizer, generation_config


def _generate_hf(gen: Callable[..., list[str]], model, tokenizer, processor, rows: list[dict],
                 settings: GenerationSettings, ranks: Ranks, progress: bool) -> list[str]:
    """This rank's share of the rows generated, every rank's texts gathered in row order."""
    mine = share(rows, ranks) if ranks.world > 1 else list(range(len(rows)))
    group = ProcessGroup(ranks)
    try:
        texts = gen(model, tokenizer, [rows[i] for i in mine], batch_size=settings.batch_size,
                    max_new_tokens=settings.max_new_tokens, processor=processor, progress=progress and ranks.is_main,
                    stop=settings.stop, stop_ids=settings.stop_ids)
        return group.gather(dict(zip(mine, texts)), len(rows))
    finally:
        group.close()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipes.evaluate",
                                description=" ".join(__doc__.split("\n\n")[0].split()),  # the first paragraph
                                epilog="`python -m recipes.evaluate table RESULTS.json ...` prints a "
                                       "Markdown table of several runs (recipes.evaluation.report); "
                                       "`python -m recipes.evaluate harness ...` runs lm-evaluation-harness tasks.")
    p.add_argument("--model", required=True, help="a model directory (e.g. <train.out_dir>/final)")
    p.add_argument("--data", required=True, help="a data_prep output directory")
    p.add_argument("--out", default=None, help="results JSON (default: <model>/eval_results.json)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default: the data's longest target in tokens plus half of it, at least 16")
    p.add_argument("--stop", action="append", default=None,
                   help="a stop string (repeat for several; default: the tasks' own, recipes.sections.EVAL_STOP)")
    p.add_argument("--backend", choices=EVAL_BACKENDS, default="auto",
                   help="auto: vLLM where it imports, else Hugging Face generate")
    p.add_argument("--answer-format", choices=ANSWER_FORMATS, default="number")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--name", default=None, help="run name in tables (default: the model's parent dir)")
    p.add_argument("--vision", choices=("auto", "yes", "no"), default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None)
    p.add_argument("--device-map", default=None,
                   help="e.g. auto: shard a large model over the GPUs (default: from the export's size)")
    p.add_argument("--trust-remote-code", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    out = a.out or os.path.join(a.model, "eval_results.json")
    vision = {"auto": None, "yes": True, "no": False}[a.vision]
    try:
        export_of(a.model)  # a missing final/ is refused before anything is read
    except ModelRefused as err:
        print(f"[numloss] {err}", file=sys.stderr, flush=True)
        return 2
    res = evaluate(a.model, a.data, out=out, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens,
                   answer_format=a.answer_format, limit=a.limit, name=a.name, vision=vision,
                   device=a.device, dtype=a.dtype, device_map=a.device_map,
                   trust_remote_code=a.trust_remote_code, progress=True, backend=a.backend, stop=a.stop)
    if ranks_from_env().is_main:
        m = res["metrics"]
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
