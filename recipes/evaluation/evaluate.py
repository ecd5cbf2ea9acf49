"""Evaluate a trained model on data_prep shards: greedy answers, parsed and scored with recipes.evaluation.metrics.

    python -m recipes.evaluate --model runs/demo/final --data runs/demo/data/test --out results.json
    python -m recipes.evaluate --model DIR --data DIR --answer-format time --limit 500 --name ce
    python -m recipes.evaluate table a.json b.json ... > table.md      # one Markdown row per run

    from recipes.evaluation.evaluate import evaluate
    results = evaluate("runs/demo/final", "runs/demo/data/test", out="results.json")

What it does, and the decisions behind it:
- Rows are read straight from the shards of a data_prep directory (manifest order, one example per
  row; packed shards are refused: the answer of a packed row is ambiguous). The prompt of a row is its
  tokens before the first label != -100: exactly the ids the model saw before its answer in training,
  chat template and generation prompt included, so nothing is re-tokenized.
- Generation: batched greedy decoding with left padding (rows sorted by prompt length to waste little
  padding, results put back in row order), up to `max_new_tokens`, stopping at EOS. The stop ids are
  the tokenizer's and generation config's EOS plus every special token that ends a row's labels in the
  shards (a chat template's end-of-turn, e.g. "<|im_end|>"), so a chat model stops where it was trained
  to stop.
- Scoring: the generated text (special tokens dropped) is parsed with `recipes.evaluation.metrics`: the last
  number (answer_format "number") or the last "H:MM" (answer_format "time"), against the row's numeric
  `answer` (for clock data: minutes past 12 on a 12-hour dial). Metrics: n, parse_rate, exact_match,
  mae, r2; for time: exact_match, parse_rate and time_gap (mean circular gap in minutes; mae is the
  same circular gap, r2 is not reported). Rows whose answer is not one number (a DeepMind-Math surd
  "-14 + 4*sqrt(7)" or base-16 numeral "-191b", a ChartQA text answer) are scored by exact match of
  the generated text against `answer_text` (whitespace around it aside) and count in exact_match,
  not in parse_rate, MAE or R². The metrics say how many rows each used: n_numeric (parse_rate),
  n_text, n_exact_match, n_mae_r2 (time: n_time_gap). `relaxed_accuracy` (ChartQA's metric: a number
  within 5% relative, else a case-insensitive string match against `answer_text`) is over all rows.
- Vision: when the shards carry images (or `vision=True`), the model is loaded with
  AutoModelForImageTextToText and its AutoProcessor, and the inputs are built by
  `recipes.inputs.vision.vision_inputs`, the same function training uses (so the prompt is token for token
  the trained one): the image placeholder goes in front of the user turn and the processor expands it.
- The results file holds the metrics, the settings, and one record per example (id, prompt length,
  generated text, parsed value, target, whether it matched).
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

from data_prep.shards import read_manifest

from data_prep.answers import parse_answer

from . import metrics as M
from recipes.inputs.vision import load_processor, vision_inputs

IGNORE_INDEX = -100
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


# ---- model --------------------------------------------------------------------------------------------


def pick_device(device: str | None = None):
    import torch

    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(model_dir: str, vision: bool = False, device=None, dtype: str | None = None,
               device_map: str | None = None, trust_remote_code: bool = False):
    """(model, tokenizer, processor or None) in eval mode. dtype None: bf16 on a GPU, fp32 on the CPU."""
    import torch
    from transformers import AutoTokenizer

    device = pick_device(device)
    if dtype is None:
        torch_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if device_map:
        kwargs["device_map"] = device_map
    processor = None
    if vision:
        from transformers import AutoModelForImageTextToText

        processor = load_processor(model_dir, trust_remote_code=trust_remote_code)
        tokenizer = processor.tokenizer
        model = AutoModelForImageTextToText.from_pretrained(model_dir, **kwargs)
    else:
        from transformers import AutoModelForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    if not device_map:
        model.to(device)
    model.eval()
    return model, tokenizer, processor


def stop_token_ids(model, tokenizer, rows: Sequence[dict]) -> list[int]:
    """EOS ids of the tokenizer and generation config, plus each special token that ends a row's labels."""
    ids: set[int] = set()
    for source in (getattr(tokenizer, "eos_token_id", None),
                   getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(x) for x in source)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for r in rows:
        last = [lab for lab in r["labels"] if lab != IGNORE_INDEX]
        if last and last[-1] in special:
            ids.add(int(last[-1]))
    return sorted(ids)


def _pad_id(tokenizer, stops: Sequence[int]) -> int:
    if getattr(tokenizer, "pad_token_id", None) is not None:
        return int(tokenizer.pad_token_id)
    return int(stops[0]) if stops else 0


def generate_texts(model, tokenizer, rows: Sequence[dict], batch_size: int = 16, max_new_tokens: int = 16,
                   processor=None, progress: bool = False) -> list[str]:
    """Greedy continuations of each row's prompt (left-padded batches), decoded without special tokens."""
    import torch

    stops = stop_token_ids(model, tokenizer, rows)
    pad = _pad_id(tokenizer, stops)
    device = next(model.parameters()).device
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt_ids"]))
    out: list[str | None] = [None] * len(rows)
    t0 = time.time()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        batch_rows = [rows[i] for i in idx]
        if processor is not None and any(r.get("image") for r in batch_rows):
            inputs = vision_inputs(processor, [r["prompt_ids"] for r in batch_rows],
                                   [r.get("image") for r in batch_rows],
                                   where=[f"example {r['example_id']}" for r in batch_rows])
            inputs = {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}
        else:
            width = max(len(r["prompt_ids"]) for r in batch_rows)
            ids = torch.full((len(idx), width), pad, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for j, r in enumerate(batch_rows):
                n = len(r["prompt_ids"])
                if n:
                    ids[j, width - n:] = torch.tensor(r["prompt_ids"], dtype=torch.long)
                    mask[j, width - n:] = 1
            inputs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        with torch.no_grad():
            gen = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                 eos_token_id=stops or None, pad_token_id=pad, temperature=None,
                                 top_p=None, top_k=None)
        new = gen[:, inputs["input_ids"].shape[1]:].tolist()
        for j, i in enumerate(idx):
            toks = new[j]
            for k, t in enumerate(toks):  # cut at the first stop token (the rest is padding)
                if t in stops:
                    toks = toks[:k]
                    break
            out[i] = tokenizer.decode(toks, skip_special_tokens=True)
        if progress:
            done = min(b + batch_size, len(order))
            print(f"  {done}/{len(order)} rows, {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    return [o or "" for o in out]


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
    return out, examples


# ---- entry points -------------------------------------------------------------------------------------


def evaluate(model_dir: str, data_dir: str, out: str | None = None, batch_size: int = 16,
             max_new_tokens: int = 16, answer_format: str = "number", limit: int | None = None,
             name: str | None = None, vision: bool | None = None, device: str | None = None,
             dtype: str | None = None, device_map: str | None = None, trust_remote_code: bool = False,
             progress: bool = False, model_and_tokenizer=None,
             generate: Callable[..., list[str]] | None = None) -> dict:
    """Generate, score and (if `out`) write the results JSON. Returns the results dict:
    {"name", "model", "data", "settings", "metrics", "examples", "seconds"}.

    vision None: decided by the shards (any row with an image). `model_and_tokenizer` = (model,
    tokenizer[, processor]) skips loading; `generate` replaces `generate_texts` (same signature)."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format: {answer_format!r} is not one of {list(ANSWER_FORMATS)}")
    t0 = time.time()
    rows = load_rows(data_dir, limit)
    if not rows:
        raise ValueError(f"{data_dir}: no rows to evaluate")
    if vision is None:
        vision = any(r["image"] for r in rows)
    if model_and_tokenizer is not None:
        model, tokenizer, *rest = model_and_tokenizer
        processor = rest[0] if rest else None
    else:
        model, tokenizer, processor = load_model(model_dir, vision=vision, device=device, dtype=dtype,
                                                 device_map=device_map, trust_remote_code=trust_remote_code)
    gen = generate or generate_texts
    predictions = gen(model, tokenizer, rows, batch_size=batch_size, max_new_tokens=max_new_tokens,
                      processor=processor, progress=progress)
    scores, examples = score(predictions, rows, answer_format)
    results = {
        "name": name or Path(str(model_dir)).resolve().parent.name or str(model_dir),
        "model": str(model_dir),
        "data": str(data_dir),
        "settings": {"batch_size": batch_size, "max_new_tokens": max_new_tokens,
                     "answer_format": answer_format, "limit": limit, "vision": bool(vision),
                     "decoding": "greedy"},
        "metrics": scores,
        "seconds": round(time.time() - t0, 3),
        "examples": examples,
    }
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipes.evaluate", description=__doc__.split("\n")[0],
                                epilog="`python -m recipes.evaluate table RESULTS.json ...` prints a "
                                       "Markdown table of several runs (recipes.evaluation.report).")
    p.add_argument("--model", required=True, help="a model directory (e.g. <train.out_dir>/final)")
    p.add_argument("--data", required=True, help="a data_prep output directory")
    p.add_argument("--out", default=None, help="results JSON (default: <model>/eval_results.json)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--answer-format", choices=ANSWER_FORMATS, default="number")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--name", default=None, help="run name in tables (default: the model's parent dir)")
    p.add_argument("--vision", choices=("auto", "yes", "no"), default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None)
    p.add_argument("--device-map", default=None, help="e.g. auto: shard a large model over the GPUs")
    p.add_argument("--trust-remote-code", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _parser().parse_args(argv)
    out = a.out or os.path.join(a.model, "eval_results.json")
    vision = {"auto": None, "yes": True, "no": False}[a.vision]
    res = evaluate(a.model, a.data, out=out, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens,
                   answer_format=a.answer_format, limit=a.limit, name=a.name, vision=vision,
                   device=a.device, dtype=a.dtype, device_map=a.device_map,
                   trust_remote_code=a.trust_remote_code, progress=True)
    m = res["metrics"]
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
