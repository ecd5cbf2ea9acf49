"""Step time of `NumericSFTTrainer` over TRL's own `SFTTrainer` on the same model, rows and settings.

    python benchmarks/bench_sft_step.py [--model smollm2|small] [--steps 6] [--rounds 2] [--batch 8] [--threads 2]

Contenders, each a real `trainer.train()` (forward, backward, AdamW step, TRL's collator and metrics):
- `sft`: TRL's SFTTrainer (its fused LM head: one forward per micro-batch, no full logits);
- `numeric ce`: NumericSFTTrainer with no term (the integration's own cost: full logits, numloss's pass
  over them, TRL's metrics from them);
- `numeric ntl_was`: NumericSFTTrainer with the README's SFT objective (CE + 0.3 NTL-WAS);
- `sft + compute_loss_func`: SFTTrainer given a CE `compute_loss_func`, TRL's deprecated path for a
  custom loss (a second forward per micro-batch for TRL's metrics).
The ratio of each to `sft` (CPU time; each round's medians divided, then the median over rounds) is
the number to read; target: numeric ntl_was <= 1.10.

Models (random weights from a config: a step's cost does not depend on the weights' values):
- `smollm2` (default): SmolLM2-135M-Instruct's shape (30 layers, hidden 576, V = 49,152, tied embeddings);
- `small`: 4 layers, hidden 256, the same V: the LM head and the loss are a larger share of the step.
Rows: TRL conversational prompt/completion rows (an arithmetic question behind a few sentences of
context, ~`--tokens` tokens each), tokenized by a tokenizer trained here; the loss on the answer only
(TRL's default for such rows: the integration's LM head then skips the prompt) or, `--loss-on all`, on
every token (both trainers' heads then run on every position).

Timing: a `TrainerCallback` stamps every optimizer step with the wall clock and with this process's CPU
time (`time.process_time`, every thread); the first `--warmup` steps of each run are dropped and each
contender's median step is used. The ratios are of CPU time: on a shared machine the wall time of one
step swung 5x between rounds with the load (two cores, load average 10), its CPU time far less; the
wall medians are printed beside them. The contenders run one after another, `--rounds` times in a
rotating order, so that a change of load falls on all of them.
fp32 on CPU (`bf16=False`): SFTConfig's bf16 default runs autocast on CPUs without bf16 instructions.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recipes.experiments.tiny import train_tokenizer  # noqa: E402

MODELS = {
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, tie_word_embeddings=True),
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, tie_word_embeddings=True),
}
VOCAB = 49_152  # SmolLM2's
CONTEXT = ("A shop sells pencils in boxes and keeps a record of what it sells each day. The numbers below "
           "come from that record, and the question asks for one of them. ")


def rows(n: int, tokens: int) -> list[dict]:
    """Prompt/completion rows whose prompt is ~`tokens` characters-as-tokens long (the tokenizer below
    splits digits and most characters apart)."""
    out = []
    for i in range(n):
        a, b = 37 * i + 12, 91 * i + 405
        context = (CONTEXT * (tokens // len(CONTEXT) + 1))[:max(tokens - 30, 0)]
        out.append({"prompt": [{"role": "user", "content": f"{context}What is {a} + {b}?"}],
                    "completion": [{"role": "assistant", "content": str(a + b)}]})
    return out


class StepTimes:
    """A TrainerCallback recording every optimizer step's wall time and this process's CPU time (all its
    threads) over it."""

    def __init__(self):
        from transformers import TrainerCallback

        wall, cpu = self.wall, self.cpu = [], []

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                wall.append(-time.perf_counter())
                cpu.append(-time.process_time())

            def on_step_end(self, args, state, control, **kwargs):
                wall[-1] += time.perf_counter()
                cpu[-1] += time.process_time()

        self.callback = Callback()


def make_trainer(name: str, model, tokenizer, dataset, out_dir: str, args):
    from trl import SFTConfig, SFTTrainer

    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericSFTTrainer

    config = SFTConfig(output_dir=out_dir, per_device_train_batch_size=args.batch, max_steps=args.steps + args.warmup,
                       logging_steps=args.steps + args.warmup, learning_rate=1e-4, report_to=[], save_strategy="no",
                       use_cpu=True, seed=0, completion_only_loss=args.loss_on == "completion",
                       disable_tqdm=True, log_level="error", bf16=False, max_length=None)
    kwargs = dict(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    if name == "sft":
        return SFTTrainer(**kwargs)
    if name == "sft + compute_loss_func":
        def ce(outputs, labels, num_items_in_batch=None):
            logits = outputs.logits[:, :-1].float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                                     ignore_index=-100, reduction="sum")
            return loss / num_items_in_batch

        return SFTTrainer(**kwargs, compute_loss_func=ce)
    vocab = NumericVocab.from_tokenizer(tokenizer, policy="digits")
    terms = {} if name == "numeric ce" else {"ntl_was": {}}
    return NumericSFTTrainer(**kwargs, numeric_vocab=vocab, objective={"terms": terms})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every contender, in rotating order")
    parser.add_argument("--batch", type=int, default=8, help="rows per step (one micro-batch)")
    parser.add_argument("--tokens", type=int, default=128, help="about this many tokens per row")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loss-on", default="completion", choices=["completion", "all"],
                        help="labels on the answer only (TRL's default for these rows), or on every token")
    parser.add_argument("--contenders", default="sft,numeric ce,numeric ntl_was,sft + compute_loss_func")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM

    contenders = args.contenders.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = train_tokenizer([CONTEXT, "What is 0123456789 + ? user assistant :\n"], Path(tmp) / "tok", "digits")
        tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                   "{% if add_generation_prompt %}assistant: {% endif %}")
        config = AutoConfig.for_model("llama", vocab_size=VOCAB, max_position_embeddings=2048, **MODELS[args.model])
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        dataset = Dataset.from_list(rows(args.batch * (args.steps + args.warmup), args.tokens))
        wall: dict[str, list[float]] = {name: [] for name in contenders}
        cpu: dict[str, list[float]] = {name: [] for name in contenders}
        rounds: list[dict[str, float]] = []  # each round's median CPU step per contender
        tokens_per_step = None
        for round_ in range(args.rounds):
            order = contenders[round_ % len(contenders):] + contenders[:round_ % len(contenders)]
            rounds.append({})
            for name in order:
                trainer = make_trainer(name, copy.deepcopy(base), tokenizer, dataset, f"{tmp}/{name}", args)
                stamps = StepTimes()
                trainer.add_callback(stamps.callback)
                trainer.train()
                wall[name] += stamps.wall[args.warmup:]
                cpu[name] += stamps.cpu[args.warmup:]
                rounds[-1][name] = statistics.median(stamps.cpu[args.warmup:])
                if tokens_per_step is None:
                    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(args.batch)])
                    tokens_per_step = int(batch["input_ids"].numel())
                print(f"round {round_ + 1}/{args.rounds} {name}: median {statistics.median(stamps.cpu[args.warmup:]):.3f}"
                      f" CPU s, {statistics.median(stamps.wall[args.warmup:]):.3f} wall s", flush=True)
                del trainer
    medians = {name: statistics.median(t) for name, t in cpu.items()}
    walls = {name: statistics.median(t) for name, t in wall.items()}
    # the ratio of each round's medians, then the median over rounds: a round's contenders ran minutes
    # apart, under about the same load
    ratios = {name: statistics.median(r[name] / r["sft"] for r in rounds) for name in contenders} \
        if "sft" in contenders else {}
    print(f"\n{datetime.date.today()} {platform.machine()} {platform.processor() or ''} torch {torch.__version__},"
          f" {args.threads} threads, load average {os.getloadavg()[0]:.1f}; model {args.model} (V = {VOCAB}),"
          f" {args.batch} rows x {tokens_per_step / args.batch:.0f} tokens per step, loss on {args.loss_on} tokens,"
          f" {args.steps} timed steps x {args.rounds} rounds")
    print(f"{'trainer':26} {'CPU s':>8} {'wall s':>8} {'vs sft':>7}  per round")
    for name, t in medians.items():
        per_round = " ".join(f"{r[name] / r['sft']:.3f}" for r in rounds) if ratios else ""
        print(f"{name:26} {t:8.3f} {walls[name]:8.3f} {ratios.get(name, float('nan')):7.3f}  {per_round}")
    if "numeric ntl_was" in ratios:
        ratio = ratios["numeric ntl_was"]
        print(f"ratio NumericSFTTrainer(ntl_was) / SFTTrainer = {ratio:.3f} (target <= 1.10): "
              f"{'ok' if ratio <= 1.10 else 'ABOVE TARGET'}")


if __name__ == "__main__":
    main()
