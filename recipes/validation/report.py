"""What `python -m recipes.validate` prints: a `Report` of (key, text) lines, warnings and errors, and the
numbers behind them (`--json`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Report:
    recipe: str
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    info: list[tuple[str, str]] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)
    layout_errors: list[str] = field(default_factory=list)  # of `errors`: layouts that cannot run (exit 2)

    @property
    def ok(self) -> bool:
        return not self.errors

    def refuse_layout(self, errors: list[str]) -> None:
        self.errors.extend(errors)
        self.layout_errors.extend(errors)

    def add(self, key: str, value: Any) -> None:
        self.info.append((key, str(value)))

    def render(self) -> str:
        lines = [f"recipe {self.recipe}"]
        width = max((len(k) for k, _ in self.info), default=0)
        lines += [f"  {k:<{width}}  {v}" for k, v in self.info]
        lines += [f"WARNING  {w}" for w in self.warnings]
        lines += [f"ERROR    {e}" for e in self.errors]
        verdict = "OK" if self.ok else f"FAILED ({len(self.errors)} error{'s' * (len(self.errors) != 1)})"
        lines.append(f"{verdict}, {len(self.warnings)} warning{'s' * (len(self.warnings) != 1)}")
        return "\n".join(lines)


def params_text(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
