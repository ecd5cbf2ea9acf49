"""The GPU check's two `recipes.train` sections: one engine step per engine at Llama-3.2-1B's shape beside
the step model, and packed rows against unpacked rows (a correctness check).

Both build their recipes, hand them to `gpu_check_runs.run_recipes` (timeouts, the section's share of the
deadline) and turn each finished run into a row; `report(partial)` is called after every row, so a check
killed at its limit keeps the rows it finished. An engine that does not import here gets its rows skipped
with the reason (gpu_check_requirements.engine_skips), not a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from gpu_check_runs import TINY, Run, Sizes, arithmetic_data, base_recipe, metrics, run_recipes, tokenizer_dir

PACKING_RTOL = {"float32": 1e-4, "bfloat16": 1e-2}  # bf16: 8 mantissa bits, GEMMs of other shapes per layout
ENGINES = ("megatron", "deepspeed")


def _engine_recipe(recipe: dict, engine: str) -> dict:
    recipe["train"]["engine"] = engine
    if engine == "deepspeed":
        recipe["deepspeed"] = {"zero_stage": 1}  # stage 0 reports no gradient norm
    return recipe


def _layout(output: str) -> str:
    """The engine's own account of what ran: the Megatron engine names its layer spec and fusions, every
    engine its optimizer and layout."""
    lines = output.splitlines()
    spec = " ".join(line.split(":", 1)[1].strip() for line in lines if line.startswith("[numloss] megatron: "))
    engine = next((line.split("[numloss] engine ", 1)[1].strip() for line in lines
                   if line.startswith("[numloss] engine ")), "")
    return "; ".join(part for part in (engine, spec) if part)


# ---- one training step per engine beside the step model -------------------------------------------------


def steps_section(sizes: Sizes, work: Path, seqs: list[int], deadline: float, skips: dict,
                  report: Callable[[dict], None]) -> dict:
    """The model at every row length in `seqs`, Megatron then DeepSpeed ZeRO-1 at each, one run at a time on
    a GPU (they are timed): the rows a short deadline cuts are the last lengths."""
    tok = tokenizer_dir(work)
    runs, rows = [], []
    model = sizes.dense
    name = "Llama-3.2-1B" if sizes.cuda else "tiny llama"
    section = {"title": f"recipes.train steps, {name} ({model['num_hidden_layers']} layers, hidden "
                        f"{model['hidden_size']}, vocabulary {model['vocab_size']}), random weights, {sizes.steps} "
                        "steps (medians after the first) beside the step model",
               "columns": ["model", "engine", "row_tokens", "tokens_per_micro_batch", "tokens_per_step",
                           "measured_step_s",
                           "predicted_step_s", "measured_tokens_per_s", "measured_tflops", "measured_mfu",
                           "predicted_mfu", "step_vs_predicted", "peak_gib", "predicted_gib", "padding_ratio",
                           "layout", "skipped", "error"],
               "rows": rows, "ok": True}
    for seq in seqs:
        micro = max(1, 4096 // seq) if sizes.cuda else 2  # ~4k tokens per micro-batch on the GPU
        accum = 2
        examples = micro * accum * (sizes.steps + 1) * seq // 10  # a plain arithmetic row is ~12-16 tokens
        data, _ = arithmetic_data(work, tok, f"packed-{seq}", examples, pack_length=seq)
        for engine in ENGINES:
            recipe = base_recipe(model, data, tok, "bfloat16" if sizes.cuda else "float32", {"smmd": {}})
            recipe["train"].update({"steps": sizes.steps, "micro_batch_size": micro, "grad_accum": accum})
            run = Run(_engine_recipe(recipe, engine), work / f"steps-{engine}-{seq}", stop_at="throughput.json",
                      skipped=skips.get(engine))
            run.key = {"model": name, "engine": engine, "row_tokens": seq, "tokens_per_micro_batch": micro * seq,
                       "tokens_per_step": micro * seq * accum}
            runs.append(run)

    def done(run: Run) -> None:
        row = dict(run.key)
        result_path = run.out_dir / "throughput.json"
        if run.skipped:
            row["skipped"] = run.skipped
        elif run.status != 0 or not result_path.is_file():
            section["ok"] = False
            row["error"] = run.error or f"exit {run.status}: no throughput.json: {run.output[-1500:]}"
        else:
            result = json.loads(result_path.read_text())
            m, p = result["measured"], result.get("predicted") or {}
            step_s, predicted = m.get("step_s"), p.get("step_s")
            row.update({"measured_step_s": step_s, "predicted_step_s": predicted,
                        "measured_tokens_per_s": run.key["tokens_per_step"] / step_s if step_s else None,
                        "measured_tflops": m.get("tflops_per_rank"),
                        "measured_mfu": m.get("mfu"), "predicted_mfu": p.get("mfu"),
                        "step_vs_predicted": step_s / predicted if step_s and predicted else None,
                        "peak_gib": max(m.get("peak_mem_gib_per_rank") or [0]), "predicted_gib": p.get("memory_gib"),
                        "padding_ratio": m.get("padding_ratio"), "layout": _layout(run.output)})
        rows.append(row)
        report(section)

    run_recipes(runs, sizes.run_timeout_s, deadline, sizes.min_run_s, sizes.steps_parallel, done)
    return section


# ---- packed rows see nothing across an example's boundary ------------------------------------------------


def packing_section(sizes: Sizes, work: Path, deadline: float, skips: dict, te_missing: str | None,
                    report: Callable[[dict], None]) -> dict:
    """The same 24 examples as one step of unpacked rows and one step of packed rows: step-1 loss, CE and
    gradient norm equal (rel PACKING_RTOL of the dtype), numeric positions equal. On a GPU this is Megatron's
    Transformer Engine spec (THD sequences, cu_seqlens) in bf16, the path the CPU cannot run (TE has no fp32
    attention for THD rows); without TE it is one row saying so. On CPU (`--smoke`) both engines in fp32, the
    local spec's block mask and DeepSpeed's."""
    rows = []
    dtype = "bfloat16" if sizes.cuda else "float32"
    engines = ("megatron",) if sizes.cuda else ENGINES
    examples = 24
    section = {"title": f"packed vs unpacked rows, one step over the same {examples} examples ({dtype}, rel "
                        f"{PACKING_RTOL[dtype]:g})" + (", Megatron's Transformer Engine spec" if sizes.cuda else ""),
               "columns": ["engine", "examples", "packed_rows", "loss_unpacked", "loss_packed", "rel_loss",
                           "grad_norm_unpacked", "grad_norm_packed", "rel_grad_norm", "equal", "skipped", "error"],
               "rows": rows, "ok": True}
    if sizes.cuda and te_missing:
        section["skipped"] = (f"Transformer Engine cannot run here ({te_missing}): the THD packed rows it runs are "
                              "the GPU-only path; the local spec's and DeepSpeed's packed rows are checked on CPU")
        return section
    tok = tokenizer_dir(work)
    unpacked, _ = arithmetic_data(work, tok, "packing-unpacked", examples, pack_length=None, seed=5)
    packed, manifest = arithmetic_data(work, tok, "packing-packed", examples, pack_length=128, seed=5)
    packed_rows = int(manifest["totals"]["rows"])
    model = {**TINY, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
    runs = {}
    for engine in engines:
        for name, data, micro, accum in (("unpacked", unpacked, 6, examples // 6), ("packed", packed, 1, packed_rows)):
            # one step holds every example of the data set, so both steps train on the same tokens
            recipe = base_recipe(model, data, tok, dtype, {"smmd": {}, "ntl_was": {}})
            recipe["train"].update({"micro_batch_size": micro, "grad_accum": accum})
            if sizes.cuda:
                recipe["megatron"] = {"transformer_impl": "transformer_engine"}
            runs[engine, name] = Run(_engine_recipe(recipe, engine), work / f"packing-{engine}-{name}",
                                     skipped=skips.get(engine))

    def done(_: Run) -> None:
        for engine in engines:
            pair = [runs[engine, "unpacked"], runs[engine, "packed"]]
            unfinished = any(r.status is None and r.skipped is None and r.error is None for r in pair)
            if unfinished or any(r["engine"] == engine for r in rows):
                continue  # the pair is not finished, or its row is written
            rows.append(_packing_row(engine, pair, examples, packed_rows, PACKING_RTOL[dtype], section))
            report(section)

    run_recipes(list(runs.values()), sizes.run_timeout_s, deadline, sizes.min_run_s, sizes.packing_parallel, done)
    return section


def _packing_row(engine: str, pair: list[Run], examples: int, packed_rows: int, rtol: float,
                 section: dict) -> dict:
    skipped = [r.skipped for r in pair if r.skipped]
    if skipped:
        return {"engine": engine, "skipped": skipped[0]}
    values = {}
    for name, run in zip(("unpacked", "packed"), pair):
        logged = metrics(run.out_dir)
        if run.status != 0 or not logged:
            values[name] = {"error": run.error or f"exit {run.status}: nothing logged"}
        else:
            values[name] = {k: logged[0].get(k) for k in ("loss", "ce", "grad_norm", "numeric_positions")}
    if any("error" in v for v in values.values()):
        section["ok"] = False
        return {"engine": engine, "error": " | ".join(v.get("error", "") for v in values.values())}
    u, p = values["unpacked"], values["packed"]
    missing = [k for k in ("loss", "ce", "grad_norm") if u[k] is None or p[k] is None]
    rel = {k: abs(p[k] - u[k]) / max(abs(u[k]), 1e-12) for k in ("loss", "ce", "grad_norm") if k not in missing}
    same = (not missing and all(r <= rtol for r in rel.values())
            and p["numeric_positions"] == u["numeric_positions"])
    section["ok"] &= same
    return {"engine": engine, "examples": examples, "packed_rows": packed_rows,
            "loss_unpacked": u["loss"], "loss_packed": p["loss"], "rel_loss": rel.get("loss"),
            "grad_norm_unpacked": u["grad_norm"], "grad_norm_packed": p["grad_norm"],
            "rel_grad_norm": rel.get("grad_norm"), "equal": same,
            **({"error": f"not logged: {', '.join(missing)}"} if missing else {})}
