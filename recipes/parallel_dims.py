"""The parallel layout of a run: named degrees, the data-parallel size defined once, and the rules every
layout obeys whatever the engine.

    dims = ParallelDims.of(world=64, tp=8, pp=2)   # dp = 64 / (8 x 2) = 4
    dims.problems({"tp": "megatron.tp_size", "pp": "megatron.pp_size"})   # [] : it divides

Degrees: `tp` tensor parallel, `pp` pipeline stages, `vpp` model chunks per pipeline stage (1: no
interleaving), `sp` sequence parallelism (Megatron's, inside the TP group: activations outside attention
split along the sequence between the TP ranks; a switch, only with tp > 1), `cp` the ranks that split
each row's positions (DeepSpeed-Ulysses' `deepspeed.sp_size`, Megatron's context parallelism
`megatron.cp_size`: every rank of such a group reads the same rows and holds a slice of their positions),
`ep` expert parallel, `dp` data parallel, `world` every rank. Ranks split as world = tp x cp x pp x dp; expert parallelism is folded
into data parallelism as megatron-core defines it (each group of `ep` consecutive data-parallel ranks
splits the experts), so `ep` divides `dp` and adds no factor to the world. DeepSpeed's AutoTP is the
case pp = vpp = ep = 1, sp off.

The data-parallel size is world / (tp x cp x pp) (at least 1): a world that does not divide still gets a
size, so a report can go on, and `problems` names the keys that break the layout. An engine asks its
contract (`recipes.engines.<engine>.contract`) for the run's `ParallelDims`; it never divides the world
itself. Pure: numbers in, numbers out; imports nothing of the project.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParallelDims:
    """One parallel layout. Build it with `ParallelDims.of` (which derives `dp`); the degrees are checked
    to be positive integers when it is made, the divisibility rules by `problems` / `check`."""

    world: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    sp: bool = False
    dp: int = field(default=0)  # 0: derived, world / (tp x cp x pp)
    cp: int = 1

    def __post_init__(self):
        for name in ("world", "tp", "pp", "vpp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelDims.{name}: must be an integer >= 1, got {value!r}")
        derived = max(1, self.world // self.replica)
        if self.dp == 0:
            object.__setattr__(self, "dp", derived)
        elif self.dp != derived:
            raise ValueError(f"ParallelDims.dp: {self.dp} != world {self.world} / (tp {self.tp} x cp {self.cp} x pp"
                             f" {self.pp})")

    @classmethod
    def of(cls, world: int, *, tp: int = 1, pp: int = 1, vpp: int | None = 1, sp: bool = False,
           ep: int = 1, cp: int = 1) -> ParallelDims:
        """The layout of `world` ranks at these degrees (`vpp` None: no interleaving; `sp` kept only
        where it applies, with tp > 1)."""
        return cls(world=world, tp=tp, pp=pp, vpp=vpp or 1, ep=ep, sp=bool(sp) and tp > 1, cp=cp)

    @property
    def model_parallel(self) -> int:
        """Ranks holding one replica of the model: tp x pp."""
        return self.tp * self.pp

    @property
    def replica(self) -> int:
        """Ranks that together take one data-parallel share of the rows: tp x cp x pp."""
        return self.tp * self.cp * self.pp

    @property
    def divides(self) -> bool:
        """Whether tp x cp x pp divides the world (else `dp` is a floor, and `problems` says so)."""
        return self.world % self.replica == 0

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the data-parallel ranks that hold the same experts, dp / ep."""
        return max(1, self.dp // self.ep)

    def global_batch(self, micro_batch_size: int, grad_accum: int) -> int:
        """Rows of one optimizer step over every data-parallel rank."""
        return micro_batch_size * grad_accum * self.dp

    def problems(self, keys: Mapping[str, str]) -> list[str]:
        """What breaks the layout, each line naming the recipe keys of `keys` (degree -> key, e.g.
        {"tp": "deepspeed.tp_size"}; a degree without a key is one the engine does not have):
        tp (x cp x pp) dividing the world, and ep dividing the data-parallel size."""
        errors = []
        if not self.divides and self.cp > 1:
            named = [f"{keys.get(d, d)} {getattr(self, d)}" for d in ("tp", "cp", "pp") if d in keys or d == "cp"]
            errors.append(f"{' x '.join(named)} does not divide the world of {self.world} ranks (data-parallel size"
                          " = world / (tp x cp x pp))")
        elif not self.divides:
            if "pp" in keys:
                errors.append(f"{keys['tp']} x {keys['pp']}: {self.tp} x {self.pp} does not divide the world of "
                              f"{self.world} ranks (data-parallel size = world / (tp x pp))")
            else:
                errors.append(f"{keys['tp']}: {self.tp} does not divide the world of {self.world} ranks")
        elif self.dp % self.ep:
            errors.append(f"{keys.get('ep', 'ep')}: {self.ep} does not divide the data-parallel size {self.dp} "
                          f"(world {self.world} / (tp {self.tp} x pp {self.pp})): expert parallelism splits "
                          "data-parallel ranks")
        return errors

    def check(self, keys: Mapping[str, str]) -> ParallelDims:
        """Itself, or ValueError listing `problems` (an engine calls it before it makes any group)."""
        errors = self.problems(keys)
        if errors:
            raise ValueError("; ".join(errors))
        return self
