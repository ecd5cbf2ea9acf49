"""Label masks, numeric masks and number spans, token by token, on tokenizers trained in the tests."""

import re

import pytest
from tests.data_prep.helpers import GSM8K_ROWS, write_jsonl
from transformers import AutoTokenizer

from data_prep.numbers import number_spans
from data_prep.sources import SourceConfig, make_source
from data_prep.tokenize import Encoder, Item, TokenizeConfig

TOKENIZERS = ["digits-plain", "digits-chat", "llama3-plain", "llama3-chat"]


def items_of(cfgs):
    out = []
    for cfg in cfgs:
        src = make_source(cfg)
        for ref, raw in src.iter_raw():
            out.append(Item(len(out), f"{src.kind}/{ref}", src.to_example(raw, ref)))
    return out


@pytest.fixture(scope="module")
def items(tmp_path_factory):
    path = write_jsonl(str(tmp_path_factory.mktemp("gsm") / "g.jsonl"), GSM8K_ROWS)
    return items_of([SourceConfig("gsm8k", path=path),
                     SourceConfig("arithmetic", options={"n": 24, "max_digits": 4, "decimals": 1}),
                     SourceConfig("clock_text", options={"n": 4})])


def policy_for(name):
    return "digits" if name.startswith("digits") else "integers"


def is_numeric_token(token: str, policy: str) -> bool:
    """Independent restatement of docs/losses.md's vocabulary policies for these tokenizers' bare tokens."""
    if policy == "digits":
        return len(token) == 1 and token in "0123456789"
    return re.fullmatch(r"0|[1-9][0-9]*", token) is not None and int(token) <= 999


@pytest.mark.parametrize("name", TOKENIZERS)
def test_masks_token_by_token(tokenizers_dir, items, name):
    path = tokenizers_dir[name]
    policy = policy_for(name)
    enc = Encoder(TokenizeConfig(path, numeric_policy=policy, max_length=4096))
    batch, rejects = enc.encode(items)
    assert rejects == [] and batch.num_rows == len(items)
    tok = AutoTokenizer.from_pretrained(path)
    chat = name.endswith("chat")
    n_numeric_total = 0
    for it, row in zip(items, batch.to_pylist()):
        ex = it.example
        ids, labels, numeric = row["input_ids"], row["labels"], row["numeric_mask"]
        assert len(ids) == len(labels) == len(numeric) == row["num_tokens"]
        # Expected ids from the HF tokenizer call (not the backend batch path the encoder uses).
        if chat:
            msgs = [{"role": "user", "content": ex.prompt}]
            prefix = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": ex.target}], tokenize=False)
            assert full.startswith(prefix)
            want_prefix = tok(prefix, add_special_tokens=False)["input_ids"]
            want_rest = tok(full[len(prefix):], add_special_tokens=False)["input_ids"]
            assert tok.decode(want_rest) == ex.target + "<|im_end|>\n"
        else:
            want_prefix = [tok.bos_token_id] + tok(ex.prompt + "\n", add_special_tokens=False)["input_ids"]
            want_rest = tok(ex.target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ids == want_prefix + want_rest
        assert row["num_prompt_tokens"] == len(want_prefix)
        for i, (t, lab, num) in enumerate(zip(ids, labels, numeric)):
            in_prompt = i < len(want_prefix)
            assert lab == (-100 if in_prompt else t), (name, i)
            want_num = (not in_prompt) and is_numeric_token(tok.convert_ids_to_tokens(t), policy)
            assert num == want_num, (name, i, tok.convert_ids_to_tokens(t))
            n_numeric_total += want_num
        # The masked part decodes to the prompt, the labelled part to the target (+ end marker).
        labelled = [t for t, lab in zip(ids, labels) if lab != -100]
        decoded = tok.decode(labelled)
        assert decoded == (ex.target + "<|im_end|>\n" if chat else ex.target + "</s>")
        # Spans: each covers exactly the tokens of one number of the target, in order.
        texts = [ex.target[s:e] for s, e, _ in number_spans(ex.target)]
        assert len(row["span_start"]) == len(texts)
        for s, e, v, text in zip(row["span_start"], row["span_end"], row["span_value"], texts):
            assert s >= row["num_prompt_tokens"] and e <= len(ids) and s < e
            assert tok.decode(ids[s:e]) == text
            assert v == float(text.replace(",", ""))
            assert all(lab != -100 for lab in labels[s:e])
        assert row["answer"] == ex.answer and row["answer_text"] == ex.answer_text
    assert n_numeric_total > 50


def test_number_spans_values():
    assert [v for *_, v in number_spans("1,250 + 350 = 1,600\n#### 1,600")] == [1250, 350, 1600, 1600]
    assert [v for *_, v in number_spans("5 - 8 = -3\n#### -3")] == [5, 8, -3, -3]
    assert [v for *_, v in number_spans("5-3 is 2, x2 and 0.25.")] == [5, 3, 2, 2, 0.25]
    assert [v for *_, v in number_spans("3:05")] == [3, 5]


def test_gsm8k_spans_on_llama_tokenizer(tokenizers_dir, items):
    """Multi-digit tokens: a span holds every token of the number, and 1,600 keeps its value."""
    path = tokenizers_dir["llama3-plain"]
    enc = Encoder(TokenizeConfig(path, numeric_policy="integers"))
    batch, _ = enc.encode(items[:4])
    row = batch.to_pylist()[1]
    assert row["span_value"] == [1250.0, 350.0, 1600.0, 1600.0]
    tok = AutoTokenizer.from_pretrained(path)
    multi = [t for t in row["input_ids"] if re.fullmatch(r"\d{2,3}", tok.convert_ids_to_tokens(t))]
    assert multi, "the Llama-style tokenizer should merge some digit groups"
    assert [tok.decode(row["input_ids"][s:e]) for s, e in zip(row["span_start"], row["span_end"])] == \
        ["1,250", "350", "1,600", "1,600"]


def test_too_long_is_rejected_not_truncated(digits_tok, items):
    enc = Encoder(TokenizeConfig(digits_tok, max_length=40))
    batch, rejects = enc.encode(items)
    lengths = Encoder(TokenizeConfig(digits_tok)).encode(items)[0].column("num_tokens").to_pylist()
    assert batch.num_rows == sum(n <= 40 for n in lengths) and batch.num_rows > 0
    assert [r["record"] for r in rejects] == [i for i, n in enumerate(lengths) if n > 40]
    assert all(r["reason"] == "too_long" and f"{lengths[r['record']]} tokens" in r["detail"] for r in rejects)


def test_chat_fast_path_matches_rendering(tokenizers_dir, items):
    path = tokenizers_dir["digits-chat"]
    fast = Encoder(TokenizeConfig(path, system_prompt="You are exact."))
    slow = Encoder(TokenizeConfig(path, system_prompt="You are exact.", template_fast_path=False))
    assert fast.template.fast is not None and slow.template.fast is None
    assert fast.encode(items)[0].equals(slow.encode(items)[0])


def test_content_dependent_template_falls_back(tokenizers_dir, items, tmp_path):
    """A template that trims content cannot use the substitution fast path; results stay exact."""
    tok = AutoTokenizer.from_pretrained(tokenizers_dir["digits-chat"])
    tok.chat_template = tok.chat_template.replace("m['content']", "m['content'] | trim")
    tok.save_pretrained(tmp_path / "trim")
    enc = Encoder(TokenizeConfig(str(tmp_path / "trim")))
    assert enc.template.fast is None
    batch, _ = enc.encode(items[:3])
    for it, row in zip(items, batch.to_pylist()):
        labelled = [t for t, lab in zip(row["input_ids"], row["labels"]) if lab != -100]
        assert tok.decode(labelled) == it.example.target.strip() + "<|im_end|>\n"


def test_template_and_policy_errors(digits_tok):
    with pytest.raises(ValueError, match="no chat template"):
        Encoder(TokenizeConfig(digits_tok, template="chat"))
    with pytest.raises(ValueError, match="unknown numeric policy"):
        Encoder(TokenizeConfig(digits_tok, numeric_policy="roman"))
