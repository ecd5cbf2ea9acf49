"""The training data's tokens against the recipe and the model, from the manifest's per-shard statistics
(`data_prep.stats`, written by the build): a few numbers per shard, so the checks cost nothing at 1 TB.
Each error names the key and the shard, row (and record, position) where the data breaks it:

- every row's per-token columns (input_ids, labels, numeric_mask; packed: position_ids, segment_ids)
  and num_tokens of one length (else a bare shape error in the model);
- `data.seq_len`, when given, at least the longest row (else the reader fails at that row's batch);
- the positions a row uses (its length; packed: its longest example) and `data.seq_len` within the
  model's (`recipes.checks.model_checks.context_limit`; else a learned position table indexes out of
  range, or RoPE runs past what the model was trained or scaled for, silently);
- token ids and labels (other than -100) in [0, vocab_size) of the model (else an index error at the
  first forward that meets them);
- at least one scored label (a label other than -100 at a row's position >= 1: the loss shifts by
  one): data with none trains nothing (the gradient is exactly 0 at every step).

Manifests from before the statistics: `ensure_statistics` scans the shards' token columns once here
(up to `SCAN_LIMIT_BYTES` of shards, with a line per shard), and refuses larger data with the command
that writes the statistics into its manifest once (`python -m data_prep stats DIR`).
"""

from __future__ import annotations

from typing import Callable

from data_prep.stats import ensure_stats, missing_stats

# an old manifest's shards are scanned at start-up up to this size (every rank reads them: about a minute
# at a few hundred MB/s); above it the run is refused with the command that records the statistics once
SCAN_LIMIT_BYTES = 2 << 30


def ensure_statistics(manifest: dict, where: str, key: str = "data.train",
                      say: Callable[[str], None] | None = None) -> tuple[list[str], list[str]]:
    """(errors, warnings): fill in the statistics an old manifest lacks (in memory) by scanning its shards,
    or refuse when they are larger than SCAN_LIMIT_BYTES."""
    missing = missing_stats(manifest)
    if not missing:
        return [], []
    size = sum(int(s.get("bytes") or 0) for s in missing)
    command = f"python -m data_prep stats {where}"
    if size > SCAN_LIMIT_BYTES:
        return [f"{key}: {where}'s manifest has no per-shard token statistics for {len(missing)} shards "
                f"({size / 2**30:.1f} GiB; built before data_prep recorded them), too many to scan at every start: "
                f"run `{command}` once (one pass; it writes them into the manifest), or rebuild the data"], []
    ensure_stats(where, manifest, say)
    return [], [f"{key}: {where}'s manifest has no per-shard token statistics (an older build): scanned its "
                f"{len(missing)} shards here ({size / 2**20:.1f} MiB); `{command}` records them once"]


def _at(where: str, shard: dict, item: dict) -> str:
    """`DIR/shard-00001.parquet row 17 (record 52), position 3` for a statistic's place."""
    text = f"{where}/{shard['file']} row {item['row']}"
    if "record" in item:
        text += f" (record {item['record']})"
    if "position" in item:
        text += f", position {item['position']}"
    return text


def _extreme(shards: list[dict], name: str, largest: bool) -> tuple[dict, dict] | None:
    """(shard, its statistic) with the largest (smallest) value of `name` over the shards."""
    found = [(s, s["stats"][name]) for s in shards if s.get("stats") and s["stats"].get(name)]
    if not found:
        return None
    return (max if largest else min)(found, key=lambda pair: pair[1]["value"])


def token_problems(recipe, manifest: dict, where: str, *, vocab_size: int | None, positions: int | None,
                   positions_how: str = "", key: str = "data.train") -> list[str]:
    """Errors of the module docstring for the data at `where` (its manifest, with statistics), the model's
    `vocab_size` and position limit `positions` (None: not checked)."""
    shards = [s for s in manifest.get("shards", []) if s.get("stats")]
    errors: list[str] = []
    for shard in shards:
        bad = shard["stats"].get("length_mismatch")
        if bad:
            lengths = ", ".join(f"{k} {v}" for k, v in bad["lengths"].items())
            errors.append(f"{key}: {_at(where, shard, bad)}: its per-token columns differ in length ({lengths}); "
                          "the shard was not written by data_prep build, or was changed since: rebuild it")
    if errors:
        return errors  # the other statistics of such a shard are not computed
    seq_len = recipe.data.seq_len
    longest = _extreme(shards, "tokens_max", True)
    if seq_len is not None and longest and longest[1]["value"] > seq_len:
        n = longest[1]["value"]
        errors.append(f"data.seq_len: {seq_len} is shorter than the longest row of {where}, {n} tokens at "
                      f"{_at(where, *longest)}: set data.seq_len >= {n} (or null: each batch pads to its longest "
                      f"row), or rebuild the data with --max-length {seq_len}")
    if positions is not None:
        most = _extreme(shards, "positions_max", True)
        if most and most[1]["value"] > positions:
            errors.append(f"{key}: {where} has rows that use {most[1]['value']} positions ({_at(where, *most)}), more "
                          f"than the model's {positions} ({positions_how}): rebuild the data with --max-length "
                          f"{positions}, or use a model (or RoPE scaling in its config) for longer rows")
        if seq_len is not None and seq_len > positions:
            errors.append(f"data.seq_len: {seq_len} is more than the model's {positions} positions ({positions_how})")
    if vocab_size is not None:
        for name, what in (("input_id", "token id"), ("label", "label")):
            high, low = _extreme(shards, f"{name}_max", True), _extreme(shards, f"{name}_min", False)
            if high and high[1]["value"] >= vocab_size:
                errors.append(f"{key}: {what} {high[1]['value']} at {_at(where, *high)} is outside the model's "
                              f"vocabulary [0, {vocab_size}): the data was built with another tokenizer, or the model "
                              f"config's vocab_size is too small")
            if low and low[1]["value"] < 0:
                errors.append(f"{key}: {what} {low[1]['value']} at {_at(where, *low)} is negative (the only negative "
                              f"label is -100, ignored): the shard was not written by data_prep build")
    if shards and sum(s["stats"]["scored_labels"] for s in shards) == 0:
        errors.append(f"{key}: no row of {where} has a scored label (every label is -100, or only a row's first, "
                      f"which is never predicted): the loss would be 0 and nothing would train; check the "
                      f"build's template and answer masking (python -m data_prep inspect {where})")
    return errors
