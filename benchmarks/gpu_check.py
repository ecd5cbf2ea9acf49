"""The project's GPU check: what only a GPU can show, in one script of at most ~8 minutes on one GPU.

    python benchmarks/gpu_check.py [--out runs/gpu_check] [--sections losses,steps,packing] [--seqs 1024,200]
    python benchmarks/gpu_check.py --smoke     # CPU, tiny shapes: every code path, no figure worth keeping

Sections (each one's failure is reported and the next one still runs):
1. `losses`: part 1 of `benchmarks/bench_gpu_losses.py`: one forward + backward over logits [4, 2048, 128256]
   (a Llama-3 vocabulary, 8,192 tokens, 25% numeric labels) in bf16, median of 5: numloss's objective (eager,
   fused, fused with the gradient in place) with CE alone and with each term, at N = 10 (digits) and
   N = 1000 (Llama-3 integers), beside torch's eager cross-entropy (fp32 upcast) and torch.compile'd
   cross-entropy; time and peak memory above the logits. The targets of the fused-pass
   work (CE alone <= 1.2x compiled CE in time and <= it in memory; a term <= 1.10x of CE at N = 10,
   <= 1.25x at N = 1000) are printed beside the ratios, not enforced.
2. `steps`: `python -m recipes.train` on an 8B-shaped slice (Llama-3-8B's widths, heads and vocabulary,
   `--layers` layers, random weights, bf16) for a few steps on each engine (DeepSpeed ZeRO-1; Megatron
   with the Transformer Engine spec when TE imports), on packed rows of each `--seqs` length: the
   measured TFLOP/s, MFU and step time of the steps after the first beside the step model's prediction
   for the same recipe (`recipes.training.throughput` writes both into the run's throughput.json). The
   run is stopped once that file exists: its final checkpoint (~20 GB) is not what is measured.
3. `packing`: a correctness check. The same 24 examples as one step of unpacked rows and as one step of
   packed rows (several examples per row) must give the same step-1 loss and gradient norm (fp32, TF32
   off, rel 1e-4) on each engine: Megatron's packed rows go through THD attention under TE, DeepSpeed's
   through flash-attention's variable-length path when it imports (else the block mask). A packed row
   that attended across an example's boundary would change both values.

Output: the tables on stdout, `<out>/gpu_check.json` and `<out>/gpu_check.md`. Exit status 1 when a
section raised or a correctness check failed; 0 otherwise (targets missed included).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


# Llama-3-8B's widths (config.json of meta-llama/Meta-Llama-3-8B): the layer slice keeps them
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "rope_theta": 500000.0, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rope_theta": 10000.0, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False}
PACKING_RTOL = 1e-4


@dataclass
class Sizes:
    """What a section runs at: the GPU sizes, or `--smoke`'s tiny ones on CPU."""

    device: str
    dtype: torch.dtype
    logits: tuple[int, int, int]  # [B, T, V] of the loss section
    repeats: int
    model: dict  # the steps section's model widths
    layers: int
    steps: int
    run_timeout_s: float

    @classmethod
    def of(cls, smoke: bool, layers: int, steps: int) -> "Sizes":
        if smoke:
            return cls("cpu", torch.float32, (2, 64, 4096), 2, TINY, 2, 3, 600.0)
        return cls("cuda", torch.bfloat16, (4, 2048, 128256), 5, LLAMA3_8B, layers, steps, 420.0)


# ---- 1. the loss pass ------------------------------------------------------------------------------------


def losses_section(sizes: Sizes) -> dict:
    """Part 1 of `bench_gpu_losses.py` (the table of issue 41) at this check's sizes."""
    from bench_gpu_losses import LossSizes, losses_table  # benchmarks/ is this script's directory

    return losses_table(LossSizes(sizes.device, sizes.dtype, sizes.logits, sizes.repeats, ()))


# ---- shared by 2 and 3: a workspace and recipes.train runs -----------------------------------------------


def tokenizer_dir(work: Path) -> Path:
    from recipes.experiments.real_tokenizers import assemble_tokenizer

    path = work / "tokenizer-llama3"
    if not (path / "tokenizer.json").is_file():
        assemble_tokenizer(str(path), "llama3")
    return path


def arithmetic_data(work: Path, tokenizer: Path, name: str, n: int, pack_length: int | None, max_length: int = 64,
                    seed: int = 0) -> tuple[Path, dict]:
    """Generated arithmetic problems (plain template) built into shards; returns (dir, manifest)."""
    from data_prep import BuildConfig, SourceConfig, TokenizeConfig, build
    from data_prep.shards import ShardConfig

    out = work / name
    if not (out / "manifest.json").is_file():
        source = SourceConfig("arithmetic", options={"n": n, "max_digits": 3, "negatives": False, "seed": seed})
        build(BuildConfig(sources=[source], tokenize=TokenizeConfig(str(tokenizer), template="plain",
                                                                     max_length=max_length, numeric_policy="integers"),
                          shards=ShardConfig(pack_length=pack_length)), str(out), workers=0, progress=False)
    return out, json.loads((out / "manifest.json").read_text())


def run_recipe(recipe: dict, out_dir: Path, timeout_s: float, stop_at: str | None = None) -> tuple[int, str]:
    """`python -m recipes.train` on `recipe` (a world of one); returns (exit status, output). `stop_at`: a
    file name in the run directory: once it exists the run is stopped (its process group killed), status 0."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir.parent / f"{out_dir.name}.yaml"
    path.write_text(yaml.safe_dump({**recipe, "train": {**recipe["train"], "out_dir": str(out_dir)}}))
    log = out_dir.parent / f"{out_dir.name}.log"
    env = {**os.environ, "NVIDIA_TF32_OVERRIDE": "0", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "recipes.train", str(path)], cwd=REPO, env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout_s
        status = None
        while status is None:
            status = proc.poll()
            if status is None and stop_at is not None and (out_dir / stop_at).is_file():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
                status = 0
            elif status is None and time.time() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
                raise TimeoutError(f"{path}: no result within {timeout_s:.0f} s (log: {log})")
            time.sleep(0.5)
    return status, log.read_text()


def base_recipe(model: dict, data: Path, tokenizer: Path, dtype: str, terms: dict) -> dict:
    return {"name": "gpu-check", "model": {"config": model, "tokenizer": str(tokenizer), "dtype": dtype},
            "data": {"train": str(data), "shuffle_window": 64},
            "loss": {"numeric_policy": "integers", "objective": {"terms": terms}},
            "optim": {"lr": 1e-5, "schedule": "constant", "grad_clip": 1.0},
            "train": {"steps": 1, "save_every": 0, "progress": False, "tensorboard": False, "export": False,
                      "log_every": 1},
            "cluster": {"gpus_per_node": 1}}


def metrics(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


# ---- 2. engine steps beside the step model ---------------------------------------------------------------


def steps_section(sizes: Sizes, work: Path, seqs: list[int]) -> dict:
    tok = tokenizer_dir(work)
    vocab_size = 128_256
    model = {**sizes.model, "num_hidden_layers": sizes.layers, "vocab_size": vocab_size}
    rows = []
    ok = True
    for seq in seqs:
        micro = max(1, 2048 // seq) if sizes.device == "cuda" else 2  # ~2k tokens per micro-batch on the GPU
        accum = 4
        examples = micro * accum * (sizes.steps + 1) * seq // 10  # a plain arithmetic row is ~12-16 tokens
        data, _ = arithmetic_data(work, tok, f"packed-{seq}", examples, pack_length=seq)
        for engine in ("deepspeed", "megatron"):
            recipe = base_recipe(model, data, tok, "bfloat16" if sizes.device == "cuda" else "float32", {"smmd": {}})
            recipe["train"].update({"engine": engine, "steps": sizes.steps, "micro_batch_size": micro,
                                    "grad_accum": accum})
            if engine == "deepspeed":
                recipe["deepspeed"] = {"zero_stage": 1}
            out = work / f"steps-{engine}-{seq}"
            status, output = run_recipe(recipe, out, sizes.run_timeout_s, stop_at="throughput.json")
            result = json.loads((out / "throughput.json").read_text()) if (out / "throughput.json").is_file() else {}
            if status != 0 or not result:
                ok = False
                rows.append({"engine": engine, "row_tokens": seq, "error": f"exit {status}: {output[-1500:]}"})
                continue
            m, p = result["measured"], result.get("predicted") or {}
            # the engine's own account of what ran: the Megatron engine names its layer spec and fusions
            spec = next((line.split(":", 1)[1].strip() for line in output.splitlines()
                         if line.startswith("[numloss] megatron: ")), "")
            spec = spec or next((line.split("layout", 1)[1].strip() for line in output.splitlines()
                                 if line.startswith("[numloss] engine ")), "")
            rows.append({"engine": engine, "row_tokens": seq, "tokens_per_micro_batch": micro * seq,
                         "measured_step_s": m.get("step_s"), "predicted_step_s": p.get("step_s"),
                         "measured_tflops": m.get("tflops_per_rank"), "measured_mfu": m.get("mfu"),
                         "predicted_mfu": p.get("mfu"), "peak_gib": max(m.get("peak_mem_gib_per_rank") or [0]),
                         "predicted_gib": p.get("memory_gib"), "padding_ratio": m.get("padding_ratio"),
                         "layout": spec})
    return {"title": f"recipes.train steps, Llama-3-8B widths x {sizes.layers} layers, vocab {vocab_size}, "
                     f"{sizes.steps} steps (medians after the first) beside the step model",
            "columns": ["engine", "row_tokens", "tokens_per_micro_batch", "measured_step_s", "predicted_step_s",
                        "measured_tflops", "measured_mfu", "predicted_mfu", "peak_gib", "predicted_gib",
                        "padding_ratio", "layout", "error"],
            "rows": rows, "ok": ok}


# ---- 3. packed rows see nothing across an example's boundary ---------------------------------------------


def packing_section(sizes: Sizes, work: Path) -> dict:
    tok = tokenizer_dir(work)
    examples = 24
    unpacked, _ = arithmetic_data(work, tok, "packing-unpacked", examples, pack_length=None, seed=5)
    packed, manifest = arithmetic_data(work, tok, "packing-packed", examples, pack_length=128, seed=5)
    packed_rows = int(manifest["totals"]["rows"])
    model = {**TINY, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 128_256}
    rows, ok = [], True
    for engine in ("megatron", "deepspeed"):
        values = {}
        for name, data, micro, accum in (("unpacked", unpacked, 6, examples // 6), ("packed", packed, 1, packed_rows)):
            # one step holds every example of the data set, so both steps train on the same tokens
            recipe = base_recipe(model, data, tok, "float32", {"smmd": {}, "ntl_was": {}})
            recipe["train"].update({"engine": engine, "micro_batch_size": micro, "grad_accum": accum})
            if engine == "deepspeed":
                recipe["deepspeed"] = {"zero_stage": 1}  # stage 0 reports no gradient norm
            out = work / f"packing-{engine}-{name}"
            status, output = run_recipe(recipe, out, sizes.run_timeout_s)
            logged = metrics(out)
            if status != 0 or not logged:
                values[name] = {"error": f"exit {status}: {output[-1500:]}"}
                continue
            values[name] = {k: logged[0][k] for k in ("loss", "ce", "grad_norm", "numeric_positions")}
        if any("error" in v for v in values.values()):
            ok = False
            rows.append({"engine": engine, "error": " | ".join(v.get("error", "") for v in values.values())})
            continue
        u, p = values["unpacked"], values["packed"]
        missing = [k for k in ("loss", "ce", "grad_norm") if u[k] is None or p[k] is None]
        rel = {k: abs(p[k] - u[k]) / max(abs(u[k]), 1e-12) for k in ("loss", "ce", "grad_norm") if k not in missing}
        same = (not missing and all(r <= PACKING_RTOL for r in rel.values())
                and p["numeric_positions"] == u["numeric_positions"])
        ok &= same
        rows.append({"engine": engine, "examples": examples, "packed_rows": packed_rows,
                     "loss_unpacked": u["loss"], "loss_packed": p["loss"], "rel_loss": rel["loss"],
                     "grad_norm_unpacked": u["grad_norm"], "grad_norm_packed": p["grad_norm"],
                     "rel_grad_norm": rel.get("grad_norm"), "equal": same,
                     **({"error": f"not logged: {', '.join(missing)}"} if missing else {})})
    return {"title": f"packed vs unpacked rows, one step over the same {examples} examples (fp32, rel {PACKING_RTOL:g})",
            "columns": ["engine", "examples", "packed_rows", "loss_unpacked", "loss_packed", "rel_loss",
                        "grad_norm_unpacked", "grad_norm_packed", "rel_grad_norm", "equal", "error"],
            "rows": rows, "ok": ok}


# ---- report ----------------------------------------------------------------------------------------------


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value).replace("|", "/").replace("\n", " ")


def markdown(section: dict) -> str:
    cols = [c for c in section["columns"] if any(c in r for r in section["rows"])]
    lines = [f"### {section['title']}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in section["rows"]]
    return "\n".join(lines)


def device_line(device: str) -> str:
    if device == "cuda":
        return (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
                f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
    return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu_check")
    parser.add_argument("--sections", default="losses,steps,packing")
    parser.add_argument("--seqs", default="1024,200", help="row lengths of the steps section")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code paths only")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no GPU here; --smoke runs the code paths on CPU", file=sys.stderr)
        return 2
    sizes = Sizes.of(args.smoke, args.layers, args.steps)
    out = Path(args.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    seqs = [int(s) for s in args.seqs.split(",")] if not args.smoke else [64]
    started = time.time()
    report = {"device": device_line(sizes.device), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "smoke": args.smoke, "sections": {}}
    print(f"gpu_check on {report['device']}", flush=True)
    sections = {"losses": lambda: losses_section(sizes), "steps": lambda: steps_section(sizes, work, seqs),
                "packing": lambda: packing_section(sizes, work)}
    for name in args.sections.split(","):
        t0 = time.time()
        try:
            result = sections[name]()
        except Exception:  # noqa: BLE001  (reported, and the next section still runs)
            result = {"title": name, "columns": ["error"], "rows": [{"error": traceback.format_exc()[-3000:]}],
                      "ok": False}
        result["seconds"] = time.time() - t0
        report["sections"][name] = result
        print("\n" + markdown(result) + f"\n\n({result['seconds']:.0f} s{'' if result['ok'] else ', FAILED'})",
              flush=True)
    report["seconds"] = time.time() - started
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    md = [f"# GPU check, {report['date']}", "", report["device"], ""]
    md += [markdown(s) + "\n" for s in report["sections"].values()]
    (out / "gpu_check.md").write_text("\n".join(md))
    failed = [n for n, s in report["sections"].items() if not s["ok"]]
    print(f"\ngpu_check: {report['seconds']:.0f} s; {'failed: ' + ', '.join(failed) if failed else 'every check passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
