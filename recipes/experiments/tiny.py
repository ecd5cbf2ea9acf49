"""Small offline stand-ins for what a real run downloads: a tokenizer trained on the fly, a tiny
Llama config, and a tiny LLaVA (processor + config) for the vision-language path.
Used by the CPU demo, the study and the tests; a real recipe names a hub model instead.

    python -m recipes.experiments.tiny FILE... --out DIR [--style digits|groups3]

trains a tokenizer on the text of FILEs (every digit its own token, or Llama-3-style groups of up to
three) and saves it into DIR, a local tokenizer directory for `data_prep build --tokenizer DIR` and a
recipe's `model.tokenizer`: the README's CPU starter makes its tokenizer this way, with no Hub.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_prep.sources.arithmetic_gen import generate
from data_prep.sources.base import SourceConfig

SPECIALS = ["<pad>", "<bos>", "<eos>"]


def train_tokenizer(texts, out_dir: str | Path, style: str = "digits", vocab_size: int = 2000):
    """Train a BPE tokenizer on `texts` and save it as a PreTrainedTokenizerFast in `out_dir`.

    style "digits": every digit its own token (Qwen-style, N = 10 numeric tokens).
    style "groups3": numbers split left to right into groups of up to three digits that are single tokens
    (Llama-3-style); the trainer is seeded with all of 0..999 so the integers policy finds N = 1000.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    if style == "digits":
        split = pre_tokenizers.Split(Regex(r"[0-9]|[^0-9]"), behavior="isolated")
        extra = []
    elif style == "groups3":
        split = pre_tokenizers.Split(Regex(r"[0-9]{1,3}|[^0-9]"), behavior="isolated")
        extra = [str(i) for i in range(1000)]
    else:
        raise ValueError(f"tokenizer style {style!r}: expected 'digits' or 'groups3'")
    tok.pre_tokenizer = split
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(list(texts) + extra, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return fast


def tiny_llama_config(vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                      max_positions: int = 128) -> dict:
    """A model.config section for a random-weight Llama small enough to train on two CPU cores."""
    return {"model_type": "llama", "vocab_size": vocab_size, "hidden_size": hidden,
            "intermediate_size": 4 * hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "max_position_embeddings": max_positions,
            "tie_word_embeddings": False, "rope_theta": 10000.0}


def tiny_vision_processor(tokenizer_dir: str | Path, out_dir: str | Path, image_size: int = 28,
                          patch_size: int = 14):
    """A LLaVA processor (CLIP image processor + the tokenizer in `tokenizer_dir` with an "<image>" token
    added) saved in `out_dir`: the offline stand-in for a vision-language model's hub processor.
    Images are resized and cropped to `image_size`, which gives (image_size / patch_size)^2 image tokens."""
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": image_size},
                                           crop_size={"height": image_size, "width": image_size}),
        tokenizer=tok, patch_size=patch_size, vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, dropped by the "default" strategy
        chat_template=getattr(tok, "chat_template", None))
    processor.save_pretrained(str(out_dir))
    return processor


def tiny_llava_config(processor, hidden: int = 64, layers: int = 2, image_size: int = 28,
                      patch_size: int = 14) -> dict:
    """A model.config section for a random-weight LLaVA (CLIP tower + projector + tiny Llama) that reads
    the images of `tiny_vision_processor(..., image_size, patch_size)`."""
    tok = processor.tokenizer
    return {"model_type": "llava",
            "text_config": tiny_llama_config(len(tok), hidden=hidden, layers=layers, max_positions=256),
            "vision_config": {"model_type": "clip_vision_model", "hidden_size": hidden,
                              "intermediate_size": 2 * hidden, "num_hidden_layers": 1, "num_attention_heads": 2,
                              "image_size": image_size, "patch_size": patch_size},
            "image_token_index": tok.convert_tokens_to_ids("<image>"),
            "vision_feature_select_strategy": "default", "vision_feature_layer": -1,
            "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}


def write_arithmetic_split(out: str | Path, n_train: int, n_eval: int, mix: list[tuple[str, dict]],
                           seed: int = 0) -> tuple[Path, Path]:
    """Disjoint `train.jsonl` / `eval.jsonl` ({"prompt", "target"}) in `out` from data_prep's arithmetic
    generator: record i is drawn from `mix[i % len(mix)]` (module, options), duplicates are dropped, the
    rest shuffled with `seed` and split, so no problem is in both."""
    import json
    import random


    problems, seen, index = [], set(), 0
    while len(problems) < n_train + n_eval:
        module, opts = mix[index % len(mix)]
        question, answer = generate(module, index, {"seed": seed, **opts})
        index += 1
        if question not in seen:
            seen.add(question)
            problems.append({"prompt": question, "target": answer})
        if index > 50 * (n_train + n_eval):
            raise ValueError(f"only {len(problems)} distinct problems from {mix}; ask for fewer")
    random.Random(seed).shuffle(problems)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.jsonl", out / "eval.jsonl"
    for path, part in zip(paths, (problems[n_eval:], problems[:n_eval])):
        path.write_text("".join(json.dumps(p) + "\n" for p in part))
    return paths


def build_plain_shards(source, tokenizer_dir: str | Path, out_dir: str | Path, max_length: int = 64,
                       numeric_policy: str = "digits", template: str = "plain",
                       system_prompt: str | None = None) -> dict:
    """data_prep shards of one `data_prep.SourceConfig` (the plain template unless `template` says
    "chat", with `system_prompt`), in this process (workers=0), replacing whatever `out_dir` held;
    returns the manifest's totals."""
    from data_prep.build import BuildConfig, build
    from data_prep.tokenize import TokenizeConfig

    cfg = BuildConfig(sources=[source], tokenize=TokenizeConfig(tokenizer=str(tokenizer_dir), template=template,
                                                                system_prompt=system_prompt,
                                                                max_length=max_length,
                                                                numeric_policy=numeric_policy))
    return build(cfg, str(out_dir), workers=0, progress=False, overwrite=True)["totals"]


def build_jsonl_shards(jsonl: str | Path, tokenizer_dir: str | Path, out_dir: str | Path,
                       numeric_policy: str = "digits", **template) -> dict:
    """data_prep shards of a {"prompt", "target"} JSONL file (plain template unless `template=`,
    `system_prompt=` say otherwise, as in `build_plain_shards`); returns the manifest's totals."""

    return build_plain_shards(SourceConfig(kind="generic", path=str(jsonl)), tokenizer_dir, out_dir,
                              numeric_policy=numeric_policy, **template)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipes.experiments.tiny",
                                description="Train a small local tokenizer on text files (no Hub).")
    p.add_argument("files", nargs="+", help="text or JSONL files whose text it is trained on")
    p.add_argument("--out", required=True, help="the tokenizer directory to write")
    p.add_argument("--style", choices=("digits", "groups3"), default="digits",
                   help="digits: every digit its own token; groups3: groups of up to three digits (Llama-3-style)")
    a = p.parse_args(argv)
    missing = [f for f in a.files if not Path(f).is_file()]
    if missing:
        print(f"no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    tok = train_tokenizer([Path(f).read_text() for f in a.files], a.out, style=a.style)
    print(f"wrote {a.out}: {len(tok)} tokens ({a.style})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
