"""The project's GPU check: what only a GPU can show, in one script that fits one call of a lent GPU.

    bash benchmarks/gpu_run.sh OUT [--deadline-s N]     # what a lent GPU runs: carried wheels, this, <= 8 files in OUT
    python benchmarks/gpu_check.py [--out runs/gpu_check] [--sections losses,steps,kernels,packing]
                                   [--seqs 2048] [--deadline-s 400]
    python benchmarks/gpu_check.py --requirements   # the requirements table only; exit 3 if a section would be skipped
    python benchmarks/gpu_check.py --smoke          # CPU, tiny shapes: every code path, no figure worth keeping

0. `requirements` (first, always): what imports here (torch's CUDA, triton, pytest, deepspeed,
   megatron.core, transformers against the version the tests ran, transformer_engine and whether
   megatron-core's TE spec can be built, flash_attn, liger_kernel) and so which sections, and which engines'
   rows, run. A section or row whose needs are missing is skipped with the reason (gpu_check_requirements.py),
   so a bare image measures what it can.
1. `losses`: part 1 of bench_gpu_losses.py, logits [4, 2048, 128256] bf16: numloss's objective (eager, fused,
   gradient in place; CE alone and each term at N = 10 and 1000) beside torch's eager and compiled
   cross-entropy, time and peak memory; then the CE paths at V = 151936.
2. `steps`: `recipes.train` on each engine (Megatron, DeepSpeed ZeRO-1) at Llama-3.2-1B's shape (16 layers,
   hidden 2048, the Llama-3 vocabulary, tied embeddings), random weights, bf16, a few steps: measured step
   time, tokens/s, TFLOP/s, MFU and peak memory beside the step model's prediction for the same recipe on
   this GPU (each run's throughput.json).
3. `kernels`: tests/numloss/test_fused_pass.py's CUDA checks of the fused pass at [2048, 128256] bf16, case by
   case (gpu_check_kernels.py). The losses' fused rows ran before it: if it fails, their rows are marked.
4. `packing`: a correctness check on Megatron's Transformer Engine spec in bf16: the same 24 examples as one
   step of unpacked rows and of packed THD rows give the same step-1 loss, CE and gradient norm (rel 1e-2);
   without TE one line says why it was skipped (gpu_check_steps.py). On `--smoke`, both engines in fp32.

Time: a deadline for the whole check (`--deadline-s`), each section's share of it in the order above
(gpu_check_runs.SHARES; what a section leaves goes to the next) and a timeout per run; what the deadline
cuts is reported as skipped. Progress is printed as it goes (flush), and `<out>/gpu_check.json` and `.md` are
rewritten after every section and every finished run, so a check killed at its limit leaves what it measured.

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
from gpu_check_runs import SHARES, Clock, Sizes  # noqa: E402
from gpu_check_steps import packing_section, steps_section  # noqa: E402

SECTIONS = tuple(name for name in SHARES if name != "requirements")  # the order they run in
DEADLINE_S = {"gpu": 400.0, "smoke": 900.0}


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
    table = state["requirements"]
    skips = table["engines"]

    def partial(section: dict) -> None:
        report.update(name, {**section, "seconds": time.time() - t0, "partial": True})

    t0 = time.time()
    if name == "kernels":
        return kernels_section(sizes, work, left)
    if name == "losses":
        mode = FusedMode.after(state.get("kernels"), table["found"].get("triton", {}).get("ok", False))
        return losses_section(sizes, work, left, mode)
    if name == "packing":
        te = table["found"].get("te_spec", {})
        return packing_section(sizes, work, deadline, skips, None if te.get("ok") else te.get("error", "not probed"),
                               partial)
    seqs = [int(s) for s in args.seqs.split(",")] if sizes.cuda else [64]
    return steps_section(sizes, work, seqs, deadline, skips, partial)


def mark_fused_rows(losses: dict, kernels: dict) -> None:
    """The losses section timed its fused rows before the kernel check ran ("kernel check not run"): the
    check's verdict replaces that note, and a failed check fails the section too."""
    if not losses.get("fused") or kernels.get("skipped"):
        return
    failed = not kernels.get("ok")
    for row in losses.get("rows", []):
        if row.get("note") == "kernel check not run":
            row["note"] = "the kernel check failed: these timings are of kernels that gave wrong values" if failed else None
    losses["ok"] = losses.get("ok", False) and not failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu_check")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--seqs", default="2048", help="row lengths (packed) of the steps section's runs")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--deadline-s", type=float, default=None,
                        help=f"the whole check (default {DEADLINE_S['gpu']:.0f}; --smoke {DEADLINE_S['smoke']:.0f})")
    parser.add_argument("--requirements", action="store_true", help="print the requirements table and exit")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code paths only")
    args = parser.parse_args(argv)
    chosen = [s for s in args.sections.split(",") if s]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        parser.error(f"--sections: unknown {unknown}; known: {','.join(SECTIONS)}")
    sizes = Sizes.of(args.smoke, args.steps)
    out = Path(args.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.deadline_s or DEADLINE_S["smoke" if args.smoke else "gpu"])

    found = probe(timeout_s=max(30.0, clock.section_deadline("requirements") - time.time()))
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
    print(f"gpu_check on {report.data['device']}; deadline {clock.left():.0f} s", flush=True)
    for name in [s for s in SECTIONS if s in chosen]:
        t0 = time.time()
        reason = table["sections"].get(name)
        if reason is None and clock.left() < sizes.min_run_s:
            reason = f"not started: {clock.left():.0f} s left of the check's deadline"
        print(f"\n[gpu_check] section {name}" + (f": skipped ({reason})" if reason else
              f", until {clock.section_deadline(name) - clock.start:.0f} s of {clock.deadline_s:.0f}"), flush=True)
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
        if name == "kernels" and "losses" in state:
            mark_fused_rows(state["losses"], result)
            report.update("losses", state["losses"])
        print("\n" + markdown(result) + f"\n\n({result['seconds']:.0f} s, {status_of(result)})", flush=True)
    statuses = {n: status_of(s) for n, s in report.data["sections"].items() if n != "requirements"}
    failed = [n for n, s in statuses.items() if s == "failed"]
    skipped = [n for n, s in statuses.items() if s == "skipped"]
    print(f"\ngpu_check: {time.time() - clock.start:.0f} s; failed: {', '.join(failed) or 'none'}; skipped (all or "
          f"some rows): {', '.join(skipped) or 'none'}; {out / 'gpu_check.md'}", flush=True)
    return 1 if failed else 3 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
