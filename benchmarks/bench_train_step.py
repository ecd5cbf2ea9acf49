"""Training step time with CE + SMMD over CE alone, for the demo's tiny model, and tokens per second.

    python benchmarks/bench_train_step.py [--steps 30] [--batch 64] [--seq 24] [--threads 2]

The model of `recipes/configs/demo.yaml` (a tiny Llama, vocab 64, N = 10 digit tokens) is wrapped in
`NumericCausalLM` exactly as `recipes.train` does and stepped with torch AdamW (forward, backward,
optimizer step) on batches whose labels are 25% digits and 25% ignored prompt. One process, no
DeepSpeed: DeepSpeed's CPU collectives would add the same time to both and hide the objective's cost.
The two objectives alternate step by step on the same batches, from the same initial weights; the
medians are compared. Target (issue 6): at most 1.05 at N = 10.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
import yaml

from numloss import NumericVocab, Objective
from numloss.adapters.hf import NumericCausalLM

DEMO = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "demo.yaml"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(yaml.safe_load(DEMO.read_text())["model"]["config"])
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(hf_config)
    vocab = NumericVocab(list(range(10, 20)), list(range(10)), vocab_size=hf_config.vocab_size)
    runs = {}
    for name, terms in (("CE", {}), ("CE+SMMD", {"smmd": {}})):
        model = NumericCausalLM(copy.deepcopy(base), Objective(vocab, {"terms": terms}), chunked=False)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    g = torch.Generator().manual_seed(1)
    times = {name: [] for name in runs}
    tokens = args.batch * args.seq
    for step in range(args.steps + 3):
        ids = torch.randint(20, hf_config.vocab_size, (args.batch, args.seq), generator=g)
        ids[:, args.seq // 2:: 2] = torch.randint(10, 20, (args.batch, len(range(args.seq // 2, args.seq, 2))), generator=g)
        labels = ids.clone()
        labels[:, : args.seq // 4] = -100
        for name, (model, optimizer) in runs.items():
            start = time.perf_counter()
            out = model(input_ids=ids, labels=labels)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= 3:  # warm-up steps not counted
                times[name].append(time.perf_counter() - start)
    ce, smmd = statistics.median(times["CE"]), statistics.median(times["CE+SMMD"])
    print(f"tiny Llama ({sum(p.numel() for p in base.parameters()) / 1e6:.2f}M params, V={hf_config.vocab_size}, N=10),"
          f" batch {args.batch} x {args.seq} tokens, {args.threads} threads, median of {args.steps} steps")
    print(f"{'objective':10} {'step ms':>8} {'tokens/s':>9}")
    for name, t in (("CE", ce), ("CE+SMMD", smmd)):
        print(f"{name:10} {1000 * t:8.1f} {tokens / t:9.0f}")
    ratio = smmd / ce
    print(f"ratio CE+SMMD / CE = {ratio:.3f} (target <= 1.05): {'ok' if ratio <= 1.05 else 'ABOVE TARGET'}")


if __name__ == "__main__":
    main()
