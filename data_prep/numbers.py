"""Numbers in text: where each one is and its value, the number spans of a shard row.

A number is digits with optional thousands separators and decimals, and a leading "-" that is a
sign, not a binary minus. `number_spans` is the definition (one regex); `find_numbers` gives the
same matches with numpy over the text's code points, without Python work per number, which is
what the encoder runs on a chunk's targets joined together.
"""

from __future__ import annotations

import re

import numpy as np

# Numbers in target text. A "-" counts as a sign only at the start or after a space/bracket/operator,
# so "5-3" is 5 and 3, while "-3" and "= -3" are -3.
# Same matches as r"(?:(?<![\w)\].])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?", written to start with a
# character class so the regex engine can skip quickly to candidates (about 25% faster on long texts).
NUMBER_RE = re.compile(
    r"[-\d](?:(?<=-)(?<![\w)\].]-)(?:\d{1,3}(?:,\d{3})+|\d+)|(?<=\d)(?:\d{0,2}(?:,\d{3})+|\d*))(?:\.\d+)?"
)


def number_spans(text: str) -> list[tuple[int, int, float]]:
    """(char start, char end, value) of every number in `text`."""
    return [(m.start(), m.end(), float(m.group().replace(",", ""))) for m in NUMBER_RE.finditer(text)]


# find_numbers: NUMBER_RE's matches computed with numpy over the code points of a text. A match is a
# run of digits (a "head", with the "-" before it when that is a sign), then either ",ddd" groups (only
# after a head of at most 3 digits) or nothing, then optionally "." and a run of digits. So every run
# of digits is a head, a group (its first 3 digits continue the number before it; a longer run starts
# a new number after them) or decimals, decided by the run before it and the one character between.
_HEAD, _GROUP, _DEC = 0, 1, 2
_SIGN_BLOCKERS = np.zeros(128, dtype=bool)  # characters before "-" that make it a minus, not a sign
_SIGN_BLOCKERS[[ord(c) for c in "0123456789_)]." + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]] = True
_POW10_INT = 10 ** np.arange(19, dtype=np.int64)
_POW10_FLOAT = 10.0 ** np.arange(23)
_EXACT_DIGITS = 15  # numbers of at most 15 digits are exact int64 -> float64 and N / 10**f is float(text)


def _numbers_regex(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    spans = number_spans(text)
    return (np.fromiter((a for a, _, _ in spans), dtype=np.int64, count=len(spans)),
            np.fromiter((b for _, b, _ in spans), dtype=np.int64, count=len(spans)),
            np.fromiter((v for *_, v in spans), dtype=np.float64, count=len(spans)))


def find_numbers(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(char starts, char ends, values) of every number in `text`: exactly `number_spans(text)`
    (NUMBER_RE's matches, values float(text without commas)), without Python work per number.
    Texts with non-ASCII decimal digits go through the regex."""
    try:
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    except UnicodeEncodeError:  # lone surrogates
        return _numbers_regex(text)
    digit = (cps - 48) < 10  # wraps around below "0"
    word = None  # non-ASCII \w characters
    if not text.isascii():
        uniq = np.unique(cps[cps >= 128])
        chars = [chr(c) for c in uniq.tolist()]
        if any(c.isdecimal() for c in chars):  # \d matches them: leave those texts to the regex
            return _numbers_regex(text)
        word = uniq[np.fromiter((c.isalnum() for c in chars), dtype=bool, count=len(chars))]
    edges = np.flatnonzero(np.diff(digit.astype(np.int8), prepend=np.int8(0), append=np.int8(0)))
    rs, re_ = edges[0::2], edges[1::2]  # runs of digits [rs, re)
    k = len(rs)
    if k == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    n = re_ - rs
    # The one character between run i-1 and run i, when there is exactly one.
    sep = np.zeros(k, dtype=np.uint32)
    adjacent = np.zeros(k, dtype=bool)
    adjacent[1:] = rs[1:] - re_[:-1] == 1
    sep[adjacent] = cps[rs[adjacent] - 1]
    comma, dot = sep == 44, sep == 46
    group_ok = comma & (n >= 3)
    n_prev = np.zeros(k, dtype=np.int64)
    n_prev[1:] = n[:-1]

    def after_head(head_len):  # what run i is when run i-1 ends a head of `head_len` digits
        return np.where((head_len <= 3) & group_ok, _GROUP, np.where(dot, _DEC, _HEAD))

    # step[i, m]: the kind of run i when run i-1 is of kind m.
    step = np.empty((k, 3), dtype=np.int8)
    step[:, _HEAD] = after_head(n_prev)
    step[:, _GROUP] = np.where(n_prev == 3, np.where(group_ok, _GROUP, np.where(dot, _DEC, _HEAD)),
                               after_head(n_prev - 3))  # a longer group run left a head of n - 3
    step[:, _DEC] = _HEAD
    step[0] = _HEAD
    kind = np.zeros(k, dtype=np.int8)
    rows = np.arange(k)
    while True:  # as many rounds as the longest chain of runs joined by "," or "."
        prev = np.empty(k, dtype=np.int8)
        prev[0] = _HEAD
        prev[1:] = kind[:-1]
        new = step[rows, prev]
        if np.array_equal(new, kind):
            break
        kind = new
    opens = (kind == _HEAD) | ((kind == _GROUP) & (n > 3))
    first = np.flatnonzero(opens)  # the run each number starts in
    m = len(first)
    in_group = kind[first] == _GROUP
    starts = rs[first] + 3 * in_group
    nxt = np.empty(m, dtype=np.int64)
    nxt[:-1] = first[1:]
    nxt[-1] = k
    ends = re_[nxt - 1]
    cut = np.zeros(m, dtype=bool)  # the next number starts inside this one's last run
    cut[:-1] = kind[first[1:]] == _GROUP
    ends[cut] = rs[nxt[cut]] + 3
    # A "-" right before a head is a sign unless the character before it is in [\w)\].].
    cand = ~in_group & (starts >= 1)
    minus = np.zeros(m, dtype=bool)
    minus[cand] = cps[starts[cand] - 1] == 45
    check = minus & (starts >= 2)
    before = cps[starts[check] - 2]
    blocked = np.zeros(m, dtype=bool)
    if word is None:
        blocked[check] = _SIGN_BLOCKERS[before]
    else:
        low = before < 128
        blocked_before = np.isin(before, word)
        blocked_before[low] = _SIGN_BLOCKERS[before[low]]
        blocked[check] = blocked_before
    signed = minus & ~blocked
    # Values: N = the number's digits as an integer, f = its decimals; N / 10**f is float(text) exactly
    # while N < 2**53 and 10**f is exact (at most 15 digits). Longer numbers are parsed from the text.
    digits = (cps[digit] - 48).astype(np.int64)
    count = np.cumsum(digit, dtype=np.int64)  # digits up to and including each position
    g1 = count[ends - 1]  # starts and ends - 1 are digits: the number's digits are [g0, g1)
    g0 = count[starts] - 1
    nd = g1 - g0
    if int(nd.sum()) != len(digits) or (nd < 1).any():  # cannot happen: every digit is in one number
        return _numbers_regex(text)
    rank = np.minimum(np.repeat(g1 - 1, nd) - np.arange(len(digits)), 18)  # power of ten of each digit
    whole = np.add.reduceat(digits * _POW10_INT[rank], g0)
    frac = np.zeros(m, dtype=np.int64)
    dec = kind == _DEC
    frac[(np.cumsum(opens) - 1)[dec]] = n[dec]
    values = whole / _POW10_FLOAT[np.minimum(frac, 22)]
    values[signed] = -values[signed]
    starts = starts - signed
    for i in np.flatnonzero(nd > _EXACT_DIGITS).tolist():
        values[i] = float(text[starts[i]:ends[i]].replace(",", ""))
    return starts, ends, values
