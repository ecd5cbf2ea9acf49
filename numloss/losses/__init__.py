"""The numeric loss terms, each written once against `LogitStats` (see `numloss.logit_stats`), and the
registry through which they, and a user's own, reach the objective (`numloss.losses.registry`).

`TERMS` (read-only) maps a registered term's name to its function `term(stats, vocab, **options) -> 0-d
tensor`; `DEFAULT_WEIGHTS` (read-only) its default weight. The built-in terms below enter through
`register_term` as a user's term does.
"""

from ..normalization import NUMERIC, PLACE_VALUE, SEQUENCES, TOKENS
from .cross_entropy import cross_entropy_term
from .digit_entropy import digit_entropy_term
from .dist2 import dist2_term
from .gce import gce_term
from .ntil import ntil_term
from .ntl import ntl_mse_term, ntl_was_term
from .numeric_smoothing import numeric_smoothing_term
from .options import boolean, choice, finite, positive_list, token_id
from .registry import DEFAULT_WEIGHTS, NEEDS, TERMS, TermSpec, register_term, registered_terms, term_spec, unregister_term
from .smmd import smmd_term


def _weighted_positions(name: str):
    """NTL's count: the sum of its position weights when given, else the numeric positions."""
    return lambda options: f"{name}.position_weights" if options["position_weights"] is not None else NUMERIC


def _reweighed(options) -> tuple[str, ...]:
    return ("full_vocab",) if options["reweigh"] else ()


register_term("ntl_was", ntl_was_term, default_weight=0.3, needs=_reweighed, denominator=_weighted_positions("ntl_was"),
              options={"squash_factor": finite(1, optional=True), "reweigh": boolean}, splits=True, _builtin=True)
register_term("ntl_mse", ntl_mse_term, default_weight=0.3, needs=_reweighed, denominator=_weighted_positions("ntl_mse"),
              options={"loss": choice("mse", "mae", "huber"), "reweigh": boolean}, splits=True, _builtin=True)
register_term("gce", gce_term, default_weight=1.0, needs=("full_vocab",), denominator=TOKENS, replaces_ce=True,
              options={"sigma": finite(0), "renormalize": boolean}, splits=True, _builtin=True)
register_term("dist2", dist2_term, default_weight=0.1,
              needs=lambda o: ("full_vocab",) if o["normalize"] == "full" else (),
              denominator=lambda o: PLACE_VALUE if o["weighting"] == "place_value" else NUMERIC,
              options={"tau": finite(0, strict=True), "normalize": choice("full", "numeric"),
                       "weighting": choice("none", "place_value")}, splits=True, _builtin=True)
register_term("ntil", ntil_term, default_weight=0.3, needs=("digits",), denominator=SEQUENCES, splits=True,
              options={"digit_exp": finite(0, strict=True), "digit_alpha": finite(0), "abs_alpha": finite(0),
                       "mag_alpha": finite(0), "tau": finite(0, strict=True), "noise_scale": finite(0)}, _builtin=True)
register_term("smmd", smmd_term, default_weight=3.0,
              options={"sigmas": positive_list, "squash_factor": finite(0, strict=True, optional=True),
                       "kernel": choice("gaussian", "laplace"), "alpha": finite(0, optional=True),
                       "mode": choice("smmd", "mmd", "smooth")}, splits=True, _builtin=True)
register_term("del", digit_entropy_term, default_weight=0.01,
              needs=lambda o: ("ten_digits",) + (("decimal_point",) if o["decimal_point_id"] is None else ()),
              options={"decimal_point_id": token_id}, splits=True, _builtin=True)
register_term("numeric_smoothing", numeric_smoothing_term, default_weight=0.1,
              needs=lambda o: ("full_vocab",) if o["normalize"] == "full" else (),
              denominator=lambda o: PLACE_VALUE if o["weighting"] == "place_value" else NUMERIC,
              options={"normalize": choice("full", "numeric"), "weighting": choice("none", "place_value")},
              splits=True, _builtin=True)

__all__ = ["TERMS", "DEFAULT_WEIGHTS", "NEEDS", "TermSpec", "register_term", "unregister_term", "term_spec",
           "registered_terms", "cross_entropy_term", "digit_entropy_term", "ntl_was_term", "ntl_mse_term",
           "gce_term", "dist2_term", "ntil_term", "smmd_term", "numeric_smoothing_term"]
