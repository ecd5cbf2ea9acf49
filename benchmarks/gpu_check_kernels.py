"""The GPU check's loss-pass sections: `kernels` (is the fused pass right at real sizes?) and `losses`
(how fast is it, beside the eager pass and torch's cross-entropy?).

- `kernels` runs tests/numloss/test_fused_pass.py's own CUDA checks (`-k cuda`: the compiled kernels
  against the eager path on logits [2048, 128256] bf16 for CE and four terms at N = 10 and 1000, and the
  gradient in place allocating no second [T, V]) with pytest in a subprocess under a timeout, and reports
  each case from pytest's JUnit XML. On `--smoke` (CPU) it runs three of tests/numloss/fused_interpreted.py's
  cases under Triton's interpreter instead: the same reporting path, real checks.
- `losses` runs part 1 of `bench_gpu_losses.py` (`losses_table`) in a subprocess of this file under a
  timeout, so a kernel fault or a hang costs that section, not the check. When the kernel check failed (or
  triton does not import) the fused paths are not run: NUMLOSS_FUSED=0 sends numloss's default dispatch
  to the eager pass, those rows say so, and a row in place of the fused ones names why; the eager and
  torch rows are measured either way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from gpu_check_runs import REPO, Sizes, child_env, kill_group

GPU_KERNEL_CASES = ["tests/numloss/test_fused_pass.py", "-k", "cuda"]
SMOKE_KERNEL_CASES = ["tests/numloss/fused_interpreted.py", "-k", "fp32 and (None or in_place_aliases)"]


def _run(cmd: list[str], env: dict, timeout_s: float, log: Path) -> tuple[int | None, str]:
    """(exit status or None on timeout, output) of `cmd`, its process group killed at the timeout."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            kill_group(proc)
            status = None
    return status, log.read_text()


def junit_cases(path: Path) -> list[dict]:
    """One row per test case of a pytest JUnit XML file: case, outcome (passed/failed/error/skipped),
    seconds, and the message of a failure or skip."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (child.get("message") or child.text or "").strip().splitlines()[0][:300] if (
                    child.get("message") or child.text) else None
                break
        rows.append({"case": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                     "message": message})
    return rows


def kernels_section(sizes: Sizes, work: Path, timeout_s: float) -> dict:
    """The fused pass's correctness checks, case by case (module docstring)."""
    xml = work / "kernels-junit.xml"
    xml.unlink(missing_ok=True)
    cases = GPU_KERNEL_CASES if sizes.cuda else SMOKE_KERNEL_CASES
    env = child_env() if sizes.cuda else child_env(TRITON_INTERPRET="1")
    env.pop("NUMLOSS_FUSED", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", f"--junitxml={xml}", *cases]
    status, output = _run(cmd, env, timeout_s, work / "kernels.log")
    rows = junit_cases(xml) if xml.is_file() else []
    section = {"title": f"fused pass correctness: pytest {' '.join(cases)}"
                        + (" (CPU: Triton's interpreter)" if not sizes.cuda else ""),
               "columns": ["case", "outcome", "seconds", "message", "error"], "rows": rows}
    if status is None:
        rows.append({"case": "(pytest)", "outcome": "failed", "error": f"no result within {timeout_s:.0f} s: "
                                                                          f"{output[-1500:]}"})
    elif not rows:
        rows.append({"case": "(pytest)", "outcome": "failed", "error": f"exit {status}, no cases: {output[-1500:]}"})
    outcomes = [r["outcome"] for r in rows]
    section["ok"] = not any(o in ("failed", "error") for o in outcomes) and status in (0, 5)
    if section["ok"] and outcomes and all(o == "skipped" for o in outcomes):
        section["skipped"] = "every case skipped: " + (rows[0].get("message") or "")
    section["passed"] = outcomes.count("passed")
    return section


# ---- losses ---------------------------------------------------------------------------------------------


@dataclass
class FusedMode:
    """Whether the losses section runs the fused paths, and what its numloss rows then say."""

    run: bool
    note: str | None  # on every default-dispatch numloss row; None: nothing to say

    @classmethod
    def after(cls, kernels: dict | None, triton_ok: bool) -> "FusedMode":
        if not triton_ok:
            return cls(False, "triton does not import")
        if kernels is None or kernels.get("skipped"):
            return cls(True, "kernel check not run")
        if not kernels.get("ok"):
            return cls(False, "kernel check failed")
        return cls(True, None)


def losses_section(sizes: Sizes, work: Path, timeout_s: float, mode: FusedMode) -> dict:
    """Part 1 of bench_gpu_losses.py at this check's sizes, in a subprocess (module docstring)."""
    out = work / "losses.json"
    out.unlink(missing_ok=True)
    extra = {} if mode.run else {"NUMLOSS_FUSED": "0"}
    if not sizes.cuda and mode.run:  # CPU: the fused rows run under Triton's interpreter
        extra = {"TRITON_INTERPRET": "1", "NUMLOSS_FUSED": "interpret"}
    env = child_env(**extra)
    if mode.run and sizes.cuda:
        env.pop("NUMLOSS_FUSED", None)
    cmd = [sys.executable, str(Path(__file__)), "losses", "--out", str(out), "--smoke" if not sizes.cuda else "--gpu"]
    if not mode.run:
        cmd.append("--eager")
    status, output = _run(cmd, env, timeout_s, work / "losses.log")
    if status != 0 and status is not None or not out.is_file():
        why = f"no result within {timeout_s:.0f} s" if status is None else f"exit {status}"
        return {"title": "loss pass", "columns": ["error"], "rows": [{"error": f"{why}: {output[-2500:]}"}],
                "ok": False}
    section = json.loads(out.read_text())  # the whole table, or the blocks written before the time ran out
    if status is None:
        section["skipped"] = (f"cut at {timeout_s:.0f} s, the section's share of the deadline: the blocks after "
                              "these rows were not measured")
    for row in section["rows"]:
        if mode.note and row["path"].startswith("numloss CE") and row["path"] != "numloss CE eager":
            row["note"] = f"eager pass ({mode.note})" if not mode.run else mode.note
    if not mode.run:
        section["rows"].append({"path": "numloss fused paths (CE, grad in place, terms)",
                                "note": f"not measured: {mode.note}"})
    section["columns"] = [*section["columns"], "note"]
    section["fused"] = mode.run
    return section


def _losses_worker(argv: list[str]) -> int:
    """`python gpu_check_kernels.py losses --out FILE (--gpu | --smoke) [--eager]`: the table as JSON."""
    import argparse

    sys.path.insert(0, str(REPO))
    from bench_gpu_losses import LossSizes, losses_table  # benchmarks/ is this file's directory

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--eager", action="store_true", help="no fused path (NUMLOSS_FUSED=0 set by the caller)")
    args = parser.parse_args(argv)
    sizes = Sizes.of(args.smoke, 1)

    class EagerLossSizes(LossSizes):
        @property
        def fused(self) -> bool:  # bench_gpu_losses adds the grad-in-place row only where the kernels run
            return False

    kind = EagerLossSizes if args.eager else LossSizes
    if args.eager and os.environ.get("NUMLOSS_FUSED") != "0":
        raise SystemExit("--eager needs NUMLOSS_FUSED=0 in the environment (numloss's default dispatch)")
    started = time.time()

    def write(table: dict) -> None:  # after every block: a worker cut off at its timeout leaves those rows
        table["seconds_inside"] = time.time() - started
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(table, default=str))
        os.replace(tmp, args.out)

    write(losses_table(kind(sizes.device, sizes.dtype, sizes.logits, sizes.repeats, (), sizes.more_vocabs),
                       on_block=write))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["losses"]:
        raise SystemExit("usage: gpu_check_kernels.py losses --out FILE (--gpu | --smoke) [--eager]")
    sys.exit(_losses_worker(sys.argv[2:]))
