"""What the hardware did in each step, for metrics.jsonl: achieved TFLOP/s per rank, MFU, the step's time
split, peak memory per rank; and the run's summary beside its engine's plan (`predict`).

Per logged step (`StepMeter.row`):
- `tflops_per_rank`: model FLOPs of the step's rows (recipes.planning.step_model.model_flops_per_token
  from the model's config: 6 N + causal attention, N the layers' and output layer's matrices; no recompute)
  summed over the data-parallel group, / world size / the step's wall time. On CPU too.
- `mfu`: tflops_per_rank / the GPU's dense peak for model.dtype (step_model.GPU_PEAKS_BF16 by
  torch.cuda.get_device_name(), or cluster.gpu_peak_tflops); null on CPU and on GPUs not in the table.
- `padding_ratio`: token positions the model ran, padding included, / real tokens, over the global batch
  (`tokens_run` of the loop's sums: its batches' shapes, or the engine's own count when it pads further).
- `data_s` (reading and preparing the step's micro-batches), `fwd_bwd_s` and `optimizer_s` where the
  engine exposes them (`engine.timings`, each part ended by a device synchronisation; DeepSpeed: up to
  the last backward, then the optimizer step; Megatron: the forward-backward schedule, then the
  optimizer step), `step_s` (the whole step).
- `peak_mem_gib`: the largest peak over the ranks since the run started: device memory allocated by
  tensors on GPUs (torch.cuda.max_memory_allocated: what recipes.planning's memory model counts; the
  caching allocator reserves more), the process's peak resident memory on CPU (ru_maxrss). One all-gather
  of a float per rank on logged steps.
At the end (`StepMeter.summary`): the median of each over the steps after the first, beside the plan's
prediction for the recipe's layout and hardware settings (cluster.*), printed by rank 0 and written to
`<out_dir>/throughput.json`.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path

import torch

from recipes.engines import engine_contract
from recipes.planning import step_model
from recipes.planning.backbones import count_parameters
from recipes.planning.shape import Shape

GiB = 2**30


def peak_memory_bytes(device: torch.device) -> int:
    """Device memory allocated at its peak (GPU), else this process's peak resident memory (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


class StepMeter:
    def __init__(self, recipe, engine, runtime):
        self.recipe, self.engine, self.runtime = recipe, engine, runtime
        self.cfg = getattr(engine, "hf_config", None)
        try:
            self.shape = Shape.of(self.cfg)
        except AttributeError:  # no layer shapes: 6 x parameters per token
            self.shape = None
        self.peak = None
        if runtime.device.type == "cuda":
            self.peak = recipe.cluster.gpu_peak_tflops or step_model.peak_tflops(
                torch.cuda.get_device_name(runtime.device), recipe.model.dtype)
        self._data_s = 0.0
        self.rows: list[dict] = []
        self.peaks: list[float] = []

    def data_read(self, started: float) -> None:
        """The loop has the step's micro-batches: their wait since `started` (time.perf_counter)."""
        self._data_s = time.perf_counter() - started

    def flops(self, tokens: int, window: list[dict]) -> float:
        """Model FLOPs of this rank's rows in the step (module docstring)."""
        rows = sum(int(w["input_ids"].shape[0]) for w in window) or 1
        if self.shape is None:
            params = sum(p.numel() for p in getattr(self.engine, "model").parameters()) if hasattr(
                getattr(self.engine, "model", None), "parameters") else 0
            return 6.0 * params * tokens
        return step_model.model_flops_per_token(self.shape, tokens / rows) * tokens

    def row(self, reduced: dict, elapsed: float) -> dict:
        """The step's throughput fields (`reduced`: the loop's sums over data parallel, with model_flops,
        tokens and tokens_run)."""
        tflops = reduced["model_flops"] / self.runtime.world_size / elapsed / 1e12
        out = {"tflops_per_rank": tflops, "mfu": tflops / self.peak if self.peak else None,
               "padding_ratio": reduced["tokens_run"] / max(1, reduced["tokens"]), "step_s": elapsed,
               "data_s": self._data_s}
        out.update(getattr(self.engine, "timings", None) or {})
        self.rows.append(out)
        return out

    def peak_memory(self) -> dict:
        """Peak memory of every rank (a collective: every rank calls it on logged steps)."""
        mine = torch.tensor([peak_memory_bytes(self.runtime.device) / GiB], dtype=torch.float64,
                            device=self.runtime.device)
        if torch.distributed.is_initialized() and self.runtime.world_size > 1:
            every = [torch.zeros_like(mine) for _ in range(self.runtime.world_size)]
            torch.distributed.all_gather(every, mine)
            self.peaks = [float(t) for t in every]
        else:
            self.peaks = [float(mine)]
        return {"peak_mem_gib": max(self.peaks)}

    def summary(self, out: Path) -> dict:
        """Medians over the steps after the first beside the plan's prediction (rank 0 prints and writes)."""
        if not self.runtime.is_main or not self.rows:
            return {}
        steady = self.rows[1:] or self.rows
        measured = {k: statistics.median(r[k] for r in steady) for k in steady[0] if steady[0][k] is not None}
        measured["peak_mem_gib_per_rank"] = self.peaks
        predicted = predict(self.recipe, self.cfg, self.runtime.world_size)
        result = {"measured": measured, "predicted": predicted,
                  "device": torch.cuda.get_device_name(self.runtime.device) if self.runtime.device.type == "cuda"
                  else "cpu"}
        (out / "throughput.json").write_text(json.dumps(result, indent=1))
        m, p = measured, predicted
        mfu = f", MFU {m['mfu']:.1%}" if m.get("mfu") is not None else " (no MFU on CPU)"
        print(f"[numloss] measured: step {m['step_s']:.3f} s (data {m['data_s']:.3f} s), "
              f"{m['tflops_per_rank']:.3g} TFLOP/s per rank{mfu}, peak memory {max(self.peaks, default=0):.2f} GiB "
              f"(max over ranks)", flush=True)
        if p:  # one short line; what the prediction assumed (GEMM rates, NICs, ...) is in throughput.json
            print(f"[numloss] predicted on the recipe's GPUs ({p['hardware'].split(':')[0].removeprefix('GEMM rates ')}): "
                  f"step {p['step_s']:.3f} s ({p['limit']}), MFU {p['mfu']:.1%}, {p['memory_gib']:.2f} GiB per GPU; "
                  f"assumptions in {out / 'throughput.json'}", flush=True)
        return result


def predict(recipe, cfg, world: int) -> dict:
    """The plan of this run's layout on `world` ranks (its engine's, through the contract: the one
    `recipes.validate` reports) at the recipe's hardware settings (cluster.*, else step_model.Hardware's
    defaults), with rows as long as data.seq_len or the data's manifest says; {} when the model has no
    layer shapes or the meta device cannot build it."""
    try:
        Shape.of(cfg)
        params = count_parameters(cfg, vision=recipe.model.vision)
    except Exception:  # noqa: BLE001  (a config without layer shapes, or one the meta device cannot build)
        return {}
    hw = step_model.hardware(recipe)
    rows = step_model.row_tokens(recipe)
    label = f"{step_model.assumptions(hw, 'bfloat16' if recipe.model.dtype == 'bfloat16' else 'float32')}; {rows.note}"
    # at balanced routing; Transformer Engine's packing where the run has GPUs
    pl = engine_contract(recipe).plan(recipe, cfg, hardware=hw, rows=rows, world_size=world, params=params,
                                      gpus=torch.cuda.is_available())
    return {"step_s": pl.step_s, "mfu": pl.mfu, "memory_gib": pl.total / GiB, "limit": pl.limit,
            "padding_ratio": pl.padding_ratio, "net_bytes": pl.net_bytes, "nvlink_bytes": pl.nvlink_bytes,
            "hardware": label}
