"""Throughput of `data_prep build` against the bare tokenizer's batch encoding of the same texts.

One run, same machine, same texts: a GSM8K-like JSONL corpus generated here (no downloads), and two
byte-level BPE tokenizers made here, plain template: "small", trained on the corpus with a 4,000-token budget (1,501 tokens result)
(Llama-3-style digit groups), and "llama3", 128,256 tokens assembled offline like Llama-3's
(tests/data_prep/helpers.assemble_tokenizer; `--tokenizers qwen` adds a 151,665-token Qwen2.5-like one
with single digits; its chat template is not used): a real-size vocabulary makes the numeric vocabulary,
the tokenizer loading in every worker and the worker start-up cost what they cost with a real model.
The bare baseline encodes the rendered texts (prompt + separator + target) with the Rust tokenizer's
`encode_batch` using all cores (the fastest way to tokenize, no Python per token); `build` does
everything a build does, start-up included: start the workers (each loads the tokenizer and builds
the numeric vocabulary; the main process loads neither), read and parse the JSONL, render, tokenize,
mask, annotate numbers, write Parquet shards and the manifest. A build of the first 1,024 examples
splits the build's time into a fixed part and a part per example, from which the last line gives the
ratio as the corpus grows and the corpus size at which it reaches 0.7. The three alternate for
`--repeats` rounds and each one's best time counts (the first round also starts this process's
forkserver, which a command-line build pays every time: importing torch and transformers, ~3-4 s of
CPU here).

    python benchmarks/bench_data_prep.py [--examples 40000] [--workers N] [--tokenizers small,llama3]

Target: build tokens/s >= 0.7 x bare tokens/s, for each tokenizer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_corpus(path: str, n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    names = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Randy"]
    items = ["clips", "apples", "pages", "dollars", "cookies", "marbles", "tickets", "books"]
    rows = []
    with open(path, "w") as fh:
        for _ in range(n):
            a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(1, 5000)
            who, what = rng.choice(names), rng.choice(items)
            q = (f"{who} has {a} {what}. She buys {b} more packs with {c:,} {what} each and gives away "
                 f"{rng.randint(1, a)} of them. How many {what} does {who} have now?")
            steps = [f"{who} buys {b} * {c:,} = <<{b}*{c}={b * c}>>{b * c:,} {what}."]
            for _ in range(rng.randint(1, 4)):
                x, y = rng.randint(10, 99999), rng.randint(10, 999)
                steps.append(f"Then {x:,} + {y} = <<{x}+{y}={x + y}>>{x + y:,} and {x} / {y} = {x / y:.2f}.")
            total = a + b * c
            target = "\n".join(steps) + f"\n#### {total:,}"
            fh.write(json.dumps({"question": q, "answer": target}) + "\n")
            rows.append((q, target))
    return rows


def train_tokenizer(out_dir: str, texts: list[str]) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4000, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(out_dir)
    return out_dir


def measure(name: str, tok_dir: str, data: str, texts: list[str], workers: int, repeats: int,
            tmp: str) -> float:
    """Print bare encode_batch, HF tokenizer() and build throughput for one tokenizer; return the ratio."""
    from transformers import AutoTokenizer

    from data_prep import BuildConfig, ShardConfig, SourceConfig, TokenizeConfig, build

    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = BuildConfig(sources=[SourceConfig("gsm8k", path=data)],
                      tokenize=TokenizeConfig(tok_dir, template="plain", numeric_policy="integers", max_length=4096),
                      shards=ShardConfig(shard_bytes=64 << 20))

    # The same build of the first `small` records only: with the full build it splits the build's time
    # into a fixed part (start-up, the workers loading the tokenizer, the end) and a part per example.
    small = max(1, min(1024, len(texts) // 8))
    small_cfg = dataclasses.replace(cfg, sources=[SourceConfig("gsm8k", path=data, limit=small)])

    # Bare tokenizer (Rust batch encoding on all cores), the build and the small build, alternating,
    # best of `repeats` each: all get the same chances against noise from the rest of the machine.
    bare = build_time = small_time = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        encs = tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        bare = min(bare, time.perf_counter() - t0)
        bare_tokens = sum(len(e.ids) for e in encs)
        del encs
        out = os.path.join(tmp, f"out-{name}-{r}")
        t0 = time.perf_counter()
        m = build(cfg, out, workers=workers, chunk_size=512, progress=False)
        build_time = min(build_time, time.perf_counter() - t0)
        build_tokens = m["totals"]["tokens"]
        shutil.rmtree(out)
        t0 = time.perf_counter()
        build(small_cfg, out, workers=workers, chunk_size=512, progress=False)
        small_time = min(small_time, time.perf_counter() - t0)
        shutil.rmtree(out)
    t0 = time.perf_counter()
    tok(texts, add_special_tokens=False)
    hf_time = time.perf_counter() - t0

    bare_tps, build_tps = bare_tokens / bare, build_tokens / build_time
    print(f"tokenizer {name} ({len(tok)} tokens)  examples {len(texts)}  cores {os.cpu_count()}  "
          f"build workers {workers}")
    print(f"  bare encode_batch   : {bare_tokens:>10} tokens  {bare:7.3f} s  {bare_tps:12,.0f} tok/s")
    print(f"  HF tokenizer(texts) : {bare_tokens:>10} tokens  {hf_time:7.3f} s  "
          f"{bare_tokens / hf_time:12,.0f} tok/s")
    print(f"  data_prep build     : {build_tokens:>10} tokens  {build_time:7.3f} s  {build_tps:12,.0f} tok/s"
          f"  ({m['totals']['examples_kept']} kept, {m['totals']['rejected']} rejected, "
          f"{len(m['shards'])} shards)")
    ratio = build_tps / bare_tps
    print(f"  ratio build / bare encode_batch = {ratio:.2f}  "
          f"(target >= 0.70: {'PASS' if ratio >= 0.7 else 'FAIL'})")
    # build(n) ~ fixed + n * per_example, from the two builds; bare(n) = n * bare per example.
    n = len(texts)
    per_example = (build_time - small_time) / (n - small)
    fixed = small_time - small * per_example
    limit = (build_tokens / bare_tokens) * (bare / n) / per_example  # the ratio as n grows
    at = fixed / (per_example * (limit / 0.7 - 1)) if limit > 0.7 else None
    print(f"  build of {small} examples: {small_time:.3f} s -> fixed cost ~{fixed:.2f} s, "
          f"{1000 * per_example:.3f} s per 1k examples; ratio as the corpus grows -> {limit:.2f}, "
          + (f"0.70 from ~{at:,.0f} examples" if at is not None else "never 0.70"), flush=True)
    return ratio


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--examples", type=int, default=40000)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of bare encoding and build (best of)")
    p.add_argument("--tokenizers", default="small,llama3", help="comma-separated: small, llama3, qwen")
    a = p.parse_args()

    from tests.data_prep.helpers import assemble_tokenizer

    tmp = tempfile.mkdtemp(prefix="bench_data_prep_")
    try:
        data = os.path.join(tmp, "train.jsonl")
        rows = make_corpus(data, a.examples)
        texts = [q + "\n" + t for q, t in rows]  # what the plain template renders (less BOS/EOS)
        for name in a.tokenizers.split(","):
            if name == "small":
                tok_dir = train_tokenizer(os.path.join(tmp, "tok-small"), texts[:3000])
            else:
                tok_dir = assemble_tokenizer(os.path.join(tmp, f"tok-{name}"), name)
            measure(name, tok_dir, data, texts, a.workers, a.repeats, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
