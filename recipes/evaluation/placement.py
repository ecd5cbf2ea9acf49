"""Where an export runs for evaluation: on how many GPUs, from the size of its weights and the node's GPUs.

    plan_placement("runs/llama70b/final", gpus=8, gpu_bytes=80 * 2**30)
    # Placement(gpus=4, tensor_parallel_size=4, device_map="auto", weight_bytes=141 GB): 35 GB of weights per GPU

The weights of one GPU's share may fill WEIGHT_SHARE of its memory; the rest is for the KV cache (vLLM
reserves it from what is left), activations and the CUDA context. The GPU count is the smallest power of two
(then the node's count) that fits and divides the model's attention heads (vLLM's tensor parallelism splits
the heads). vLLM takes it as `tensor_parallel_size`; Hugging Face generate spreads the layers with
`device_map="auto"` when it is above 1. An export that fits no count of the node's GPUs is refused before
anything is loaded, naming its size and the GPUs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

WEIGHT_SHARE = 0.7
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@dataclass(frozen=True)
class Placement:
    """gpus: the GPUs the model is spread over (0: the CPU); tensor_parallel_size: vLLM's; device_map: HF's."""

    gpus: int
    tensor_parallel_size: int
    device_map: str | None
    weight_bytes: int | None

    def to_dict(self) -> dict:
        return asdict(self)


def export_weight_bytes(model_dir: str | Path) -> int:
    """Bytes of an export's weight files (safetensors shards, else PyTorch .bin/.pt files)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"{model_dir}: not a model directory")
    for suffix in _WEIGHT_SUFFIXES:
        files = [f for f in d.iterdir() if f.is_file() and f.name.endswith(suffix)
                 and not f.name.startswith(("optimizer", "training_args", "scheduler", "rng_state"))]
        if files:
            return sum(f.stat().st_size for f in files)
    raise FileNotFoundError(f"{model_dir}: no weight files ({', '.join(_WEIGHT_SUFFIXES)})")


def attention_heads(model_dir: str | Path) -> int | None:
    """num_attention_heads of the export's config.json (its text model's for a vision-language model)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    for section in (cfg, cfg.get("text_config") or {}, cfg.get("llm_config") or {}):
        heads = section.get("num_attention_heads")
        if isinstance(heads, int) and heads > 0:
            return heads
    return None


def _counts(gpus: int) -> list[int]:
    counts, n = [], 1
    while n <= gpus:
        counts.append(n)
        n *= 2
    return counts if gpus in counts else counts + [gpus]


def plan_placement(model_dir: str | Path, gpus: int, gpu_bytes: int | None,
                   weight_bytes: int | None = None, heads: int | None = None) -> Placement:
    """The placement of an export on a node with `gpus` GPUs of `gpu_bytes` each (0 GPUs: the CPU).
    `weight_bytes`/`heads` None: read from the export."""
    size = export_weight_bytes(model_dir) if weight_bytes is None else int(weight_bytes)
    if gpus <= 0:
        return Placement(0, 1, None, size)
    if not gpu_bytes or gpu_bytes <= 0:
        raise ValueError(f"{model_dir}: the memory of the node's GPUs is unknown: cannot place {size / 2**30:.1f} GiB")
    heads = attention_heads(model_dir) if heads is None else heads
    for n in _counts(gpus):
        if heads and heads % n:
            continue
        if size / n <= WEIGHT_SHARE * gpu_bytes:
            return Placement(n, n, "auto" if n > 1 else None, size)
    raise ValueError(f"{model_dir}: {size / 2**30:.1f} GiB of weights do not fit on {gpus} GPU(s) of "
                     f"{gpu_bytes / 2**30:.0f} GiB at {WEIGHT_SHARE:.0%} of each (attention heads: {heads}); "
                     "evaluate on a node with more or larger GPUs")


def local_gpus() -> tuple[int, int | None]:
    """(GPUs visible to this process, the smallest one's memory in bytes); (0, None) without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0, None
    n = torch.cuda.device_count()
    return n, min(torch.cuda.get_device_properties(i).total_memory for i in range(n)) if n else None


def place_here(model_dir: str | Path) -> Placement:
    """`plan_placement` of an export on this node's GPUs. A model that is no local directory (a hub name read
    from HF_HOME) has no size here: Hugging Face spreads it with device_map "auto" over the node's GPUs, vLLM
    gets one GPU (weight_bytes None)."""
    gpus, gpu_bytes = local_gpus()
    if not Path(model_dir).is_dir():
        return Placement(min(gpus, 1), 1, "auto" if gpus > 1 else None, None)
    return plan_placement(model_dir, gpus, gpu_bytes)
