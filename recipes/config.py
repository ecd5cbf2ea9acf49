"""Recipes: YAML files read into typed dataclasses, with `key.sub=value` overrides from the command line.

Every section is a dataclass; loading is strict: an unknown key, a missing required key or a value of
the wrong type is an error that names its dotted path (`optim.lr: expected a number, got 'fast'`). The
numeric objective's own section is read once, by `numloss.ObjectiveConfig` (unknown terms and options;
its errors name `loss.objective.terms.<term>.<key>`): `recipe.loss.objective` is that typed config, and
the recipe's dump writes it back as it was written. The modules of `loss.plugins` (terms of the user's)
are imported just before (`recipes.plugins`), so every entry point that loads the recipe knows them.
Files and overrides are read by `recipes.recipe_yaml`: a key given twice, a tab or any other syntax
error is refused with file:line:column; `3e-4` is a number, and a quoted number ("3e-4", a weight "3")
is never taken for one.

    recipe = load_recipe("recipes/configs/demo.yaml", ["optim.lr=3e-4", "loss.objective.terms={smmd: {}}"])

A recipe may start from another: `base: ce.yaml` (relative to the file; a base may have its own base).
The file's sections are merged key by key over the base's, and each value replaces the base's whole
(`loss.objective: {terms: {smmd: {}}}` is the new objective, not a union of terms), as an override
`loss.objective=...` would. A run's identity is never inherited: `name` is the file's own (default: its
stem) and `train.out_dir` the file's own (default: `runs/<name>`), so two recipes sharing a base never
write into one directory.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from numloss import ObjectiveConfig
from numloss.losses.options import float32_problem

from .engines import ENGINES, engine_contract
from .engines.deepspeed.pure.contract import DeepSpeedSection
from .engines.megatron.pure.contract import MegatronSection
from .recipe_yaml import load_yaml
from .sections import ClusterSection, DataConfig, EvalSection, LossConfig, ModelConfig, OptimConfig, TrainSection


@dataclass
class Recipe:
    name: str = "recipe"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    megatron: MegatronSection = field(default_factory=MegatronSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)

    def validate(self) -> None:
        """Cross-field checks; raises ValueError naming the key."""
        choices = {
            "model.dtype": (self.model.dtype, ("bfloat16", "float32")),
            "loss.numeric_policy": (self.loss.numeric_policy, ("digits", "integers", "float")),
            "loss.head": (self.loss.head, ("logits", "chunked")),
            "optim.schedule": (self.optim.schedule, ("cosine", "constant")),
            "eval.answer_format": (self.eval.answer_format, ("number", "time")),
            "data.verify": (self.data.verify, ("size", "full", "none")),
        }
        for key, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"{key}: {value!r} is not one of {list(allowed)}")
        engine = engine_contract(self)  # ValueError naming train.engine and the known engines
        for contract in (c for c in ENGINES.values() if c.section):  # every engine's section, whichever trains
            problems = contract.section_problems(getattr(self, contract.section))
            if problems:
                raise ValueError(problems[0])
        if (self.model.name_or_path is None) == (self.model.config is None):
            raise ValueError("model: give exactly one of model.name_or_path and model.config")
        if self.model.config is not None and not self.model.tokenizer:
            raise ValueError("model.tokenizer: required when the model is built from model.config")
        problems = engine.recipe_problems(self)  # what the chosen engine cannot train at all
        if problems:
            raise ValueError(problems[0])
        positive = {"train.steps": self.train.steps, "train.micro_batch_size": self.train.micro_batch_size,
                    "train.grad_accum": self.train.grad_accum, "loss.chunk_size": self.loss.chunk_size,
                    "train.keep_last": self.train.keep_last,
                    "cluster.nodes": self.cluster.nodes, "cluster.cpu_ranks_per_node": self.cluster.cpu_ranks_per_node}
        for key, value in positive.items():
            if value < 1:
                raise ValueError(f"{key}: must be >= 1, got {value}")
        aux = self.loss.router_aux_coeff
        if aux is not None and not (math.isfinite(aux) and aux >= 0 and float32_problem(aux) is None):
            raise ValueError(f"loss.router_aux_coeff: must be a finite float32 number >= 0 (0: off, null: the model's"
                             f" router_aux_loss_coef), got {aux}")
        if self.train.grad_diagnostics_every is not None and self.train.grad_diagnostics_every < 0:
            raise ValueError(f"train.grad_diagnostics_every: must be >= 0 (0: off), got {self.train.grad_diagnostics_every}")
        if self.train.dist_timeout_minutes <= 0:
            raise ValueError(f"train.dist_timeout_minutes: must be > 0, got {self.train.dist_timeout_minutes}")
        o = self.optim
        for key, value in {"optim.lr": o.lr, "optim.grad_clip": o.grad_clip, "optim.warmup_steps": o.warmup_steps,
                           "optim.weight_decay": o.weight_decay, "optim.eps": o.eps,
                           "optim.min_lr_ratio": o.min_lr_ratio}.items():
            if not math.isfinite(value):  # NaN passes every comparison; inf trains a NaN model
                raise ValueError(f"{key}: must be a finite number, got {value}")
            if value < 0:
                raise ValueError(f"{key}: must be >= 0, got {value}")
            # the optimizer's state and master weights are float32 under either model.dtype: a value finite
            # in float64 can be inf there (optim.lr 1e40), or 0 (optim.eps 1e-50: a division by zero)
            in_float32 = float32_problem(value, strict_positive=key == "optim.eps")
            if in_float32:
                raise ValueError(f"{key}: {in_float32}")
        if o.eps <= 0:
            raise ValueError(f"optim.eps: must be > 0, got {o.eps}")
        if o.min_lr_ratio > 1:
            raise ValueError(f"optim.min_lr_ratio: must be in [0, 1], got {o.min_lr_ratio}")
        if len(o.betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                        for b in o.betas):
            raise ValueError(f"optim.betas: expected two numbers in [0, 1), got {o.betas}")
        if not math.isfinite(self.train.dist_timeout_minutes):
            raise ValueError(f"train.dist_timeout_minutes: must be finite, got {self.train.dist_timeout_minutes}")
        if not (math.isfinite(self.train.preempt_window_s) and self.train.preempt_window_s > 0):
            raise ValueError(f"train.preempt_window_s: must be a finite number > 0, got {self.train.preempt_window_s}")
        if not (math.isfinite(self.train.watchdog_s) and self.train.watchdog_s >= 0):
            raise ValueError(f"train.watchdog_s: must be a finite number >= 0 (0: off), got {self.train.watchdog_s}")
        if self.train.max_epochs is not None and not (math.isfinite(self.train.max_epochs)
                                                      and self.train.max_epochs > 0):
            raise ValueError(f"train.max_epochs: must be a finite number > 0, got {self.train.max_epochs}")
        if self.model.lora is not None:
            self._validate_lora()
        if not self.data.train:
            raise ValueError("data.train: required (a data_prep output directory)")

    def _validate_lora(self) -> None:
        lora = self.model.lora
        if self.model.vision:
            raise ValueError("model.lora is not supported with model.vision (not tested on vision towers)")
        if lora.r < 1 or lora.alpha <= 0 or not 0 <= lora.dropout < 1:
            raise ValueError(f"model.lora: needs r >= 1, alpha > 0 and 0 <= dropout < 1; got r={lora.r},"
                             f" alpha={lora.alpha}, dropout={lora.dropout}")
        targets = [lora.target_modules] if isinstance(lora.target_modules, str) else lora.target_modules
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"model.lora.target_modules: module names or \"all-linear\", got {lora.target_modules!r}")
        if self.loss.head == "chunked" and "lm_head" in targets:
            raise ValueError("model.lora.target_modules: lm_head cannot take an adapter with loss.head: chunked"
                             " (the chunked head reads the head's weight directly)")

    def to_dict(self) -> dict:
        """The recipe as plain data (recipe.yaml, recipe.json, the run log), the objective as it was written."""
        data = dataclasses.asdict(self)
        data["loss"]["objective"] = self.loss.objective_mapping()
        return data


# ---- strict loading ----------------------------------------------------------------------------------


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp, path: str):
    """`value` checked against the annotation `tp` (dataclass, Optional, list, dict, int, float, str, bool)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, path)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0] if errors else f"{path}: unexpected value {value!r}")
    if tp is ObjectiveConfig:  # as written: LossConfig reads it with numloss's own strict reader
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{path or 'recipe'}: expected a mapping, got {type(value).__name__} {value!r}")
        return _build(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # never a string, even "3e-4": recipes.recipe_yaml reads 3e-4 as a number, so a string here was
        # quoted, as a weight "3" would be (numloss.ObjectiveConfig refuses that too)
        quoted = " (a quoted string: write the number without quotes)" if isinstance(value, str) else ""
        raise ValueError(f"{path}: expected a number, got {value!r}{quoted}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{path}: expected a string, got {value!r}")
    if tp is list or origin is list:
        if isinstance(value, list):
            return list(value)
        raise ValueError(f"{path}: expected a list, got {value!r}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ValueError(f"{path}: expected a mapping, got {value!r}")
    raise TypeError(f"{path}: unsupported annotation {_type_name(tp)}")


def _build(cls, data: dict, path: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{path}." if path else ""
        raise ValueError(f"unknown key {where}{unknown[0]} (known in {path or 'recipe'}: {sorted(names)})")
    kwargs = {}
    for key, value in data.items():
        kwargs[key] = _coerce(value, hints[key], f"{path}.{key}" if path else key)
    return cls(**kwargs)


def apply_override(data: dict, override: str) -> None:
    """`a.b.c=value` (value parsed as YAML) set into the nested dict `data`."""
    if "=" not in override:
        raise ValueError(f"override {override!r}: expected key.path=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ValueError(f"override {override!r}: empty key component")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"override {override!r}: {part} is not a section")
        node = child
    node[parts[-1]] = load_yaml(raw, f"override {override!r}, its value")


def recipe_from_dict(data: dict, overrides: list[str] | tuple = ()) -> Recipe:
    data = copy.deepcopy(data or {})  # overrides write into nested sections: never into the caller's
    for override in overrides:
        apply_override(data, override)
    recipe = _build(Recipe, data)
    if not recipe.train.out_dir:
        recipe.train.out_dir = f"runs/{recipe.name}"
    recipe.validate()
    return recipe


def recipe_chain(path: str | Path) -> list[tuple[Path, dict]]:
    """A recipe file and its `base` chain, nearest first: [(file, its mapping without `base`), ...]."""
    chain: list[tuple[Path, dict]] = []
    path = Path(path)
    while True:
        if not path.is_file():
            where = f" (the base of {chain[-1][0]})" if chain else ""
            raise FileNotFoundError(f"recipe {path}{where} does not exist")
        seen = [p.resolve() for p, _ in chain]
        if path.resolve() in seen:
            raise ValueError(f"recipe {path}: base cycle {' -> '.join(map(str, seen + [path.resolve()]))}")
        with path.open() as f:
            data = load_yaml(f, str(path)) or {}
        if not isinstance(data, dict):
            raise ValueError(f"recipe {path}: expected a mapping at the top level, got {type(data).__name__}")
        base = data.pop("base", None)
        chain.append((path, data))
        if base is None:
            return chain
        if not isinstance(base, str):
            raise ValueError(f"recipe {path}: base: expected a file name, got {base!r}")
        path = path.parent / base


def read_recipe_file(path: str | Path) -> dict:
    """A recipe file as a plain dict with its `base` chain merged in (see the module docstring)."""
    chain = recipe_chain(path)
    merged: dict = {}
    for _, data in reversed(chain):  # the farthest base first, the file itself last
        for key, value in data.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}  # a section: key by key
            else:
                merged[key] = value
    own_path, own = chain[0]  # a run's identity is the file's own, never its base's
    merged["name"] = own.get("name", own_path.stem)
    if isinstance(merged.get("train"), dict):
        own_out_dir = own["train"].get("out_dir") if isinstance(own.get("train"), dict) else None
        merged["train"] = {**merged["train"], "out_dir": own_out_dir or ""}
    return merged


def load_recipe(path: str | Path, overrides: list[str] | tuple = ()) -> Recipe:
    """Read (with its base), override, type-check and validate a recipe file."""
    data = read_recipe_file(path)
    try:
        return recipe_from_dict(data, overrides)
    except ValueError as err:
        raise ValueError(f"recipe {path}: {err}") from None


def dump_recipe(recipe: Recipe, path: str | Path) -> None:
    with Path(path).open("w") as f:
        yaml.safe_dump(recipe.to_dict(), f, sort_keys=False)
