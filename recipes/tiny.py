"""Small offline stand-ins for what a real run downloads: a tokenizer trained on the fly and a tiny
Llama config. Used by the CPU demo, the study and the tests; a real recipe names a hub model instead.
"""

from __future__ import annotations

from pathlib import Path

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
