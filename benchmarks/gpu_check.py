"""The project's GPU check: what only a GPU can show, in one script of about 7 minutes on one H200.

    python benchmarks/gpu_check.py [--out runs/gpu_check] [--sections kernels,losses,packing,steps]
                                   [--seqs 1024,200] [--deadline-s 420]
    python benchmarks/gpu_check.py --requirements   # the requirements table only; exit 3 if a section would be skipped
    python benchmarks/gpu_check.py --smoke          # CPU, tiny shapes: every code path, no figure worth keeping

0. `requirements` (first, always): what imports here (torch's CUDA, triton, pytest, deepspeed,
   megatron.core, transformers against the version the tests ran, transformer_engine, flash_attn,
   liger_kernel) and so which sections, and which engines' rows, run. A section or row whose needs are
   missing is skipped with the reason (gpu_check_requirements.py), so a bare image measures what it can.
   Then DeepSpeed's FusedAdam JIT build starts in the background (gpu_check_runs.Prebuild); the DeepSpeed
   runs wait on it with a timeout.
1. `kernels`: tests/numloss/test_fused_pass.py's CUDA checks of the fused pass at [2048, 128256] bf16, case by
   case (gpu_check_kernels.py).
2. `losses`: part 1 of bench_gpu_losses.py, logits [4, 2048, 128256] bf16, numloss's objective (eager,
   fused, gradient in place; CE alone and each term at N = 10 and 1000) beside torch's eager and compiled
   cross-entropy. When `kernels` failed, the fused rows are not run and say "kernel check failed"; the
   eager and torch rows are measured anyway.
3. `packing`: a correctness check. The same 24 examples as one step of unpacked rows and of packed rows
   give the same step-1 loss, CE and gradient norm (fp32, TF32 off, rel 1e-4) on each engine
   (gpu_check_steps.py).
4. `steps`: `recipes.train` for a few steps, measured step time / TFLOP/s / MFU / peak memory beside the
   step model's prediction (each run's throughput.json): Llama-3-8B's widths x `--layers` layers (dense)
   at every `--seqs` row length, and Qwen3-30B-A3B's (MoE: 128 experts, top 8; Megatron EP 1 with the
   alltoall dispatcher, DeepSpeed ZeRO-1) at the first, with the logged router/aux.

Time: a deadline for the whole check (`--deadline-s`), a budget per section and a timeout per run
(gpu_check_runs.Clock); what the deadline cuts is reported as skipped. Progress is printed as it goes
(flush), and `<out>/gpu_check.json` and `.md` are rewritten after every section and every finished run,
so a check killed at its limit leaves what it measured.

Exit status: 0 every section ran and passed; 1 a section failed (raised, a check failed, a run broke);
3 nothing failed but something was skipped (missing requirements, the deadline); 2 no GPU without --smoke.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_gpu_losses import markdown as table_markdown  # noqa: E402
from gpu_check_kernels import FusedMode, kernels_section, losses_section  # noqa: E402  (benchmarks/ is on sys.path)
from gpu_check_requirements import probe, requirements_table  # noqa: E402
from gpu_check_runs import Clock, Prebuild, Sizes  # noqa: E402
from gpu_check_steps import packing_section, steps_section  # noqa: E402

SECTIONS = ("kernels", "losses", "packing", "steps")
PREBUILD_TIMEOUT_S = 300.0  # a cold fused_adam build is ~1 min; past this the DeepSpeed rows are skipped


def markdown(section: dict) -> str:
    if section.get("skipped") and not section["rows"]:
        return f"### {section['title']}\n\nskipped: {section['skipped']}"
    lines = [table_markdown(section)]  # the bench's table, so both print cells alike
    if section.get("skipped"):
        lines += ["", f"skipped: {section['skipped']}"]
    return "\n".join(lines)


def status_of(section: dict) -> str:
    """failed | skipped (the section, or one of its rows) | ok."""
    if not section.get("ok", False):
        return "failed"
    if section.get("skipped") or any(r.get("skipped") for r in section.get("rows", [])):
        return "skipped"
    return "ok"


class Report:
    """gpu_check.json and gpu_check.md, rewritten whole after every update (each write replaces the file)."""

    def __init__(self, out: Path, head: dict):
        self.out, self.data = out, {**head, "sections": {}}

    def update(self, name: str, section: dict) -> None:
        self.data["sections"][name] = section
        self.data["seconds"] = time.time() - self.data["started"]
        self._write("gpu_check.json", json.dumps(self.data, indent=1, default=str))
        md = [f"# GPU check, {self.data['date']}", "", self.data["device"], ""]
        md += [markdown(s) + f"\n\n({status_of(s)}, {s.get('seconds', 0):.0f} s)\n"
               for s in self.data["sections"].values()]
        self._write("gpu_check.md", "\n".join(md))

    def _write(self, name: str, text: str) -> None:
        tmp = self.out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.out / name)


def device_line(sizes: Sizes) -> str:
    if sizes.cuda:
        return (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
                f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB")
    return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}"


def run_section(name: str, sizes: Sizes, clock: Clock, work: Path, args, state: dict, report: Report) -> dict:
    deadline = clock.section_deadline(name)
    left = deadline - time.time()
    skips = state["requirements"]["engines"]

    def partial(section: dict) -> None:
        report.update(name, {**section, "seconds": time.time() - t0, "partial": True})

    t0 = time.time()
    if name == "kernels":
        return kernels_section(sizes, work, left)
    if name == "losses":
        mode = FusedMode.after(state.get("kernels"), state["requirements"]["found"].get("triton", {}).get("ok", False))
        return losses_section(sizes, work, left, mode)
    if name == "packing":
        return packing_section(sizes, work, deadline, state.get("prebuild"), skips, partial)
    seqs = [int(s) for s in args.seqs.split(",")] if sizes.cuda else [64]
    return steps_section(sizes, work, seqs, deadline, state.get("prebuild"), skips, partial)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu_check")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--seqs", default="1024,200", help="row lengths of the steps section's dense rows")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--deadline-s", type=float, default=None, help="the whole check (default 420; --smoke 900)")
    parser.add_argument("--requirements", action="store_true", help="print the requirements table and exit")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code paths only")
    args = parser.parse_args(argv)
    chosen = [s for s in args.sections.split(",") if s]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {unknown}; known: {','.join(SECTIONS)}")
    sizes = Sizes.of(args.smoke, args.layers, args.steps)
    out = Path(args.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.deadline_s or (900.0 if args.smoke else 420.0), sizes.budgets_s)

    found = probe(timeout_s=sizes.budgets_s["requirements"])
    table = requirements_table(found, args.smoke)
    table["seconds"] = time.time() - clock.start
    print("\n" + markdown(table) + "\n", flush=True)
    if args.requirements:
        (out / "requirements.json").write_text(json.dumps(table, indent=1, default=str))
        would_skip = [s for s in chosen if table["sections"].get(s)] + [
            f"{e} rows" for e, r in table["engines"].items() if r]
        verdict = "would skip " + ", ".join(would_skip) if would_skip else "every section runs"
        print(f"gpu_check --requirements: {verdict}")
        return 3 if would_skip else 0
    if not args.smoke and not found["cuda"]["ok"]:
        print(f"gpu_check: no GPU here ({found['cuda'].get('error')}); --smoke runs the code paths on CPU",
              file=sys.stderr)
        return 2
    report = Report(out, {"device": device_line(sizes), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                          "smoke": args.smoke, "started": clock.start, "deadline_s": clock.deadline - clock.start,
                          "requirements": {k: v for k, v in table.items() if k != "found"}, "found": found})
    report.update("requirements", table)

    state = {"requirements": table}
    if {"packing", "steps"} & set(chosen) and not table["engines"]["deepspeed"]:
        state["prebuild"] = Prebuild(work, sizes.cuda, PREBUILD_TIMEOUT_S)
    print(f"gpu_check on {report.data['device']}; deadline {clock.left():.0f} s", flush=True)
    try:
        for name in chosen:
            t0 = time.time()
            reason = table["sections"].get(name)
            if reason is None and clock.left() < sizes.min_run_s:
                reason = f"not started: {clock.left():.0f} s left of the check's deadline"
            print(f"\n[gpu_check] section {name}" + (f": skipped ({reason})" if reason else
                  f", {min(clock.left(), sizes.budgets_s[name]):.0f} s at most"), flush=True)
            if reason:
                result = {"title": name, "columns": [], "rows": [], "ok": True, "skipped": reason}
            else:
                try:
                    result = run_section(name, sizes, clock, work, args, state, report)
                except Exception:  # noqa: BLE001  (reported, and the next section still runs)
                    result = {"title": name, "columns": ["error"], "rows": [{"error": traceback.format_exc()[-3000:]}],
                              "ok": False}
            result["seconds"] = time.time() - t0
            state[name] = result
            report.update(name, result)
            print("\n" + markdown(result) + f"\n\n({result['seconds']:.0f} s, {status_of(result)})", flush=True)
    finally:
        if "prebuild" in state:
            state["prebuild"].stop()
    statuses = {n: status_of(s) for n, s in report.data["sections"].items() if n != "requirements"}
    failed = [n for n, s in statuses.items() if s == "failed"]
    skipped = [n for n, s in statuses.items() if s == "skipped"]
    print(f"\ngpu_check: {time.time() - clock.start:.0f} s; failed: {', '.join(failed) or 'none'}; skipped (all or "
          f"some rows): {', '.join(skipped) or 'none'}; {out / 'gpu_check.md'}", flush=True)
    return 1 if failed else 3 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
