"""Independent float64 reference implementations of the losses, written from the definitions in docs/losses.md.

Deliberately plain: explicit Python loops over sequences and positions, one position at a time, no
shared code with `numloss`. Every function takes

    logits  torch.float64 [B, S, V] (or [S, V]; any leading dims, the last label dim is the sequence)
    labels  int tensor/list with the logits' leading shape (-100 = ignored)
    ids     list of numeric token ids (column order)
    values  list of their values

and returns a 0-d float64 tensor that is differentiable in `logits` (so `torch.autograd.gradcheck` and
float64 autograd gradients of the reference are available).
"""

from __future__ import annotations

import math

import torch

IGNORE = -100


def _seqs(logits, labels):
    logits = torch.as_tensor(logits)
    labels = torch.as_tensor(labels)
    V = logits.shape[-1]
    lab = labels.reshape(-1, labels.shape[-1]) if labels.dim() else labels.reshape(1, 1)
    return logits.reshape(lab.shape[0], lab.shape[1], V), lab.tolist()


def _log_softmax(x):
    m = x.max()
    return x - (m + torch.log(torch.exp(x - m).sum()))


def _renorm_p(row, ids):
    return torch.exp(_log_softmax(row[ids]))


def _pair_distances(values, squash=None):
    """[[|v_i - v_j|]] as Python floats, optionally squashed as docs/losses.md says (non-zero -> [1, s])."""
    n = len(values)
    d = [[abs(values[i] - values[j]) for j in range(n)] for i in range(n)]
    if squash is None:
        return d
    nz = [x for r in d for x in r if x > 0]
    if not nz:
        return d
    lo, hi = min(nz), max(nz)
    out = []
    for r in d:
        row = []
        for x in r:
            if x == 0:
                row.append(0.0)
            elif hi == lo:
                row.append(1.0)
            else:
                row.append(1 + (x - lo) * (squash - 1) / (hi - lo))
        out.append(row)
    return out


def _zero(logits):
    return (torch.as_tensor(logits) * 0).sum()


def _numeric_positions(lab, ids):
    """[(b, s, column)] of positions whose label is a numeric token."""
    col = {t: c for c, t in enumerate(ids)}
    return [(b, s, col[y]) for b, seq in enumerate(lab) for s, y in enumerate(seq) if y in col]


def _after_in_run(seq, ids):
    """For each position: the number of numeric labels after it in its maximal run (None if not numeric)."""
    is_num = [y in set(ids) for y in seq]
    out = [None] * len(seq)
    count = 0
    for s in range(len(seq) - 1, -1, -1):
        if is_num[s]:
            out[s] = count
            count += 1
        else:
            count = 0
    return out


def _runs(seq, ids):
    """Maximal runs of consecutive numeric labels: list of lists of positions."""
    idset = set(ids)
    runs, cur = [], []
    for s, y in enumerate(seq):
        if y in idset:
            cur.append(s)
        else:
            if cur:
                runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


# ---- CE ---------------------------------------------------------------------------------------------------


def ce(logits, labels, z_loss=0.0):
    x, lab = _seqs(logits, labels)
    total, n = _zero(x), 0
    for b, seq in enumerate(lab):
        for s, y in enumerate(seq):
            if y == IGNORE:
                continue
            row = x[b, s]
            lse = torch.logsumexp(row, 0)
            total = total + (lse - row[y]) + z_loss * lse**2
            n += 1
    return total / max(n, 1)


# ---- NTL ------------------------------------------------------------------------------------------------


def _numeric_mass(row, ids):
    return torch.exp(row[ids]).sum() / torch.exp(row).sum()


def ntl_was(logits, labels, ids, values, squash_factor=None, reweigh=False, position_weights=None):
    x, lab = _seqs(logits, labels)
    D = _pair_distances(values, squash_factor)
    max_d = max(max(r) for r in D)
    pw = None if position_weights is None else torch.as_tensor(position_weights, dtype=torch.float64).reshape(len(lab), -1)
    total, m = _zero(x), 0
    for b, s, c in _numeric_positions(lab, ids):
        p = _renorm_p(x[b, s], ids)
        loss = sum(p[j] * D[c][j] for j in range(len(ids)))
        if reweigh:
            mass = _numeric_mass(x[b, s], ids)
            loss = loss * mass + 1.01 * max_d * (1 - mass)
        w = 1.0 if pw is None else float(pw[b, s])
        total = total + w * loss
        m += w  # the ntloss package's reduction: sum(w * l) / sum(w)
    return total / (m if m > 0 else 1)


def _regress(e, kind):
    if kind == "mse":
        return e**2
    if kind == "mae":
        return abs(e)
    if kind == "huber":
        return 0.5 * e**2 if abs(float(e)) <= 1.0 else abs(e) - 0.5
    raise ValueError(kind)


def ntl_mse(logits, labels, ids, values, loss="mse", reweigh=False, position_weights=None):
    x, lab = _seqs(logits, labels)
    span = max(values) - min(values)
    pw = None if position_weights is None else torch.as_tensor(position_weights, dtype=torch.float64).reshape(len(lab), -1)
    total, m = _zero(x), 0
    for b, s, c in _numeric_positions(lab, ids):
        p = _renorm_p(x[b, s], ids)
        expected = sum(p[j] * values[j] for j in range(len(ids)))
        l = _regress(expected - values[c], loss)
        if reweigh:
            mass = _numeric_mass(x[b, s], ids)
            l = l * mass + 1.01 * _regress(torch.tensor(float(span), dtype=torch.float64), loss) * (1 - mass)
        w = 1.0 if pw is None else float(pw[b, s])
        total = total + w * l
        m += w
    return total / (m if m > 0 else 1)


# ---- GCE ------------------------------------------------------------------------------------------------


def gce(logits, labels, ids, values, sigma=1.0, renormalize=False):
    x, lab = _seqs(logits, labels)
    col = {t: c for c, t in enumerate(ids)}
    total, n = _zero(x), 0
    for b, seq in enumerate(lab):
        for s, y in enumerate(seq):
            if y == IGNORE:
                continue
            n += 1
            row = x[b, s]
            full = _log_softmax(row)
            if y not in col:
                total = total - full[y]
                continue
            logp = _log_softmax(row[ids]) if renormalize else full[ids]
            c = col[y]
            if sigma == 0:
                total = total - logp[c]
                continue
            w = [math.exp(-(((values[j] - values[c]) / sigma) ** 2) / 2) for j in range(len(ids))]
            z = sum(w)
            total = total - sum((w[j] / z) * logp[j] for j in range(len(ids)))
    return total / max(n, 1)


# ---- DIST2 ----------------------------------------------------------------------------------------------


def dist2(logits, labels, ids, values, tau=1.0, normalize="full", weighting="none"):
    x, lab = _seqs(logits, labels)
    total, m = _zero(x), 0
    for b, seq in enumerate(lab):
        after = _after_in_run(seq, ids)
        for b2, s, c in _numeric_positions([seq], ids):
            row = x[b, s]
            logq = _log_softmax(row)[ids] if normalize == "full" else _log_softmax(row[ids])
            e = [-((values[j] - values[c]) ** 2) / tau for j in range(len(ids))]
            mx = max(e)
            z = sum(math.exp(t - mx) for t in e)
            pd = [math.exp(t - mx) / z for t in e]
            kl = sum(pd[j] * (math.log(pd[j]) - logq[j]) for j in range(len(ids)) if pd[j] > 0)
            w = 1 + after[s] if weighting == "place_value" else 1
            total = total + w * kl
            m += w  # the released code's reduction: sum(w * KL) / sum(w)
    return total / max(m, 1)


# ---- the soft-target control -----------------------------------------------------------------------------


def numeric_smoothing(logits, labels, ids, values, normalize="full", weighting="none"):
    """KL(uniform over the numeric tokens || model) at each numeric position, written out term by term."""
    x, lab = _seqs(logits, labels)
    total, m = _zero(x), 0
    n = len(ids)
    for b, seq in enumerate(lab):
        after = _after_in_run(seq, ids)
        for _, s, _ in _numeric_positions([seq], ids):
            row = x[b, s]
            logq = _log_softmax(row)[ids] if normalize == "full" else _log_softmax(row[ids])
            kl = sum((1.0 / n) * (math.log(1.0 / n) - logq[j]) for j in range(n))
            w = 1 + after[s] if weighting == "place_value" else 1
            total = total + w * kl
            m += w
    return total / max(m, 1)


# ---- NTIL -----------------------------------------------------------------------------------------------


def ntil(logits, labels, ids, values, digit_exp=1.2, digit_alpha=1.0, abs_alpha=0.2, mag_alpha=0.2, tau=0.1,
         gumbel=None):
    """NTIL with the straight-through digit sample; `gumbel` None = noise 0 (deterministic).

    `gumbel(b, s)` may return a [N] noise vector (already scaled) to add to the log-probabilities.
    The forward value of the sampled digit is the argmax's value; its gradient is the soft sample's.
    Mean over the sequences that have at least one valid label (see the NTIL mixing rule).
    """
    x, lab = _seqs(logits, labels)
    vals = torch.tensor(values, dtype=torch.float64)
    per_seq = []
    for b, seq in enumerate(lab):
        if all(y == IGNORE for y in seq):
            continue
        runs = _runs(seq, ids)
        if not runs:
            per_seq.append(_zero(x))
            continue
        col = {t: c for c, t in enumerate(ids)}
        token_losses, rels, mags = [], [], []
        for run in runs:
            n = len(run)
            xhat, xt = _zero(x), 0.0
            for i, s in enumerate(run):
                k = n - 1 - i
                c = col[seq[s]]
                p = _renorm_p(x[b, s], ids)
                emd = sum(p[j] * abs(values[j] - values[c]) for j in range(len(ids)))
                token_losses.append(digit_exp**k * emd)
                scores = _log_softmax(x[b, s][ids])
                if gumbel is not None:
                    scores = scores + gumbel(b, s)
                soft = torch.exp(_log_softmax(scores / tau))
                hard = torch.zeros_like(soft)
                hard[int(torch.argmax(soft))] = 1.0
                st = hard - soft.detach() + soft
                xhat = xhat + (st * vals).sum() * 10.0**k
                xt += values[c] * 10.0**k
            hi = torch.maximum(xhat, torch.tensor(xt, dtype=torch.float64))
            lo = torch.minimum(xhat, torch.tensor(xt, dtype=torch.float64))
            rels.append((xhat - xt).abs() / (hi + 1))
            mags.append(torch.log((hi + 1) / (lo + 1)))
        per_seq.append(
            digit_alpha * sum(token_losses) / len(token_losses)
            + abs_alpha * sum(rels) / len(rels)
            + mag_alpha * sum(mags) / len(mags)
        )
    if not per_seq:
        return _zero(x)
    return sum(per_seq) / len(per_seq)


# ---- SMMD -----------------------------------------------------------------------------------------------


def smmd_kernel(values, sigmas=(2.0,), squash_factor=9.0, kernel="gaussian"):
    D = _pair_distances(values, squash_factor)
    n = len(values)
    K = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if kernel == "gaussian":
                K[i][j] = sum(math.exp(-D[i][j] ** 2 / (2 * s * s)) for s in sigmas) / len(sigmas)
            else:
                K[i][j] = sum(math.exp(-D[i][j] / s) for s in sigmas) / len(sigmas)
    return torch.tensor(K, dtype=torch.float64)


def smmd(logits, labels, ids, values, sigmas=(2.0,), squash_factor=9.0, kernel="gaussian", alpha=None, mode="smmd"):
    x, lab = _seqs(logits, labels)
    K = smmd_kernel(values, sigmas, squash_factor, kernel)
    deg = K.sum(1)
    if alpha is None:
        alpha = 1.0 / (2.0 * float(deg.mean()))
    L = torch.diag(deg) - K
    total, m = _zero(x), 0
    for b, s, c in _numeric_positions(lab, ids):
        p = _renorm_p(x[b, s], ids)
        q = torch.zeros(len(ids), dtype=torch.float64)
        q[c] = 1.0
        r = p - q
        l_mmd = r @ K @ r
        l_smooth = r @ L @ r
        per = {"mmd": l_mmd, "smooth": alpha * l_smooth, "smmd": l_mmd + alpha * l_smooth}[mode]
        total = total + torch.relu(per)
        m += 1
    return total / max(m, 1)


def digit_places(seq, digit_ids, point_id=None):
    """DEL's place weight of every position of one sequence (None where the label is not a digit), from
    the definition: a number is a maximal run of digit and decimal-point labels; an integer digit k places
    left of the run's first decimal point (or of the run's end; units k = 1) weighs 2k; the digit d places
    after the first decimal point weighs 1.02^-(d+1); a run starting with the point counts as an integer."""
    member = [label in digit_ids or (point_id is not None and label == point_id) for label in seq]
    weights = [None] * len(seq)
    start = 0
    while start < len(seq):
        if not member[start]:
            start += 1
            continue
        end = start
        while end < len(seq) and member[end]:
            end += 1
        points = [t for t in range(start, end) if seq[t] == point_id]
        point = points[0] if points and points[0] != start else None
        for t in range(start, end):
            if seq[t] not in digit_ids:
                continue
            if point is None or t < point:
                weights[t] = 2.0 * ((end if point is None else point) - t)
            else:
                weights[t] = 1.02 ** -((t - point) + 1)
        start = end
    return weights


def digit_entropy(logits, labels, digit_ids, point_id=None):
    """DEL: at each digit position, w · Σ_j BCE(l_j, 1[j = y]) · softmax(l)_j over the ten digit logits
    l (`digit_ids[d]` is the token of digit d), w from `digit_places`; the sum over digit positions
    divided by 10 x their count (0 without any)."""
    x, lab = _seqs(logits, labels)
    total, count = _zero(x), 0
    for b, seq in enumerate(lab):
        places = digit_places(seq, digit_ids, point_id)
        for s, label in enumerate(seq):
            if places[s] is None:
                continue
            l = x[b, s][list(digit_ids)]
            p = torch.exp(_log_softmax(l))
            y = list(digit_ids).index(label)
            position = _zero(x)
            for j in range(10):
                # BCE with logits: -log σ(l) for the target, -log(1 - σ(l)) = -log σ(-l) for the others
                bce = -torch.nn.functional.logsigmoid(l[j] if j == y else -l[j])
                position = position + bce * p[j]
            total = total + places[s] * position
            count += 1
    return total / (10 * count) if count else total
