"""What the GPU check can run on this machine: one probe of the imports, the table it prints, and which
sections (or which engines' rows) are skipped and why.

The probe runs in a subprocess with a timeout: a broken install (an extension built for another torch,
a CUDA library missing) fails there, is reported as that module's error, and cannot hang or kill the
check. A bare GPU image (torch, triton, pytest) still runs `kernels` and `losses`; the engines' rows of
`packing` and `steps` need their own packages, and are skipped with the reason when those do not import.

Required vs optional:
- required, by section: `kernels` needs CUDA (on `--smoke`: triton's interpreter on CPU), triton and
  pytest (the checks are tests/numloss/test_fused_pass.py's own, run by pytest); `losses` needs CUDA only
  (without triton its fused rows say so and the eager ones are measured); the DeepSpeed rows need
  deepspeed, transformers, tokenizers and pyarrow (the data shards); the Megatron rows megatron.core and
  the same three.
- optional, reported and never a skip: transformer_engine (Megatron's TE layer spec and THD packed rows;
  else the local spec and the block mask), flash_attn (DeepSpeed's variable-length packed rows; else the
  block mask), liger_kernel (only `bench_gpu_losses.py --parts head` compares it).
- pinned versions (pyproject.toml and the transformers the tests ran, numloss.integrations.hf_trainer.TESTED):
  another version is printed as a note, not a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# module -> (distribution name for its version, what needs it)
MODULES = {
    "torch": ("torch", "everything"),
    "triton": ("triton", "kernels; the fused rows of losses"),
    "pytest": ("pytest", "kernels (runs tests/numloss/test_fused_pass.py -k cuda)"),
    "transformers": ("transformers", "DeepSpeed and Megatron rows (packing, steps)"),
    "tokenizers": ("tokenizers", "DeepSpeed and Megatron rows (the workspace's tokenizer)"),
    "pyarrow": ("pyarrow", "DeepSpeed and Megatron rows (data shards)"),
    "deepspeed": ("deepspeed", "DeepSpeed rows (packing, steps)"),
    "megatron.core": ("megatron-core", "Megatron rows (packing, steps)"),
    "transformer_engine": ("transformer-engine", "optional: Megatron's TE spec and THD packed rows"),
    "flash_attn": ("flash-attn", "optional: DeepSpeed's variable-length packed rows"),
    "liger_kernel": ("liger-kernel", "optional: bench_gpu_losses.py's head part only"),
}
OPTIONAL = ("transformer_engine", "flash_attn", "liger_kernel")
ENGINE_NEEDS = {"deepspeed": ("transformers", "tokenizers", "pyarrow", "deepspeed"),
                "megatron": ("transformers", "tokenizers", "pyarrow", "megatron.core")}
PINNED = {"deepspeed": "0.19.8", "megatron.core": "0.16.1"}  # pyproject.toml's train / megatron extras

_PROBE = r"""
import importlib, json, sys
from importlib import metadata
found = {}
for name, dist in json.loads(sys.argv[1]).items():
    try:
        module = importlib.import_module(name)
    except BaseException as err:  # an extension's OSError or a SystemExit counts as absent too
        found[name] = {"ok": False, "error": f"{type(err).__name__}: {err}".splitlines()[0][:240]}
        continue
    try:
        version = metadata.version(dist)
    except Exception:
        version = str(getattr(module, "__version__", "?"))
    found[name] = {"ok": True, "version": version}
cuda = {"ok": False, "error": "torch does not import"}
if found.get("torch", {}).get("ok"):
    import torch
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        cuda = {"ok": True, "version": f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}, "
                                       f"sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB"}
    else:
        cuda = {"ok": False, "error": f"torch {torch.__version__} sees no CUDA device"}
found["cuda"] = cuda
te = {"ok": False, "error": "megatron.core does not import"}
if found.get("megatron.core", {}).get("ok"):
    try:  # the project's own probe: TE itself and megatron-core's HAVE_TE (what the engine decides by)
        from recipes.engines.megatron.pure.kernels import te_missing
        why = te_missing()
        te = {"ok": True, "version": "buildable"} if why is None else {"ok": False, "error": why[:240]}
    except BaseException as err:
        te = {"ok": False, "error": f"{type(err).__name__}: {err}".splitlines()[0][:240]}
found["te_spec"] = te
print("GPU_CHECK_PROBE " + json.dumps(found))
"""


def tested_transformers() -> str | None:
    """The transformers version the project's tests ran (numloss.integrations.hf_trainer.TESTED)."""
    try:
        from numloss.integrations.hf_trainer import TESTED
    except Exception:  # noqa: BLE001  (the probe reports transformers itself)
        return None
    return TESTED["transformers"]


def probe(timeout_s: float = 120.0) -> dict:
    """{module or "cuda": {"ok", "version" | "error"}} from a fresh interpreter (the module docstring)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    modules = {name: dist for name, (dist, _) in MODULES.items()}
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(modules)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {name: {"ok": False, "error": f"the import probe did not finish in {timeout_s:.0f} s"}
                for name in [*MODULES, "cuda", "te_spec"]}
    line = next((x for x in proc.stdout.splitlines() if x.startswith("GPU_CHECK_PROBE ")), None)
    if line is None:
        error = f"the import probe exited {proc.returncode}: {(proc.stderr or proc.stdout)[-300:]}"
        return {name: {"ok": False, "error": error} for name in [*MODULES, "cuda", "te_spec"]}
    return json.loads(line.split(" ", 1)[1])


def missing(found: dict, names) -> list[str]:
    return [n for n in names if not found.get(n, {}).get("ok")]


def engine_skips(found: dict) -> dict[str, str | None]:
    """engine -> why its rows cannot run here (None: they can)."""
    out = {}
    for engine, needs in ENGINE_NEEDS.items():
        gone = missing(found, needs)
        out[engine] = None if not gone else "does not import: " + "; ".join(
            f"{n} ({found.get(n, {}).get('error', 'not probed')})" for n in gone)
    return out


def section_skips(found: dict, smoke: bool) -> dict[str, str | None]:
    """section -> why it is skipped as a whole (None: it runs, perhaps with some rows skipped)."""
    cuda = [] if smoke else ["cuda"]
    out = {}
    gone = missing(found, [*cuda, "triton", "pytest"])
    out["kernels"] = None if not gone else "needs " + ", ".join(gone)
    gone = missing(found, cuda)
    out["losses"] = None if not gone else "needs " + ", ".join(gone)
    engines = engine_skips(found)
    for name in ("packing", "steps"):
        gone = missing(found, cuda)
        if gone:
            out[name] = "needs " + ", ".join(gone)
        elif all(engines.values()):
            out[name] = "neither engine imports: " + " | ".join(f"{e}: {r}" for e, r in engines.items())
        else:
            out[name] = None
    return out


def version_notes(found: dict) -> dict[str, str]:
    notes = {}
    pinned = {**PINNED, **({"transformers": tested_transformers()} if tested_transformers() else {})}
    for name, want in pinned.items():
        got = found.get(name, {})
        if got.get("ok") and got.get("version") != want:
            notes[name] = f"the project pins/tests {want}; found {got['version']}"
    return notes


def requirements_table(found: dict, smoke: bool) -> dict:
    """The table the check prints first (a section of the report, kept apart from the measured ones)."""
    notes = version_notes(found)
    rows = []
    for name in ["cuda", *MODULES, "te_spec"]:
        got = found.get(name, {"ok": False, "error": "not probed"})
        why = {"cuda": "losses, steps, kernels, packing (GPU sizes)",
               "te_spec": "packing on a GPU: Megatron's Transformer Engine spec (THD rows)"}.get(name) or MODULES[name][1]
        rows.append({"component": name, "found": got.get("version") if got.get("ok") else "no",
                     "needed_by": why, "note": notes.get(name) or (None if got.get("ok") else got.get("error"))})
    skips = section_skips(found, smoke)
    for engine, reason in engine_skips(found).items():
        if reason and not all(skips.get(s) for s in ("packing", "steps")):
            rows.append({"component": f"{engine} rows", "found": "skipped", "needed_by": "packing, steps",
                         "note": reason})
    for section, reason in skips.items():
        rows.append({"component": f"section {section}", "found": "skipped" if reason else "runs",
                     "needed_by": "", "note": reason})
    return {"title": "requirements: what imports here, and what each section needs",
            "columns": ["component", "found", "needed_by", "note"], "rows": rows, "ok": True,
            "sections": skips, "engines": engine_skips(found), "found": found}
