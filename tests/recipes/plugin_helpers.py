"""A user's term package for the `loss.plugins` tests: written into a temporary folder that a test puts on
sys.path (in-process) or PYTHONPATH (subprocesses), with its float64 reference, and the clean-up that
takes it out of this process again (the term registry and sys.modules are process-wide)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

PACKAGE = "numloss_user_terms"  # a name no other package of the environment has
MODULE = f"{PACKAGE}.terms"
TERM = "abs_error"
WEIGHT = 0.5

TERMS_PY = f'''"""A term of the user's: |E_p[v] - y| ** power over the renormalised numeric distribution."""
import torch

import numloss
from numloss.losses.options import finite


def abs_error(stats, vocab, power: float = 1.0, denominator=None):
    num = stats.numeric
    values = vocab.values_on(num.logits.device)
    error = (torch.softmax(num.logits, -1) @ values - values[num.target]).abs() ** power
    return error.sum() / max(num.count if denominator is None else denominator, 1)


numloss.register_term("{TERM}", abs_error, default_weight={WEIGHT}, options={{"power": finite(0, strict=True)}})
'''

# modules of the same package that are bad plugins, each for one reason
BAD = {
    "silent": "x = 1  # registers nothing\n",
    "broken": "import numloss_missing_dependency  # noqa: F401\n",
    "refused": "import numloss\nfrom .terms import abs_error\n\nnumloss.register_term('Abs', abs_error, default_weight=1.0)\n",
}


def write_package(root: Path) -> Path:
    """The package `PACKAGE` in `root` (terms.py, and the bad modules of BAD); returns `root`."""
    package = root / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "terms.py").write_text(TERMS_PY)
    for name, text in BAD.items():
        (package / f"{name}.py").write_text(text)
    return root


def forget_package() -> None:
    """This process as before the package was imported: its modules, its terms, the plugin record."""
    from numloss.losses import registered_terms, term_spec, unregister_term
    from recipes import plugins

    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    for term in registered_terms():
        if term_spec(term).fn.__module__.startswith(PACKAGE):
            unregister_term(term)
    for name in [m for m in plugins._REGISTERED if m.startswith(PACKAGE)]:
        del plugins._REGISTERED[name]


def reference(logits: torch.Tensor, labels: torch.Tensor, digit_ids: list[int], power: float = 1.0) -> tuple[float, int]:
    """(sum, count) of the term at the positions whose label is a digit token, in float64, with plain loops:
    `logits` [T, V] already aligned with `labels` [T] (shifted)."""
    total, count = 0.0, 0
    for t in range(labels.shape[0]):
        label = int(labels[t])
        if label not in digit_ids:
            continue
        p = torch.softmax(logits[t, digit_ids].double(), -1)
        expected = sum(float(p[d]) * d for d in range(10))
        total += abs(expected - digit_ids.index(label)) ** power
        count += 1
    return total, count
