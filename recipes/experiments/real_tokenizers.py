"""Tokenizers of real size (Llama-3: 128,256 tokens, Qwen2.5: 151,665), assembled offline in about a
second: no hub, no training. Sizes change behaviour (torch's thread pool starts on 150k-entry tables,
Megatron pads the vocabulary to a multiple of 128 x TP, a bf16 [V, H] buffer is gigabytes), so tests and
the GPU check (`benchmarks/gpu_check.py`) use these where a real vocabulary matters.
"""

from __future__ import annotations

import json
import os

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Sizes of the real ones: Llama-3 has 128,000 regular + 256 special tokens, Qwen2.5 151,643 + 22.
REAL_SIZES = {"llama3": (128_000, 256), "qwen": (151_643, 22)}


def assemble_tokenizer(out_dir: str, style: str) -> str:
    """A byte-level BPE of real size (Llama-3 or Qwen2.5), assembled from a vocab and merges written
    here instead of trained (training 128k merges takes minutes; this takes about a second).

    Both split numbers as the real ones do: "llama3" isolates groups of up to three digits and has a
    token for every 1-3 digit string ("7", "42", "007"), "qwen" splits every digit. The rest of the
    vocabulary is letter n-grams ("ab", "Ġab", "abc", ...) up to the real size, each reachable by a
    merge, so ordinary text encodes to multi-letter tokens. "qwen" also gets a ChatML chat template.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    regular, n_special = REAL_SIZES[style]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []

    def add(left: str, right: str) -> None:
        if len(vocab) < regular and left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))

    digits = "0123456789"
    if style == "llama3":
        for a in digits:
            for b in digits:
                add(a, b)
        for ab in [a + b for a in digits for b in digits]:
            for c in digits:
                add(ab, c)
        split = pre_tokenizers.Split(Regex(r"\d{1,3}"), behavior="isolated")
    elif style == "qwen":
        split = pre_tokenizers.Digits(individual_digits=True)
    else:
        raise ValueError(style)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    letters += [c.upper() for c in letters]
    level = [u + v for u in ["Ġ"] + letters for v in letters]  # "Ġa" (a word start), "ab", ...
    for u in ["Ġ"] + letters:
        for v in letters:
            add(u, v)
    while len(vocab) < regular:  # grow by one letter per level until the vocabulary is full
        nxt = []
        for w in level:
            for v in letters:
                add(w, v)
                nxt.append(w + v)
                if len(vocab) >= regular:
                    break
            if len(vocab) >= regular:
                break
        level = nxt
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    if style == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
            f"<|reserved_special_token_{i}|>" for i in range(n_special - 2)]
        bos, eos, pad = specials[0], specials[1], specials[1]
    else:
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [
            f"<|extra_{i}|>" for i in range(n_special - 3)]
        bos, eos, pad = None, "<|im_end|>", "<|endoftext|>"
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad)
    if style == "qwen":
        fast.chat_template = CHATML
    assert len(fast) == regular + n_special, (len(fast), regular + n_special)
    fast.save_pretrained(out_dir)
    # The real repos' tokenizer_config.json lists the added tokens ("added_tokens_decoder", written by
    # transformers 4); transformers 5 does not write it, and a config without it loads through a legacy
    # path that parses the whole tokenizer.json in Python (+0.3 s per load at 128k tokens, paid by every
    # data_prep worker), which the real tokenizers skip. Write it as the real ones have it.
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["added_tokens_decoder"] = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())}
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
