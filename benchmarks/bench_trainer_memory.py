"""Step peak memory (and step time) of `NumericSFTTrainer` over TRL's own `SFTTrainer`, each run in a
process of its own, on the same random-weight Llama, rows and settings.

    python benchmarks/bench_trainer_memory.py                 # the grid below (16 cells, 32 processes)
    python benchmarks/bench_trainer_memory.py --quick         # one small configuration (the test's)
    python benchmarks/bench_trainer_memory.py --vocab 128256 --seq 1024 --dtype fp32 --labels completion
    python benchmarks/bench_trainer_memory.py --cells 128256:1024:fp32:full,151936:4096:bf16:completion

What is measured: the peak resident memory of one optimizer step above the resident memory at its start
(Linux `VmHWM`, reset through /proc/self/clear_refs when the step begins, minus `VmRSS` then). The step
measured is the second: the first (a short row) allocates the optimizer's state and TRL's buffers, so
the measured step holds only what a step adds (activations, the LM head's and the loss's temporaries,
gradients). Children run with `MALLOC_MMAP_THRESHOLD_=65536`, so freed tensors go back to the system and
the resident size follows what is alive. Step time: the measured step's wall and CPU seconds.

Grid (the default): V = 128,256 (Llama-3) and 151,936 (Qwen2.5) x a row of 1,024 and 4,096 tokens x fp32
and bf16 x completion-only (the last quarter of the row labelled) and full-row labels. The model: a Llama
of hidden 256, 2 layers, untied head (the shape the first measurement of this gap used, where the head and
the loss dominate the step). bf16 runs at half of every size (hidden 128, V / 2, the row / 2): on these
CPUs (no bf16 instructions) a bf16 matmul is ~6x slower than fp32, and halving hidden, V and tokens
together keeps the ratios of logits (T·V), weights (V·H) and activations (T·H) to each other. bf16: the
weights in bf16 and `bf16=True` (autocast), as a bf16 GPU run is set up.

The objective: CE + 0.3 NTL-WAS (the README's SFT objective). Target: NumericSFTTrainer / SFTTrainer
<= 1.10 in every cell. On CPU TRL's fused head scores every position (on GPUs with Triton only the
labelled ones), so completion-only rows favour the integration here; full-row rows are the like-for-like
comparison.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCABS = (128_256, 151_936)
SEQS = (1024, 4096)
DTYPES = ("fp32", "bf16")
LABELS = ("completion", "full")
TRAINERS = ("sft", "numeric")
HIDDEN, LAYERS = 256, 2
TARGET = 1.10
WARMUP_TOKENS = 64  # the first (unmeasured) step's row


def _status(key: str) -> int:
    """A /proc/self/status memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def child(cell: dict) -> dict:
    """One trainer, one cell: build, run the warm-up step and the measured step; the measured step's peak
    above its start and its times."""
    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(cell.get("threads", 2))
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericSFTTrainer
    from recipes.experiments.tiny import train_tokenizer

    scale = 2 if cell["dtype"] == "bf16" else 1
    vocab, seq, hidden = cell["vocab"] // scale, cell["seq"] // scale, cell.get("hidden", HIDDEN) // scale
    dtype = torch.bfloat16 if cell["dtype"] == "bf16" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_tokenizer(["What is 0123456789 + - = ? user assistant :\n"], Path(tmp) / "tok", "digits")
        digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
        config = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                      num_hidden_layers=cell.get("layers", LAYERS), num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=seq, tie_word_embeddings=False)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        g = torch.Generator().manual_seed(1)

        def row(length: int) -> dict:
            ids = torch.randint(len(tok), vocab, (length,), generator=g)  # ids past the tokenizer's: any token
            ids[1::3] = torch.tensor(digits)[torch.randint(10, (len(ids[1::3]),), generator=g)]  # numbers to score
            answer = length // 4 if cell["labels"] == "completion" else length
            return {"input_ids": ids.tolist(), "completion_mask": [0] * (length - answer) + [1] * answer}

        dataset = Dataset.from_list([row(WARMUP_TOKENS), row(seq)])
        args = SFTConfig(output_dir=f"{tmp}/out", per_device_train_batch_size=1, max_steps=2, logging_steps=10,
                         learning_rate=1e-4, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                         completion_only_loss=cell["labels"] == "completion", max_length=None,
                         bf16=cell["dtype"] == "bf16", disable_tqdm=True, log_level="error")
        kwargs = dict(model=model, args=args, train_dataset=dataset, processing_class=tok)
        if cell["trainer"] == "sft":
            trainer = SFTTrainer(**kwargs)
        else:
            trainer = NumericSFTTrainer(**kwargs, numeric_vocab=NumericVocab.from_tokenizer(tok, vocab_size=vocab),
                                        objective={"terms": {"ntl_was": {}}})
        trainer._get_train_sampler = lambda *a, **k: SequentialSampler(trainer.train_dataset)  # warm-up row first
        measured: dict = {}

        class Measure(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == 1:
                    _reset_peak()
                    measured.update(start=_status("VmRSS"), wall=-time.perf_counter(), cpu=-time.process_time())

            def on_step_end(self, args, state, control, **kw):
                if state.global_step == 2:
                    measured.update(peak=_status("VmHWM"), wall=measured["wall"] + time.perf_counter(),
                                    cpu=measured["cpu"] + time.process_time())

        trainer.add_callback(Measure())
        trainer.train()
        loss = next(h["train_loss"] for h in trainer.state.log_history if "train_loss" in h)
    return {**cell, "vocab_run": vocab, "seq_run": seq, "hidden_run": hidden,
            "peak_mib": (measured["peak"] - measured["start"]) / 2**20, "start_mib": measured["start"] / 2**20,
            "wall_s": measured["wall"], "cpu_s": measured["cpu"], "train_loss": loss}


def run_cell(cell: dict, timeout: float) -> dict:
    """`child(cell)` in a fresh process (its own peak, no memory held from another run)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": str(cell.get("threads", 2)), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(cell)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"cell {cell} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def ratios(results: list[dict]) -> list[dict]:
    """One row per cell: both trainers' peaks and times and NumericSFTTrainer / SFTTrainer."""
    by_cell: dict[tuple, dict] = {}
    for r in results:
        by_cell.setdefault((r["vocab"], r["seq"], r["dtype"], r["labels"]), {})[r["trainer"]] = r
    out = []
    for key, pair in by_cell.items():
        sft, numeric = pair["sft"], pair["numeric"]
        out.append({"vocab": key[0], "seq": key[1], "dtype": key[2], "labels": key[3],
                    "run": f"V {numeric['vocab_run']}, T {numeric['seq_run']}, H {numeric['hidden_run']}",
                    "sft_mib": sft["peak_mib"], "numeric_mib": numeric["peak_mib"],
                    "ratio": numeric["peak_mib"] / sft["peak_mib"],
                    "sft_s": sft["wall_s"], "numeric_s": numeric["wall_s"], "time_ratio": numeric["cpu_s"] / sft["cpu_s"]})
    return out


def table(rows: list[dict]) -> str:
    head = (f"| V | tokens | dtype | labels | run at | SFTTrainer MiB | NumericSFTTrainer MiB | ratio (<= {TARGET}) |"
            " SFTTrainer s | NumericSFTTrainer s | CPU time ratio |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(f"| {r['vocab']:,} | {r['seq']:,} | {r['dtype']} | {r['labels']} | {r['run']} | {r['sft_mib']:,.0f} |"
                     f" {r['numeric_mib']:,.0f} | {r['ratio']:.2f} | {r['sft_s']:.1f} | {r['numeric_s']:.1f} |"
                     f" {r['time_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="one small cell (V 8,192, 256 tokens, fp32, full row)")
    parser.add_argument("--vocab", type=int, nargs="*", default=list(VOCABS))
    parser.add_argument("--seq", type=int, nargs="*", default=list(SEQS))
    parser.add_argument("--dtype", nargs="*", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--labels", nargs="*", default=list(LABELS), choices=LABELS)
    parser.add_argument("--cells", help="explicit cells instead of the grid: V:tokens:dtype:labels,..."
                        " (e.g. 128256:1024:fp32:full,151936:4096:bf16:completion)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return []
    if args.quick:
        cells = [dict(vocab=8192, seq=256, dtype="fp32", labels="full", hidden=64, layers=1)]
    elif args.cells:
        cells = []
        for spec in args.cells.split(","):
            vocab, seq, dtype, labels = spec.split(":")
            if dtype not in DTYPES or labels not in LABELS:
                parser.error(f"--cells {spec!r}: dtype one of {DTYPES}, labels one of {LABELS}")
            cells.append(dict(vocab=int(vocab), seq=int(seq), dtype=dtype, labels=labels))
    else:
        cells = [dict(vocab=v, seq=s, dtype=d, labels=lab) for v, s, d, lab in
                 itertools.product(args.vocab, args.seq, args.dtype, args.labels)]
    results = []
    for cell in cells:
        for trainer in TRAINERS:
            result = run_cell({**cell, "trainer": trainer, "threads": args.threads}, args.timeout)
            results.append(result)
            print(f"{trainer:8} V {cell['vocab']:>7} T {cell['seq']:>5} {cell['dtype']} {cell['labels']:10}"
                  f" peak {result['peak_mib']:8.0f} MiB above start, step {result['wall_s']:.1f} s wall"
                  f" {result['cpu_s']:.1f} s CPU", flush=True)
    rows = ratios(results)
    print(f"\n{datetime.date.today()} {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs,"
          f" {args.threads} threads, load average {os.getloadavg()[0]:.1f}; a random Llama of"
          f" {cells[0].get('layers', LAYERS)} layers, untied head, batch 1 row (sizes run: 'run at')")
    print(table(rows))
    worst = max(r["ratio"] for r in rows)
    print(f"largest NumericSFTTrainer / SFTTrainer step peak: {worst:.2f} (target <= {TARGET}):"
          f" {'ok' if worst <= TARGET else 'ABOVE TARGET'}")
    return rows


if __name__ == "__main__":
    main()
