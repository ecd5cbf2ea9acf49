"""The numeric loss terms, each written once against `LogitStats` (see `numloss.logit_stats`).

`TERMS` maps a term's name to its function `term(stats, vocab, **options) -> 0-d tensor`.
"""

from .cross_entropy import cross_entropy_term
from .dist2 import dist2_term
from .gce import gce_term
from .ntil import ntil_term
from .ntl import ntl_mse_term, ntl_was_term
from .smmd import smmd_term

TERMS = {
    "ntl_was": ntl_was_term,
    "ntl_mse": ntl_mse_term,
    "gce": gce_term,
    "dist2": dist2_term,
    "ntil": ntil_term,
    "smmd": smmd_term,
}

__all__ = ["TERMS", "cross_entropy_term"] + [f"{name}_term" for name in TERMS]
