"""The GPU check's two `recipes.train` sections: engine steps beside the step model (a dense 8B-shaped
slice and a Qwen3-30B-A3B-shaped MoE slice), and packed rows against unpacked rows (a correctness check).

Both build their recipes, hand them to `gpu_check_runs.run_recipes` (timeouts, the FusedAdam wait, the
section's time budget) and turn each finished run into a row; `report(partial)` is called after every
row, so a check killed at its limit keeps the rows it finished. An engine that does not import here gets
its rows skipped with the reason (gpu_check_requirements.engine_skips), not a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from gpu_check_runs import TINY, Prebuild, Run, Sizes, arithmetic_data, base_recipe, metrics, run_recipes, \
    tokenizer_dir

PACKING_RTOL = 1e-4
ENGINES = ("megatron", "deepspeed")


def _engine_recipe(recipe: dict, engine: str, sizes: Sizes, moe: bool) -> dict:
    recipe["train"]["engine"] = engine
    if engine == "deepspeed":
        recipe["deepspeed"] = {"zero_stage": 1}  # stage 0 reports no gradient norm
    elif moe:
        # one GPU: EP 1; megatron-core 0.16.1's alltoall dispatcher needs CUDA streams, so on CPU `auto` (allgather)
        recipe["megatron"] = {"ep_size": 1, "moe_token_dispatcher": "alltoall" if sizes.cuda else "auto"}
    return recipe


def _layout(output: str) -> str:
    """The engine's own account of what ran: the Megatron engine names its layer spec, fusions and MoE set-up."""
    lines = output.splitlines()
    spec = " ".join(line.split(":", 1)[1].strip() for line in lines
                    if line.startswith("[numloss] megatron: ") or line.startswith("[numloss] megatron MoE: "))
    return spec or next((line.split("layout", 1)[1].strip() for line in lines
                         if line.startswith("[numloss] engine ")), "")


# ---- engine steps beside the step model -----------------------------------------------------------------


def steps_section(sizes: Sizes, work: Path, seqs: list[int], deadline: float, prebuild: Prebuild | None,
                  skips: dict, report: Callable[[dict], None]) -> dict:
    """Dense rows at every row length in `seqs`, the MoE rows at the first; each engine in turn, Megatron
    first (it needs no FusedAdam build). Order: dense at seqs[0], MoE, then the other lengths, so the
    rows a short deadline cuts are the least needed."""
    tok = tokenizer_dir(work)
    plan = [("dense", seqs[0]), ("moe", seqs[0]), *[("dense", s) for s in seqs[1:]]]
    runs, rows = [], []
    section = {"title": f"recipes.train steps, {sizes.layers} layers of Llama-3-8B (dense) and Qwen3-30B-A3B (MoE) "
                        f"widths and vocabularies, random weights, {sizes.steps} steps (medians after the first) "
                        "beside the step model",
               "columns": ["model", "engine", "row_tokens", "tokens_per_micro_batch", "measured_step_s",
                           "predicted_step_s", "measured_tflops", "measured_mfu", "predicted_mfu", "peak_gib",
                           "predicted_gib", "padding_ratio", "router_aux_first", "router_aux_last", "layout", "skipped",
                           "error"],
               "rows": rows, "ok": True}
    for kind, seq in plan:
        micro = max(1, 2048 // seq) if sizes.cuda else 2  # ~2k tokens per micro-batch on the GPU
        accum = 2 if kind == "moe" and not sizes.cuda else 4
        examples = micro * accum * (sizes.steps + 1) * seq // 10  # a plain arithmetic row is ~12-16 tokens
        data, _ = arithmetic_data(work, tok, f"packed-{seq}", examples, pack_length=seq)
        model = {**(sizes.moe if kind == "moe" else sizes.dense), "num_hidden_layers": sizes.layers}
        for engine in ENGINES:
            recipe = base_recipe(model, data, tok, "bfloat16" if sizes.cuda else "float32", {"smmd": {}})
            recipe["train"].update({"steps": sizes.steps, "micro_batch_size": micro, "grad_accum": accum})
            run = Run(_engine_recipe(recipe, engine, sizes, kind == "moe"), work / f"steps-{kind}-{engine}-{seq}",
                      stop_at="throughput.json", after=prebuild if engine == "deepspeed" else None,
                      skipped=skips.get(engine))
            run.key = {"model": f"{'Qwen3-30B-A3B' if kind == 'moe' else 'Llama-3-8B'} x {sizes.layers}"
                                + ("" if sizes.cuda else " (tiny)"), "engine": engine, "row_tokens": seq,
                       "tokens_per_micro_batch": micro * seq}
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
            aux = [r["router/aux"] for r in metrics(run.out_dir) if r.get("router/aux") is not None]
            row.update({"measured_step_s": m.get("step_s"), "predicted_step_s": p.get("step_s"),
                        "measured_tflops": m.get("tflops_per_rank"), "measured_mfu": m.get("mfu"),
                        "predicted_mfu": p.get("mfu"), "peak_gib": max(m.get("peak_mem_gib_per_rank") or [0]),
                        "predicted_gib": p.get("memory_gib"), "padding_ratio": m.get("padding_ratio"),
                        "layout": _layout(run.output)})
            if "moe" in run.out_dir.name:
                if not aux:
                    section["ok"] = False
                    row["error"] = "no router/aux in metrics.jsonl"
                else:  # first and last logged step: the router's load-balancing loss as the engine logs it
                    row.update({"router_aux_first": aux[0], "router_aux_last": aux[-1]})
        rows.append(row)
        report(section)

    run_recipes(runs, sizes.run_timeout_s, deadline, sizes.min_run_s, sizes.steps_parallel, done)
    return section


# ---- packed rows see nothing across an example's boundary ------------------------------------------------


def packing_section(sizes: Sizes, work: Path, deadline: float, prebuild: Prebuild | None, skips: dict,
                    report: Callable[[dict], None]) -> dict:
    """The same 24 examples as one step of unpacked rows and one step of packed rows, on each engine:
    step-1 loss, CE and gradient norm equal (fp32, TF32 off, rel PACKING_RTOL), numeric positions equal."""
    tok = tokenizer_dir(work)
    examples = 24
    unpacked, _ = arithmetic_data(work, tok, "packing-unpacked", examples, pack_length=None, seed=5)
    packed, manifest = arithmetic_data(work, tok, "packing-packed", examples, pack_length=128, seed=5)
    packed_rows = int(manifest["totals"]["rows"])
    model = {**TINY, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
    rows = []
    section = {"title": f"packed vs unpacked rows, one step over the same {examples} examples (fp32, rel "
                        f"{PACKING_RTOL:g})",
               "columns": ["engine", "examples", "packed_rows", "loss_unpacked", "loss_packed", "rel_loss",
                           "grad_norm_unpacked", "grad_norm_packed", "rel_grad_norm", "equal", "skipped", "error"],
               "rows": rows, "ok": True}
    runs = {}
    for engine in ENGINES:
        for name, data, micro, accum in (("unpacked", unpacked, 6, examples // 6), ("packed", packed, 1, packed_rows)):
            # one step holds every example of the data set, so both steps train on the same tokens
            recipe = base_recipe(model, data, tok, "float32", {"smmd": {}, "ntl_was": {}})
            recipe["train"].update({"micro_batch_size": micro, "grad_accum": accum})
            runs[engine, name] = Run(_engine_recipe(recipe, engine, sizes, False),
                                     work / f"packing-{engine}-{name}",
                                     after=prebuild if engine == "deepspeed" else None, skipped=skips.get(engine))

    def done(_: Run) -> None:
        for engine in ENGINES:
            pair = [runs[engine, "unpacked"], runs[engine, "packed"]]
            unfinished = any(r.status is None and r.skipped is None and r.error is None for r in pair)
            if unfinished or any(r["engine"] == engine for r in rows):
                continue  # the pair is not finished, or its row is written
            rows.append(_packing_row(engine, pair, examples, packed_rows, section))
            report(section)

    run_recipes(list(runs.values()), sizes.run_timeout_s, deadline, sizes.min_run_s, sizes.packing_parallel, done)
    return section


def _packing_row(engine: str, pair: list[Run], examples: int, packed_rows: int, section: dict) -> dict:
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
    same = (not missing and all(r <= PACKING_RTOL for r in rel.values())
            and p["numeric_positions"] == u["numeric_positions"])
    section["ok"] &= same
    return {"engine": engine, "examples": examples, "packed_rows": packed_rows,
            "loss_unpacked": u["loss"], "loss_packed": p["loss"], "rel_loss": rel.get("loss"),
            "grad_norm_unpacked": u["grad_norm"], "grad_norm_packed": p["grad_norm"],
            "rel_grad_norm": rel.get("grad_norm"), "equal": same,
            **({"error": f"not logged: {', '.join(missing)}"} if missing else {})}
