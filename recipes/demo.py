"""`make demo`: CE vs CE + SMMD on generated arithmetic, a tiny Llama, CPU, about a minute.

Until the training recipes exist, this is the most end-to-end thing the project can honestly do here
(no model weights or data sets can be downloaded):

1. generate "a+b=" and "a-b=" problems with multi-digit operands, split into train and held-out test
   with no problem in both (fixed seed);
2. train a character-level tokenizer with `tokenizers` (every digit its own token, so the numeric
   vocabulary under the "digits" policy is the ten digits, N = 10);
3. build a tiny Llama from a config with random weights, and train it twice from the same initial
   weights, on the same batches, for the same steps and learning rate: once with `numloss.Objective`
   at plain CE, once with CE + 3.0 · SMMD (LOSSES.md's default weight);
4. greedy-decode the answers of the held-out problems and score them with `recipes.metrics`.

The numbers printed are whatever this run produced; nothing is tuned per objective. With a minute of
CPU training both models are far from solving the task, and the gap between the two objectives at this
scale can go either way: it is a smoke test of the whole path, not a result.

    python -m recipes.demo                 # ~30-40 s of training per objective on a 2-core CPU
    python -m recipes.demo --steps 100     # quicker
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import numloss
from recipes import metrics

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "outputs" / "demo"

RUNS = {
    "CE": {"terms": {}},
    "CE+SMMD": {"terms": {"smmd": {}}},
}


@dataclass
class DemoConfig:
    steps: int = 500
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.0
    seed: int = 0
    max_digits: int = 2  # operands 0 .. 10**max_digits - 1
    ops: str = "+-"
    n_test: int = 500
    hidden: int = 128
    layers: int = 3
    heads: int = 4
    log_every: int = 50
    # One intra-op thread: the tensors are tiny, so a second thread buys little, and on a machine that is
    # busy with anything else two OpenMP threads waiting on each other made every step ~30x slower here
    # (3.6 s vs 0.1 s per step on 2 cores with other jobs running; identical losses).
    threads: int = 1
    runs: dict = field(default_factory=lambda: dict(RUNS))


# ---- data ---------------------------------------------------------------------------------------------


def make_problems(max_digits: int, ops: str, n_test: int, seed: int):
    """Every problem "a<op>b=" with operands below 10**max_digits, shuffled with `seed` and split into a
    held-out test set of `n_test` problems and a training set of the rest (no problem in both).
    Returns (train, test): lists of (prompt, answer_text, answer_value)."""
    limit = 10**max_digits
    problems = []
    for op in ops:
        for a in range(limit):
            for b in range(limit):
                value = a + b if op == "+" else a - b
                problems.append((f"{a}{op}{b}=", str(value), float(value)))
    random.Random(seed).shuffle(problems)
    if not 0 < n_test < len(problems):
        raise ValueError(f"n_test must be in (0, {len(problems)}), got {n_test}")
    return problems[n_test:], problems[:n_test]


def build_tokenizer(texts):
    """A character-level tokenizer trained on `texts`, wrapped as a PreTrainedTokenizerFast.

    The pre-tokenizer isolates every digit and every other character, so BPE can learn no merge and
    each character is one token (what Qwen-style tokenizers do for digits).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=64, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", name_or_path="demo-chars"
    )


def encode_examples(tokenizer, problems):
    """Token ids of "<bos>prompt answer<eos>" and the length of the prompt part (bos included)."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out = []
    for prompt, answer, _ in problems:
        p = tokenizer.encode(prompt, add_special_tokens=False)
        a = tokenizer.encode(answer, add_special_tokens=False)
        out.append(([bos] + p + a + [eos], 1 + len(p)))
    return out


def collate(examples, pad_id: int):
    """Left-padded input_ids, attention_mask, position_ids, and labels (-100 on the prompt and padding)."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full_like(input_ids, numloss.IGNORE_INDEX)
    mask = torch.zeros_like(input_ids)
    for row, (ids, prompt_len) in enumerate(examples):
        offset = width - len(ids)
        input_ids[row, offset:] = torch.tensor(ids)
        mask[row, offset:] = 1
        labels[row, offset + prompt_len :] = torch.tensor(ids[prompt_len:])
    return input_ids, mask, _positions(mask), labels


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp_min(0)


# ---- model and training -------------------------------------------------------------------------------


def build_model(cfg: DemoConfig, tokenizer):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden,
        intermediate_size=cfg.hidden * 4,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.heads,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def shifted(logits: torch.Tensor, labels: torch.Tensor):
    """Position t predicts label t+1: logits[:, :-1] against labels[:, 1:]."""
    return logits[:, :-1], labels[:, 1:]


def lr_at(step: int, cfg: DemoConfig) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_one(name, objective_config, cfg, tokenizer, vocab, train_examples, init_state, log=print):
    """Train from `init_state` with `objective_config`; returns (model, history, seconds)."""
    model = build_model(cfg, tokenizer)
    model.load_state_dict(init_state)
    model.train()
    objective = numloss.Objective(vocab, objective_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    batches = torch.Generator().manual_seed(cfg.seed + 1)  # the same batch order for every run
    history = []
    start = time.perf_counter()
    for step in range(cfg.steps):
        idx = torch.randint(len(train_examples), (cfg.batch_size,), generator=batches).tolist()
        input_ids, mask, pos, labels = collate([train_examples[i] for i in idx], tokenizer.pad_token_id)
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=pos).logits
        out = objective(*shifted(logits, labels))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        optimizer.step()
        record = {"step": step, **out.log_dict()}
        if "term/smmd" not in record:  # the CE run: log SMMD too, as a diagnostic that trains nothing
            with torch.no_grad():
                record["term/smmd"] = float(numloss.functional.smmd(*shifted(logits.detach(), labels), vocab))
        history.append(record)
        if log and (step % cfg.log_every == 0 or step == cfg.steps - 1):
            terms = "  ".join(f"{k}={v:.4f}" for k, v in record.items() if k.startswith("term/"))
            log(f"[{name:>7}] step {step:4d}/{cfg.steps}  loss={record['loss']:.4f}  ce={record['ce']:.4f}  {terms}"
                f"  ({time.perf_counter() - start:.1f}s)")
    return model, history, time.perf_counter() - start


# ---- evaluation ---------------------------------------------------------------------------------------


@torch.no_grad()
def held_out_ce(model, tokenizer, examples, batch_size: int = 250) -> float:
    """Teacher-forced token-mean CE of the answers (the same quantity for every objective)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(examples), batch_size):
        input_ids, mask, pos, labels = collate(examples[i : i + batch_size], tokenizer.pad_token_id)
        logits, lab = shifted(model(input_ids=input_ids, attention_mask=mask, position_ids=pos).logits, labels)
        total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), lab.flatten(), reduction="sum"))
        count += int((lab != numloss.IGNORE_INDEX).sum())
    return total / max(count, 1)


@torch.no_grad()
def greedy_answers(model, tokenizer, prompts, max_new_tokens: int, batch_size: int = 250) -> list[str]:
    """Batched greedy decoding (left-padded prompts, no KV cache: the sequences are a dozen tokens)."""
    model.eval()
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    answers = []
    for i in range(0, len(prompts), batch_size):
        chunk = [[bos] + tokenizer.encode(p, add_special_tokens=False) for p in prompts[i : i + batch_size]]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(c)) + c for c in chunk])
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(c) for c in chunk])[:, None]).long()
        done = torch.zeros(len(chunk), dtype=torch.bool)
        generated = []
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=_positions(mask)).logits[:, -1]
            nxt = logits.argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            generated.append(nxt)
            done |= nxt == eos
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            mask = torch.cat([mask, (~done | (nxt == eos)).long()[:, None]], dim=1)
            if done.all():
                break
        out = torch.stack(generated, dim=1).tolist()
        for row in out:
            row = row[: row.index(eos)] if eos in row else row
            answers.append(tokenizer.decode([t for t in row if t != pad], skip_special_tokens=True))
    return answers


# ---- the whole demo -----------------------------------------------------------------------------------


def run_demo(out_dir: str | Path | None = DEFAULT_OUT, log=print, **overrides) -> dict:
    """Train every objective in `cfg.runs` and evaluate it. Keyword arguments override `DemoConfig`
    fields (e.g. `run_demo(steps=40, n_test=50)`). Writes results.json and curves.png under `out_dir`
    (None: write nothing). Returns the results: the config, the data sizes and, per run, its history,
    held-out CE, metrics and a few sample answers."""
    cfg = DemoConfig(**overrides)
    torch.set_num_threads(cfg.threads)
    train, test = make_problems(cfg.max_digits, cfg.ops, cfg.n_test, cfg.seed)
    tokenizer = build_tokenizer([p + a for p, a, _ in train])
    vocab = numloss.NumericVocab.from_tokenizer(tokenizer, policy="digits")
    train_examples = encode_examples(tokenizer, train)
    test_examples = encode_examples(tokenizer, test)
    log(f"data: {len(train)} train / {len(test)} held-out problems ({cfg.ops!r}, operands < {10**cfg.max_digits}); "
        f"tokenizer: {len(tokenizer)} tokens; {vocab!r}")

    torch.manual_seed(cfg.seed)
    init_state = {k: v.clone() for k, v in build_model(cfg, tokenizer).state_dict().items()}
    n_params = sum(v.numel() for v in init_state.values())
    log(f"model: Llama, {cfg.layers} layers, hidden {cfg.hidden}, {n_params / 1e6:.2f}M parameters, random init; "
        f"{cfg.steps} steps x batch {cfg.batch_size}, AdamW lr {cfg.lr}")

    prompts = [p for p, _, _ in test]
    targets = [v for _, _, v in test]
    max_new = max(len(a) for _, a, _ in test) + 2
    results = {"config": asdict(cfg), "data": {"train": len(train), "test": len(test), "vocab": repr(vocab)}, "runs": {}}
    for name, objective_config in cfg.runs.items():
        model, history, seconds = train_one(name, objective_config, cfg, tokenizer, vocab, train_examples, init_state, log)
        answers = greedy_answers(model, tokenizer, prompts, max_new)
        tail = history[-max(1, len(history) // 10):]
        results["runs"][name] = {
            "objective": objective_config,
            "train_seconds": seconds,
            "final_train_loss": sum(h["loss"] for h in tail) / len(tail),
            "final_train_ce": sum(h["ce"] for h in tail) / len(tail),
            "held_out_ce": held_out_ce(model, tokenizer, test_examples),
            "metrics": metrics.summarize(answers, targets),
            "samples": [{"prompt": p, "target": t, "answer": a} for p, t, a in list(zip(prompts, targets, answers))[:8]],
            "history": history,
        }
    log("")
    log(format_table(results))
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "results.json").write_text(json.dumps(_finite(results), indent=1, default=str, allow_nan=False))
        plot_curves(results, out_dir / "curves.png")
        log(f"\nwrote {out_dir / 'results.json'} and {out_dir / 'curves.png'}")
    return results


def _finite(obj):
    """NaN / inf (an undefined metric) as null, so results.json is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def format_table(results: dict) -> str:
    n = results["data"]["test"]
    header = f"{'objective':<10} {'train loss':>10} {'train CE':>9} {'held-out CE':>11} {'exact match':>11} {'MAE':>8} {'R2':>7} {'parsed':>7}"
    lines = [f"held-out: {n} problems, greedy decoding", header, "-" * len(header)]
    for name, run in results["runs"].items():
        m = run["metrics"]
        lines.append(
            f"{name:<10} {run['final_train_loss']:>10.4f} {run['final_train_ce']:>9.4f} {run['held_out_ce']:>11.4f}"
            f" {m['exact_match']:>11.1%} {m['mae']:>8.2f} {m['r2']:>7.3f} {m['parse_rate']:>7.1%}"
        )
    worst = max((r["metrics"]["exact_match"] for r in results["runs"].values()), key=lambda p: p * (1 - p), default=0.5)
    half_width = 1.96 * math.sqrt(max(worst * (1 - worst), 1e-12) / max(n, 1))
    lines.append("train loss = CE + weighted terms (mean of the last 10% of steps); MAE and R2 over parsed answers.")
    lines.append(f"One seed; at n={n} an exact-match rate is uncertain by about +/-{half_width:.1%} (95%, binomial).")
    return "\n".join(lines)


def plot_curves(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, run in results["runs"].items():
        steps = [h["step"] for h in run["history"]]
        for ax, key in zip(axes, ("ce", "term/smmd")):
            ax.plot(steps, _smooth([h[key] for h in run["history"]]), label=name)
    axes[0].set_title("training CE (smoothed)")
    axes[1].set_title("SMMD term (logged for both runs, smoothed)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _smooth(values, k: int = 10):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc = v if i == 0 else acc + (v - acc) / min(i + 1, k)
        out.append(acc)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = DemoConfig()
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--max-digits", type=int, default=defaults.max_digits)
    parser.add_argument("--n-test", type=int, default=defaults.n_test)
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where results.json and curves.png go")
    args = parser.parse_args(argv)
    run_demo(out_dir=args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
             max_digits=args.max_digits, n_test=args.n_test)


if __name__ == "__main__":
    main()
