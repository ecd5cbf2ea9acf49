"""Source adapters: one small module per corpus, each turning records into `Example`s.

`make_source(cfg)` picks the adapter by `cfg.kind`. See `base.py` for the contract every adapter keeps
(streaming `iter_raw` in the main process, `to_example` in the workers, `BadRecord` for rejects).
"""

from __future__ import annotations

from .arithmetic_gen import Arithmetic
from .base import BadRecord, Example, Source, SourceConfig
from .chartqa import ChartQA
from .clock import Clock, ClockText
from .deepmind_math import DeepMindMath
from .generic import Generic
from .gsm8k import GSM8K
from .svamp import SVAMP

SOURCES: dict[str, type[Source]] = {
    cls.kind: cls for cls in (GSM8K, SVAMP, DeepMindMath, Arithmetic, Clock, ClockText, ChartQA, Generic)
}


def make_source(cfg: SourceConfig) -> Source:
    if cfg.kind not in SOURCES:
        raise ValueError(f"unknown source kind {cfg.kind!r}; expected one of {sorted(SOURCES)}")
    return SOURCES[cfg.kind](cfg)


__all__ = ["SOURCES", "BadRecord", "Example", "Source", "SourceConfig", "make_source"]
