"""recipes.experiments.backbone: a tiny GGUF file written by the `gguf` package itself (a 2-layer llama with
4-bit and 8-bit tensors and a byte-level BPE tokenizer in its metadata) is converted to a Hugging Face
directory; the directory must give the same logits and token ids as transformers' own GGUF load, and
the getter must check the checksum and convert only once."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from recipes.experiments import backbone as B

gguf = pytest.importorskip("gguf")

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 32, 64, 4, 2, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what a byte-level BPE vocabulary holds)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_tiny_gguf(path, seed: int = 0) -> int:
    """A tiny llama GGUF (llama.cpp's layout and names) with Q4_1 / Q8_0 / F32 tensors; returns V."""
    rng = np.random.default_rng(seed)
    tokens = SPECIALS + _byte_chars() + ["Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (vocab - len(SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT)

    def tensor(name, shape, qtype=None):
        data = rng.normal(0, 0.2, size=shape).astype(np.float32)
        if qtype is None:
            w.add_tensor(name, data)
        else:  # quantised as llama.cpp writes it: the raw blocks (the writer derives the shape)
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", (vocab, HIDDEN), gguf.GGMLQuantizationType.Q8_0)  # tied: no output.weight
    tensor("output_norm.weight", (HIDDEN,))
    head = HIDDEN // HEADS
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", (HIDDEN,))
        tensor(f"blk.{i}.ffn_norm.weight", (HIDDEN,))
        tensor(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN), gguf.GGMLQuantizationType.Q4_1)
        tensor(f"blk.{i}.attn_k.weight", (KV_HEADS * head, HIDDEN), gguf.GGMLQuantizationType.Q4_1)
        tensor(f"blk.{i}.attn_v.weight", (KV_HEADS * head, HIDDEN), gguf.GGMLQuantizationType.Q4_1)
        tensor(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN), gguf.GGMLQuantizationType.Q4_1)
        tensor(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), gguf.GGMLQuantizationType.Q4_1)
        tensor(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), gguf.GGMLQuantizationType.Q4_1)
        tensor(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), gguf.GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return vocab


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf"
    vocab = write_tiny_gguf(path)
    return path, vocab


def test_converted_directory_matches_transformers_gguf_load(tiny_gguf, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, vocab = tiny_gguf
    out = B.convert_gguf(path, tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", B.MARKER} <= {p.name for p in out.iterdir()}
    assert not list(tmp_path.glob("hf.tmp-*"))  # the temporary directory was renamed into place

    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert config["vocab_size"] == vocab and config["num_hidden_layers"] == LAYERS

    text = "the 12 + 7 = 19, then the end"
    ids = tok(text)["input_ids"]
    assert ids == ref_tok(text)["input_ids"] and tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok(" the")["input_ids"]) == ["Ġthe"]  # the merges came across
    messages = [{"role": "user", "content": "What is 2+3?"}]
    assert (tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert (tok.eos_token, tok.bos_token) == ("<|im_end|>", "<|im_start|>")

    # the dequantised weights are not the writer's fp32 draws, yet both loads must agree exactly
    torch.manual_seed(0)
    batch = torch.randint(0, vocab, (3, 11))
    with torch.no_grad():
        expected, got = reference(input_ids=batch).logits, model(input_ids=batch).logits
    assert expected.abs().max() > 0.1
    assert torch.equal(got, expected)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)  # tied, as in the file
    record = json.loads((out / B.MARKER).read_text())
    assert record["sha256"] == B.sha256_file(path)


def test_get_backbone_checks_the_checksum_and_converts_once(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    package = tmp_path / "site" / "tinypkg"  # an "installed package" holding the file
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / path.name).write_bytes(path.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    sys.modules.pop("tinypkg", None)
    spec = B.PackagedGGUF(name="tiny", requirement="tinypkg==0.0.1", module="tinypkg", file=path.name,
                          sha256=B.sha256_file(path))
    monkeypatch.setitem(B.BACKBONES, "tiny", spec)
    out = tmp_path / "models" / "tiny"

    assert B.get_backbone("tiny", out, cache=tmp_path / "cache") == out
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(B, "convert_gguf", lambda *a, **k: pytest.fail("converted a second time"))
    assert B.get_backbone("tiny", out, cache=tmp_path / "cache") == out  # the second call reuses it
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp

    wrong = B.PackagedGGUF(**{**spec.__dict__, "sha256": "0" * 64})
    monkeypatch.setitem(B.BACKBONES, "tiny", wrong)
    with pytest.raises(ValueError, match="differs from the pinned"):
        B.get_backbone("tiny", tmp_path / "models" / "other", cache=tmp_path / "cache")
    assert not (tmp_path / "models" / "other").exists()
    with pytest.raises(ValueError, match="known ones"):
        B.get_backbone("nope")


def test_missing_package_without_install_is_a_clear_error(tmp_path):
    spec = B.PackagedGGUF(name="x", requirement="no-such-pkg==1.0", module="no_such_pkg_numloss",
                          file="x.gguf", sha256="0" * 64)
    with pytest.raises(FileNotFoundError, match="no_such_pkg_numloss"):
        B.locate_gguf(spec, cache=tmp_path, install=False)
