"""Training step time of each numeric objective over CE alone, and tokens per second, measured in one run.

    python benchmarks/bench_train_step.py [--steps 30] [--batch 64] [--seq 24] [--threads 2]
    python benchmarks/bench_train_step.py --backbone smollm2 [--steps 6] [--losses all]
    python benchmarks/bench_train_step.py --diagnostics [--numeric 1000]   # a step with the gradient diagnostics

Two models:
- default: the model of `recipes/configs/demo.yaml` (a tiny Llama, vocab 64, N = 10 digit tokens) on
  random batches whose labels are 25% digits and 25% ignored prompt; CE against CE + SMMD.
  Target: at most 1.05 at N = 10. `--numeric N`: N numeric tokens (the vocabulary grows to N + 64).
- `--diagnostics`: each objective (CE, CE + SMMD, CE + SMMD + NTL-WAS + DIST2 + GCE) also runs with the
  per-term gradient diagnostics on (`numloss.diagnostics`, "+diag"); the ratio is the cost of a step
  that computes them (`recipes.train` does so on logged steps only: every `train.grad_diagnostics_every`).
- `--backbone smollm2`: SmolLM2-135M-Instruct (V = 49,152, N = 10; made by `python -m recipes.experiments.backbone
  smollm2`), on batches of the SmolLM2 study's arithmetic problems (data_prep's generator and build,
  the study's mix and plain template: `<|im_start|>What is 12 + 7?\\n19<|im_end|>`, labels on the answer
  and the end token; read by `data_prep.reader.ShardDataset`), `--batch` 16 rows as the study's global batch, each objective of the study
  (`recipes.experiments.study.LOSSES`, default weights). This is the cost of each term at the study's shapes that the
  study's own runs cannot give when the machine is shared: their tokens/s say what the load was.

The model is wrapped in `NumericCausalLM` with the logits head, as `recipes.train` does by default, and
stepped with torch AdamW (forward, backward, optimizer step) in one process, no DeepSpeed: DeepSpeed's
CPU collectives would add the same time to every objective and hide its cost. One model and one
optimizer serve every objective (a step's cost does not depend on the weights' values; copies of a 135M
model and its Adam state per objective would not fit beside other jobs). The objectives take turns step
by step on the same batch, in a rotating order so that none always runs first; the medians are compared.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import yaml

from numloss import NumericVocab, Objective
from numloss.adapters.hf import NumericCausalLM

DEMO = Path(__file__).resolve().parents[1] / "recipes" / "configs" / "demo.yaml"
DIAG = "+diag"  # an objective's name with the gradient diagnostics on


def tiny_setup(args):
    """The demo's tiny Llama with random weights, random digit batches, and CE vs CE + SMMD."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = dict(yaml.safe_load(DEMO.read_text())["model"]["config"])
    n = args.numeric
    if n != 10:
        config["vocab_size"] = n + 64
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config)
    vocab = NumericVocab(list(range(10, 10 + n)), list(range(n)), vocab_size=hf_config.vocab_size)
    g = torch.Generator().manual_seed(1)

    def batch():
        ids = torch.randint(10 + n, hf_config.vocab_size, (args.batch, args.seq), generator=g)
        ids[:, args.seq // 2:: 2] = torch.randint(10, 10 + n, (args.batch, len(range(args.seq // 2, args.seq, 2))), generator=g)
        labels = ids.clone()
        labels[:, : args.seq // 4] = -100
        return ids, labels, None

    objectives = {"ce": {"terms": {}}, "smmd": {"terms": {"smmd": {}}}}
    if args.diagnostics:
        objectives["all"] = {"terms": {"smmd": {}, "ntl_was": {}, "dist2": {}, "gce": {"weight": 0.5}}}
        objectives = {name + suffix: spec for name, spec in objectives.items() for suffix in ("", DIAG)}
    return model, vocab, objectives, batch, f"tiny Llama, V={hf_config.vocab_size}, N={n}"


def backbone_setup(args):
    """SmolLM2-135M-Instruct, the SmolLM2 study's problems and template, and the study's objectives."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_prep.reader import ShardDataset
    from recipes.experiments.backbone import get_backbone
    from recipes.inputs.batches import model_inputs
    from recipes.experiments.study import LOSSES, MIX
    from recipes.experiments.tiny import build_jsonl_shards, write_arithmetic_split

    path = get_backbone(args.backbone)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    vocab = NumericVocab.from_tokenizer(tokenizer, policy="digits", vocab_size=model.config.vocab_size)
    # the study's rows exactly: its problems built into shards by data_prep, read as training reads them
    workdir = tempfile.TemporaryDirectory(prefix="bench_train_step-")  # removed when the run ends
    tmp = Path(workdir.name)
    train, _ = write_arithmetic_split(tmp, args.batch * (args.steps + 1), 1, list(MIX), seed=0)
    build_jsonl_shards(train, path, tmp / "data", numeric_policy="digits")
    batches = iter(ShardDataset(str(tmp / "data"), args.batch, global_batch_size=args.batch))

    def batch(_keep=workdir):  # the reader reads row groups as it goes: the directory lives as long as this
        inputs, _ = model_inputs(next(batches))
        return inputs["input_ids"], inputs["labels"], inputs["attention_mask"]

    wanted = list(LOSSES) if args.losses == "all" else args.losses.split(",")
    unknown = [name for name in wanted if name not in LOSSES]
    if unknown:
        raise SystemExit(f"unknown loss {unknown[0]!r}; the study's are {', '.join(LOSSES)}")
    objectives = {name: LOSSES[name] for name in ["ce", *[w for w in wanted if w != "ce"]]}
    return model, vocab, objectives, batch, f"SmolLM2-135M-Instruct, V={model.config.vocab_size}, N={vocab.size}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbone", default=None, help="a recipes.experiments.backbone name (smollm2) instead of the tiny model")
    parser.add_argument("--losses", default="all", help="--backbone: comma-separated study losses, or all")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per objective (30 tiny, 6 backbone)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first steps (3 tiny, 1 backbone)")
    parser.add_argument("--batch", type=int, default=None, help="rows per step (64 tiny, 16 backbone)")
    parser.add_argument("--seq", type=int, default=24, help="tiny model: tokens per row")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--numeric", type=int, default=10, help="tiny model: N numeric tokens (V = N + 64 past 10)")
    parser.add_argument("--diagnostics", action="store_true",
                        help="tiny model: each objective also with the per-term gradient diagnostics on")
    args = parser.parse_args()
    tiny = args.backbone is None
    args.steps = args.steps or (30 if tiny else 6)
    args.batch = args.batch or (64 if tiny else 16)
    warmup = args.warmup if args.warmup is not None else (3 if tiny else 1)
    torch.set_num_threads(args.threads)
    model, vocab, objectives, next_batch, what = (tiny_setup if tiny else backbone_setup)(args)

    wrapped = {name: NumericCausalLM(model, Objective(vocab, spec, diagnostics=name.endswith(DIAG)), chunked=False)
               for name, spec in objectives.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    names = list(wrapped)
    times = {name: [] for name in names}
    tokens = []
    for step in range(args.steps + warmup):
        ids, labels, mask = next_batch()
        tokens.append(ids.numel())
        shift = step % len(names)  # rotate the order: no objective always runs first after a new batch
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            out = wrapped[name](input_ids=ids, labels=labels, attention_mask=mask)
            if not torch.isfinite(out.loss):
                raise RuntimeError(f"{name}: non-finite loss {out.loss.item()} at step {step}")
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= warmup:
                times[name].append(time.perf_counter() - start)
        print(f"step {step + 1}/{args.steps + warmup} done", flush=True)
    per_step = statistics.mean(tokens[warmup:])
    print(f"{what}, {args.batch} rows x {per_step / args.batch:.1f} tokens (padding included),"
          f" {args.threads} threads, median of {args.steps} steps after {warmup} warm-up")
    print(f"{'objective':12} {'step s':>8} {'tokens/s':>9} {'vs CE':>6}")
    ce = statistics.median(times["ce"])
    for name in names:
        t = statistics.median(times[name])
        print(f"{name:12} {t:8.3f} {per_step / t:9.1f} {t / ce:6.3f}")
    if tiny:
        ratio = statistics.median(times["smmd"]) / ce
        print(f"ratio CE+SMMD / CE = {ratio:.3f} (target <= 1.05): {'ok' if ratio <= 1.05 else 'ABOVE TARGET'}")
    for name in [n for n in names if n + DIAG in times]:
        ratio = statistics.median(times[name + DIAG]) / statistics.median(times[name])
        print(f"ratio {name} with / without diagnostics = {ratio:.3f}")


if __name__ == "__main__":
    main()
