"""NumericVocab: policies on tokenizers trained here, space variants, wide logits, constructor errors."""

from __future__ import annotations

import math

import pytest
import torch

from numloss import NumericVocab, functional
from numloss.vocab import parse_numeric_token, squash_distances
from tests.numloss.tokenizers_fixture import (
    UNK,
    as_fast,
    byte_level_tokenizer,
    digit_ids,
    digit_tokenizer,
    llama3_tokenizer,
    no_number_tokenizer,
    sentencepiece_tokenizer,
    word_level,
)


def _pairs(vocab: NumericVocab) -> dict[int, float]:
    return dict(zip(vocab.token_ids.tolist(), vocab.values.tolist()))


def _expected(tok, predicate) -> dict[int, float]:
    """{id: value} over the tokenizer's vocabulary, with `predicate(token) -> value | None` written here."""
    out = {}
    for token, i in tok.get_vocab().items():
        v = predicate(token)
        if v is not None:
            out[i] = v
    return out


# ---- digits (Qwen-style) ------------------------------------------------------------------------------


@pytest.mark.parametrize("wrap", [False, True], ids=["tokenizers", "transformers"])
def test_digit_tokenizer_gives_exactly_the_ten_digits(wrap):
    tok = digit_tokenizer()
    # the tokenizer really is single-digit: a number is a run of digit tokens
    assert tok.encode("407").tokens == ["4", "0", "7"]
    source = as_fast(tok) if wrap else tok
    vocab = NumericVocab.from_tokenizer(source, policy="digits")
    assert vocab.size == len(vocab) == 10
    ids = digit_ids(tok)
    assert _pairs(vocab) == {ids[d]: float(d) for d in range(10)}
    assert vocab.values.dtype == torch.float64
    assert vocab.vocab_size == tok.get_vocab_size()
    assert vocab.is_digits()
    # index_of maps each digit's id to its column and everything else to -1
    for d in range(10):
        col = int(vocab.index_of[ids[d]])
        assert col >= 0 and vocab.token_ids[col] == ids[d] and vocab.values[col] == d
    assert int((vocab.index_of >= 0).sum()) == 10
    assert vocab.index_of.numel() == tok.get_vocab_size()


def test_digit_tokenizer_integers_and_float_policies_agree_on_digits():
    tok = digit_tokenizer()
    ints = NumericVocab.from_tokenizer(tok, policy="integers")
    floats = NumericVocab.from_tokenizer(tok, policy="float")
    ids = digit_ids(tok)
    assert _pairs(ints) == {ids[d]: float(d) for d in range(10)}
    # BPE may have merged digit pairs within "0123456789"; the float policy counts any decimal token
    expected = _expected(tok, lambda t: float(t) if t.isascii() and t.isdigit() else None)
    assert _pairs(floats) == expected


# ---- integers (Llama-3-style) --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_vocab():
    return NumericVocab.from_tokenizer(llama3_tokenizer(), policy="integers")


def test_llama3_style_has_exactly_1000_integer_tokens(llama_vocab):
    tok = llama3_tokenizer()
    assert tok.encode("1234567").tokens == ["123", "456", "7"]
    assert llama_vocab.size == 1000
    assert sorted(llama_vocab.values.tolist()) == [float(i) for i in range(1000)]
    vocab_map = tok.get_vocab()
    for value in (0, 7, 12, 99, 100, 407, 999):
        tid = vocab_map[str(value)]
        col = int(llama_vocab.index_of[tid])
        assert col >= 0
        assert llama_vocab.values[col] == value
    # a non-canonical token such as "07" (if BPE made one) is not an integer token
    for token, tid in vocab_map.items():
        if token.isdigit() and len(token) > 1 and token.startswith("0"):
            assert int(llama_vocab.index_of[tid]) == -1, token
    # every id in the table is one the tokenizer encodes "str(value)" to, as a single token
    for tid, value in list(_pairs(llama_vocab).items())[::37]:
        assert tok.encode(str(int(value))).ids == [tid]


def test_integers_max_value(llama_vocab):
    tok = llama3_tokenizer()
    small = NumericVocab.from_tokenizer(tok, policy="integers", max_value=99)
    assert sorted(small.values.tolist()) == [float(i) for i in range(100)]
    assert set(small.token_ids.tolist()) < set(llama_vocab.token_ids.tolist())
    # digits policy on the same tokenizer: only the ten single characters
    digits = NumericVocab.from_tokenizer(tok, policy="digits")
    assert sorted(digits.values.tolist()) == [float(d) for d in range(10)]


# ---- space variants --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "builder,marker", [(sentencepiece_tokenizer, "▁"), (byte_level_tokenizer, "Ġ")], ids=["sentencepiece", "bytelevel"]
)
def test_space_variants(builder, marker):
    tok = builder()
    vmap = tok.get_vocab()
    variants = {d: vmap[f"{marker}{d}"] for d in range(10) if f"{marker}{d}" in vmap}
    assert variants, f"the trained tokenizer should hold {marker}-prefixed digits"
    bare = digit_ids(tok)

    off = NumericVocab.from_tokenizer(tok, policy="digits", space_variants=False)
    assert _pairs(off) == {bare[d]: float(d) for d in range(10)}

    on = NumericVocab.from_tokenizer(tok, policy="digits", space_variants=True)
    expected = {bare[d]: float(d) for d in range(10)}
    expected.update({i: float(d) for d, i in variants.items()})
    assert _pairs(on) == expected
    # duplicated values are allowed: "3" and "▁3" are both 3
    assert on.size == 10 + len(variants)
    assert on.values.unique().numel() == 10


def test_byte_level_superscripts_are_not_digits():
    tok = byte_level_tokenizer()
    vmap = tok.get_vocab()
    assert "²" in vmap and "³" in vmap  # "²".isdigit() is True in Python: the policy must not use it
    for policy in ("digits", "integers", "float"):
        vocab = NumericVocab.from_tokenizer(tok, policy=policy)
        assert int(vocab.index_of[vmap["²"]]) == -1
        assert int(vocab.index_of[vmap["³"]]) == -1


def test_space_variants_with_integers_on_word_level():
    tok = word_level([UNK, "12", "Ġ12", "▁407", " 5", "ĠĠ3", "Ġ", "▁", "07", "1000"])
    off = NumericVocab.from_tokenizer(tok, policy="integers")
    assert _pairs(off) == {1: 12.0}
    on = NumericVocab.from_tokenizer(tok, policy="integers", space_variants=True)
    assert _pairs(on) == {1: 12.0, 2: 12.0, 3: 407.0, 4: 5.0}


# ---- float policy -----------------------------------------------------------------------------------------


FLOAT_TOKENS = [
    UNK, "0.5", "-3", ".5", "2", "10", "12.25", "+4", "3.", "-.5",  # numbers
    "1e5", "e5", "nan", "inf", "-inf", "1_000", "３", "٣", ".", "-", "+", "1.2.3", "0x10", "abc", "Ġ7",
]
FLOAT_EXPECTED = {1: 0.5, 2: -3.0, 3: 0.5, 4: 2.0, 5: 10.0, 6: 12.25, 7: 4.0, 8: 3.0, 9: -0.5}


@pytest.mark.parametrize("wrap", [False, True], ids=["tokenizers", "transformers"])
def test_float_policy(wrap):
    tok = word_level(FLOAT_TOKENS)
    vocab = NumericVocab.from_tokenizer(as_fast(tok) if wrap else tok, policy="float")
    assert _pairs(vocab) == FLOAT_EXPECTED
    # duplicate values (".5" and "0.5") are both kept
    assert (vocab.values == 0.5).sum() == 2
    with_space = NumericVocab.from_tokenizer(tok, policy="float", space_variants=True)
    assert _pairs(with_space) == {**FLOAT_EXPECTED, 24: 7.0}
    # integers policy on the same vocab: only canonical non-negative integers
    assert _pairs(NumericVocab.from_tokenizer(tok, policy="integers")) == {4: 2.0, 5: 10.0}



@pytest.mark.parametrize("space_variants", [False, True])
@pytest.mark.parametrize("policy", ["digits", "integers", "float"])
def test_from_tokenizer_equals_parsing_every_token(policy, space_variants):
    """from_tokenizer parses only tokens that can be numbers; the result is parse_numeric_token over the
    whole vocabulary, ids ascending; texts with a final newline are not numbers."""
    edge = ["3\n", "Ġ3\n", "12\n", "1.5\n", "7 ", " 7", "▁4", "Ġ.5", "x3", "3x", "\n", "", "5"]
    tok = word_level(FLOAT_TOKENS + edge)
    vocab = NumericVocab.from_tokenizer(tok, policy=policy, space_variants=space_variants)
    expected = _expected(tok, lambda t: parse_numeric_token(t, policy, 999, space_variants))
    assert not {tok.id_to_token(i) for i in expected} & {"3\n", "Ġ3\n", "12\n", "1.5\n"}
    assert vocab.token_ids.tolist() == sorted(expected)
    assert _pairs(vocab) == expected
    assert (vocab.index_of >= 0).sum() == len(expected)

def test_parse_numeric_token_table():
    assert parse_numeric_token("7", "digits") == 7.0
    assert parse_numeric_token("07", "digits") is None
    assert parse_numeric_token("12", "digits") is None
    assert parse_numeric_token("0", "integers") == 0.0
    assert parse_numeric_token("007", "integers") is None
    assert parse_numeric_token("1000", "integers") is None
    assert parse_numeric_token("1000", "integers", max_value=1000) == 1000.0
    assert parse_numeric_token("-1", "integers") is None
    assert parse_numeric_token("▁3", "digits") is None
    assert parse_numeric_token("▁3", "digits", space_variants=True) == 3.0
    assert parse_numeric_token(" 3", "digits", space_variants=True) == 3.0
    assert parse_numeric_token("1e5", "float") is None
    assert parse_numeric_token("nan", "float") is None
    for policy in ("digits", "integers", "float"):  # "$" once accepted these: "3 " never was
        assert parse_numeric_token("3\n", policy) is None and parse_numeric_token("3 ", policy) is None
        assert parse_numeric_token("3", policy) == 3.0
    with pytest.raises(ValueError, match="policy"):
        parse_numeric_token("3", "decimal")


# ---- logits wider than the tokenizer --------------------------------------------------------------------


def test_logits_wider_than_tokenizer():
    tok = digit_tokenizer()
    n_tok = tok.get_vocab_size()
    wide = n_tok + 37
    vocab = NumericVocab.from_tokenizer(tok, policy="digits", vocab_size=wide)
    assert vocab.vocab_size == wide and vocab.index_of.numel() == wide
    assert (vocab.index_of[n_tok:] == -1).all()
    ids = digit_ids(tok)
    # a loss on logits of the padded width: labels in the padding are valid non-numeric tokens
    logits = torch.zeros(1, 3, wide)
    logits[0, 0, ids[4]] = 50.0
    logits[0, 1, ids[9]] = 50.0
    labels = torch.tensor([[ids[4], wide - 1, ids[2]]])
    # position 0: exact; position 2: p uniform over digits -> WAS = mean |j - 2| = (2+1+0+1+...+7)/10
    was = functional.ntl_was(logits, labels, vocab)
    expected = (0.0 + sum(abs(j - 2) for j in range(10)) / 10) / 2
    assert math.isclose(float(was), expected, rel_tol=1e-5)
    # the default (tokenizer length) vocabulary works on the wider logits too
    narrow = NumericVocab.from_tokenizer(tok, policy="digits")
    assert math.isclose(float(functional.ntl_was(logits, labels, narrow)), expected, rel_tol=1e-5)


def test_vocab_size_too_small_for_numeric_ids():
    tok = digit_tokenizer()
    top = max(digit_ids(tok).values())
    with pytest.raises(ValueError, match=str(top)):
        NumericVocab.from_tokenizer(tok, policy="digits", vocab_size=top)


# ---- errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["digits", "integers", "float"])
def test_tokenizer_without_numbers_is_an_error_naming_tokenizer_and_policy(policy):
    with pytest.raises(ValueError) as err:
        NumericVocab.from_tokenizer(as_fast(no_number_tokenizer(), name="my-wordlevel-tok"), policy=policy)
    assert "my-wordlevel-tok" in str(err.value)
    assert policy in str(err.value)


def test_unknown_policy():
    with pytest.raises(ValueError, match="decimal"):
        NumericVocab.from_tokenizer(digit_tokenizer(), policy="decimal")


def test_constructor_errors():
    with pytest.raises(ValueError, match="at least one"):
        NumericVocab([], [])
    with pytest.raises(ValueError, match="more than once"):
        NumericVocab([1, 2, 1], [0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="not finite"):
        NumericVocab([1, 2], [0.0, float("nan")])
    with pytest.raises(ValueError, match="not finite"):
        NumericVocab([1, 2], [0.0, float("inf")])
    with pytest.raises(ValueError, match="does not fit"):
        NumericVocab([1, 5], [0.0, 1.0], vocab_size=5)
    with pytest.raises(ValueError):
        NumericVocab([1, 2], [0.0])
    with pytest.raises(ValueError, match="negative"):
        NumericVocab([-1, 2], [0.0, 1.0])


def test_constructor_basics_and_duplicate_values():
    vocab = NumericVocab([7, 3, 11], [2.0, 2.0, 0.5], vocab_size=20, name="tiny")
    assert vocab.size == 3 and vocab.vocab_size == 20
    assert vocab.index_of.tolist() == [-1, -1, -1, 1, -1, -1, -1, 0, -1, -1, -1, 2] + [-1] * 8
    assert "tiny" in repr(vocab)
    assert not vocab.is_digits()
    assert NumericVocab([4], [1.0]).vocab_size == 5
    d = vocab.distances("cpu", torch.float64)
    assert d.tolist() == [[0.0, 0.0, 1.5], [0.0, 0.0, 1.5], [1.5, 1.5, 0.0]]


def test_squash_distances():
    values = torch.tensor([0.5, 2.0, 10.0], dtype=torch.float64)
    d = (values[:, None] - values[None, :]).abs()
    s = squash_distances(d, 9.0)
    # non-zero distances 1.5, 8, 9.5 -> 1, 1 + 6.5 * 8 / 8 = 7.5, 9
    assert torch.allclose(s, torch.tensor([[0, 1, 9], [1, 0, 7.5], [9, 7.5, 0]], dtype=torch.float64))
    digits = torch.arange(10, dtype=torch.float64)
    dd = (digits[:, None] - digits[None, :]).abs()
    assert torch.equal(squash_distances(dd, 9.0), dd)  # identity for digits
    assert squash_distances(d, None) is d
    with pytest.raises(ValueError):
        squash_distances(d, 0.5)


@pytest.mark.parametrize("builder", [digit_tokenizer, llama3_tokenizer, byte_level_tokenizer, sentencepiece_tokenizer])
@pytest.mark.parametrize("wrap", [False, True], ids=["tokenizers", "transformers"])
def test_the_decimal_point_is_found_in_the_tokenizer(builder, wrap):
    tok = builder()
    point = tok.get_vocab().get(".")
    policy = "integers" if builder is llama3_tokenizer else "digits"
    vocab = NumericVocab.from_tokenizer(as_fast(tok) if wrap else tok, policy)
    assert vocab.decimal_point_id == point  # the token whose text is exactly "." (None without one)
    assert vocab.is_ten_digits() is (policy == "digits")
    spaced = NumericVocab.from_tokenizer(tok, "digits", space_variants=True)
    assert spaced.is_digits() and spaced.is_ten_digits() is (spaced.size == 10)


def test_decimal_point_id_errors():
    ids, values = list(range(3, 13)), list(range(10))
    assert NumericVocab(ids, values, decimal_point_id=40).decimal_point_id == 40  # no width given: any id
    with pytest.raises(ValueError, match="decimal_point_id 40 does not fit logits of width 20"):
        NumericVocab(ids, values, vocab_size=20, decimal_point_id=40)
    with pytest.raises(ValueError, match="decimal_point_id 5 is one of the numeric tokens"):
        NumericVocab(ids, values, decimal_point_id=5)
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="decimal_point_id must be a token id"):
            NumericVocab(ids, values, decimal_point_id=bad)
    assert NumericVocab(ids, values, decimal_point_id=torch.tensor(1)).decimal_point_id == 1
