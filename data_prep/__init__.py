"""data_prep: tokenized, label-masked, numeric-annotated shards from the papers' corpora and any JSONL.

    sources/   one adapter per corpus (GSM8K, SVAMP, DeepMind-Math, arithmetic and clock generators,
               ChartQA, generic JSONL/Parquet/CSV) -> Example(prompt, target, answer, image)
    tokenize   chat/plain template, label mask, numeric mask and number spans
    pack       optional packing of several examples per row
    shards     Parquet shards, rejects, progress file (resume) and manifest
    build      the streaming, multi-process pipeline
    reader     the rank-split, deterministic, resumable dataset training reads

Training reads nothing else: `python -m data_prep build ...` then `ShardDataset(dir, ...)`.
"""

from .build import BuildConfig, build
from .shards import ShardConfig, read_manifest
from .sources import SourceConfig
from .tokenize import TokenizeConfig

__all__ = ["BuildConfig", "ShardConfig", "SourceConfig", "TokenizeConfig", "build", "read_manifest"]
