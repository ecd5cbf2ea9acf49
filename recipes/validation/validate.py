"""Check a recipe without training: config, model size, ZeRO memory per GPU, batch arithmetic, data.

    python -m recipes.validate recipes/configs/llama3-8b-gsm8k.yaml
    python -m recipes.validate RECIPE.yaml train.micro_batch_size=4 --strict    # missing data is an error
    python -m recipes.validate RECIPE.yaml --offline                           # never try the hub

Exit status 0 when the recipe has no error (warnings allowed), 1 when it has errors, 2 when it does not
load at all (unknown key, wrong type, bad choice, bad objective term/option: the message names the key)
or asks for a parallel layout the model or the cluster cannot take (TP not dividing the heads, KV heads
or a width, PP the layers, EP the experts or the data-parallel size, TP spanning nodes, tp x pp not
dividing the world: `Report.layout_errors`, each naming its key).

What is checked, in order:
1. Loading: `recipes.config.load_recipe` (strict types, choices, the objective's terms and options).
2. The model config: `model.config` (random init) is built with AutoConfig.for_model; a local directory
   is read; a hub name is looked up in the local HF cache, then on the hub (unless --offline), then in
   `KNOWN_BACKBONES` in `recipes.planning.backbones`, shipped offline fallback metadata for the papers'
   backbones.
3. Parameter count and the largest single module's parameters, from an empty-weight model
   (`torch.device("meta")`, nothing allocated), vision tower included for `model.vision` recipes.
4. The plan of the recipe's engine (its contract's `plan`: recipes.engines.<engine>.plan over
   its cost model), printed by that engine's report lines (the contract's `report`: recipes.engines.
   <engine>.report). DeepSpeed: its own estimate of model-state memory per GPU
   (`estimate_zero3_model_states_mem_needs` / `estimate_zero2_...`, with the recipe's offload settings;
   with `model.lora`, its cost model's LoRA estimate: a frozen base and the adapter's states), then memory by
   part (model states, hpZ copy, buffers, activations, head), host RAM per node at load and at export (an
   error above `cluster.host_mem_gb`), checkpoints on disk and their cadence, the bytes each GPU moves per
   step by collective over the network and NVLink, step time with the terms that make it, MFU, the
   limiting part and the changes that shorten it. Megatron: memory by pipeline stage, bubble, TP/PP/DP
   traffic inside and across nodes, step time and MFU (an MoE model's at --moe-imbalance, the busiest EP
   rank's share of the tokens: recipes.planning.moe). A total above what a GPU may fill is an error
   naming the part: `--gpu-mem-gb` / cluster.gpu_mem_gb (80: an 80 GB GPU, which torch sees as 79.1 GiB)
   less 10 % (recipes.planning.device_memory). Rows: --seq-len, else the data's row lengths read from its
   shards (padded to data.seq_len when set, else as the engine pads each micro-batch), else data.seq_len,
   else 1024 assumed (stated). Then, for a recipe without errors, the fastest layout that fits on any
   engine at these rows, with the recipe keys that select it (recipes.validation.recommend; a warning
   when the recipe's own is 1.5x slower or more).
5. Parallel layout and batch arithmetic: T divides gpus_per_node; train.global_batch_size (when given)
   == micro_batch_size * grad_accum * nodes * gpus_per_node / T. A CPU recipe (gpus_per_node 0) does
   not fix its number of ranks (the launcher does): its global batch must be a multiple of
   micro_batch_size * grad_accum, and the quotient is reported as the implied rank count.
6. The static checks recipes.train runs before building its model (`recipes.checks.preflight`): settings
   the engine ignores (refused, or mapped and said: first, as they may set megatron.recompute), NTIL
   needs the digits policy; the training data: numeric policy, one global batch, steps within
   train.max_epochs, the tokenizer fingerprint, and from the manifest's per-shard statistics row lengths,
   data.seq_len, positions, vocabulary and scored labels; the model config's heads and layers against
   the layout (on CPU recipes too); train.out_dir and the checkpoint it would resume from.
7. Data: data.train / data.eval / eval.data must be data_prep directories (manifest.json). A missing one
   is a warning ("data missing: build it with ...", the command from a `# data_prep train: ...` /
   `# data_prep eval: ...` comment in the recipe file), an error with --strict.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

from recipes.checks import preflight as checks
from recipes.checks.model_checks import parallel_layout_problems
from recipes.config import load_recipe, recipe_chain
from recipes.engines import engine_contract
from recipes.planning.backbones import KNOWN_BACKBONES, count_parameters, resolve_model_config
from recipes.planning.device_memory import device_memory
from recipes.planning.lora import adapter_parameters
from recipes.planning.moe import imbalance_problem
from recipes.planning.save_time import STORAGE_GBPS, shutdown_warnings
from recipes.planning.step_model import hardware as recipe_hardware, row_tokens
from recipes.validation.recommend import recommend as recommend_layout
from recipes.validation.report import Report, params_text


# ---- data ---------------------------------------------------------------------------------------------

_HINT_RE = re.compile(r"^\s*#\s*data_prep\s+(train|eval)\s*:\s*(.+?)\s*$")


def build_hints(recipe_path: str | Path) -> dict[str, str]:
    """`# data_prep train: <command>` / `# data_prep eval: <command>` comments of a recipe file, then of
    its `base` chain (the file's own come first)."""
    hints: dict[str, str] = {}
    for path, _ in recipe_chain(recipe_path):
        for line in path.read_text().splitlines():
            m = _HINT_RE.match(line)
            if m:
                hints.setdefault(m.group(1), m.group(2))
    return hints


def _same_source(name: str) -> str:
    """A tokenizer source made comparable: local directories by real path, hub names as they are."""
    return os.path.realpath(name) if os.path.isdir(name) else str(name)


def _manifest(path: str) -> dict | None:
    p = Path(path) / "manifest.json"
    if not p.is_file():
        return None
    with p.open() as fh:
        return json.load(fh)


# ---- the checks ---------------------------------------------------------------------------------------


def chunked_head_note(rep: Report, recipe, hidden_size: int | None) -> None:
    """Which head pays for the recipe's shapes (benchmarks/bench_chunked.py). Both heads produce d W, the
    [V, H] gradient of the lm_head; the logits path adds ~10 bytes per logit ([T, V]) on top, the chunked
    head about an eighth of that. So the chunked head's saving shrinks as H grows past T, the tokens of a
    micro-batch: from H >= 4 T it saves about 10% of the head's memory or less (measured: 0.89x at
    T = 1024, H = 4096; 0.95x at H = 8192), while it always does four GEMMs of [T, H] x [H, V] to the
    logits path's three (it recomputes the logits in backward): ~4/3 of the time where the GEMMs dominate,
    as expected on a GPU (measured on CPU, one thread: 1.0-1.33x in fp32, 0.6-1.2x in bf16)."""
    if recipe.loss.head != "chunked" or not hidden_size or not recipe.data.seq_len:
        return
    tokens = recipe.train.micro_batch_size * recipe.data.seq_len
    if hidden_size >= 4 * tokens:
        rep.warnings.append(
            f"loss.head: chunked saves little at {tokens} tokens per micro-batch with hidden size {hidden_size}"
            " (d W, [V, H], dominates both heads' memory): loss.head: logits is about as small and faster"
            " (the chunked head recomputes the logits in backward: 4 GEMMs to 3); the chunked head pays from"
            " micro_batch_size x seq_len > hidden_size / 4")


def validate_recipe(path: str | Path, overrides: list[str] | tuple = (), strict: bool = False,
                    offline: bool = False, gpu_mem_gb: float | None = None, size: bool = True,
                    seq_len: int | None = None, mean_row_tokens: float | None = None, recommend: bool = True,
                    moe_imbalance: float = 1.0, **hardware) -> Report:
    """All checks of the module docstring; never raises for a bad recipe (see `Report.errors`). `hardware`:
    gpu, gpu_tflops, gpu_peak_tflops, net_gbps (one NIC), nics_per_node, nvlink_gbps (None: the recipe's
    cluster.* values, else recipes.planning.step_model.Hardware's defaults). `recommend`: weigh the other
    layouts too (recipes.validation.recommend) when the recipe has no error so far. `moe_imbalance`: the
    tokens the busiest EP rank receives over the mean, >= 1 (recipes.planning.moe; Megatron plans)."""
    rep = Report(str(path))
    if imbalance_problem(moe_imbalance):
        rep.numbers["load_error"] = True
        rep.errors.append(f"--moe-imbalance: {imbalance_problem(moe_imbalance)}")
        return rep
    try:
        recipe = load_recipe(path, list(overrides))
    except (ValueError, FileNotFoundError) as err:
        rep.numbers["load_error"] = True
        rep.errors.append(str(err))
        return rep
    rep.add("name", recipe.name)
    m, tr, cl = recipe.model, recipe.train, recipe.cluster
    rep.add("model", m.name_or_path or f"model.config ({(m.config or {}).get('model_type')}, random init)")
    contract = engine_contract(recipe)
    report = contract.report
    errors, mapped = contract.adopt_settings(recipe)  # first: it may set megatron.recompute, which the plan reads
    rep.errors.extend(errors)
    rep.errors.extend(checks.start_problems(recipe, cuda=None))  # the job's machine has its own kernels
    for note in mapped:
        rep.add("engine settings", note)

    # 2-4: model config, size, memory
    hidden_size = cfg = total = None
    if size:
        try:
            cfg, source, notes = resolve_model_config(recipe, offline=offline)
            rep.warnings.extend(notes)
            rep.add("model config", source)
            total, largest = count_parameters(cfg, vision=m.vision)
            text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
            hidden_size = getattr(text_cfg, "hidden_size", None)
            rep.numbers.update(params=total, largest_layer_params=largest)
            rep.add("parameters", f"{params_text(total)} ({total:,}); largest module {params_text(largest)}")
            if "fallback" in source and m.vision and "vision_config" not in KNOWN_BACKBONES.get(m.name_or_path, {}):
                rep.warnings.append("model.vision: the offline table has no vision tower for this model; "
                                    "the count is the text part only")
        except ValueError as err:
            rep.errors.append(str(err))
            total = None
        except Exception as err:  # noqa: BLE001  (a config transformers cannot build)
            rep.errors.append(f"model: cannot build the model from its config: {type(err).__name__}: {err}")
            total = None
        hw = recipe_hardware(recipe, gpu=hardware.get("gpu"), gpu_tflops=hardware.get("gpu_tflops"),
                             peak_tflops=hardware.get("gpu_peak_tflops"), nic_gbps=hardware.get("net_gbps"),
                             nics_per_node=hardware.get("nics_per_node"), nvlink_gbps=hardware.get("nvlink_gbps"),
                             mem_gib=gpu_mem_gb)
        memory = device_memory(hw.mem_gib)
        if cl.gpus_per_node > 0:
            rep.add("GPU memory", memory.line())
        rep.numbers["gpu_usable_bytes"] = int(memory.usable_gib * 2**30)
        hw = replace(hw, mem_gib=memory.usable_gib)  # every plan below fits what it may fill, not the device
        rows = row_tokens(recipe, seq_len, mean_row_tokens)
        adapter = None
        if total is not None and m.lora is not None:  # a frozen base and a trainable adapter
            adapter = _report_lora(rep, cfg, m, total)
        if total is not None and cl.gpus_per_node > 0:
            plan = report.add_plan(rep, recipe, cfg, total, largest, hw=hw, rows=rows, adapter=adapter,
                                   moe_imbalance=moe_imbalance)
            if plan is not None:  # a stop request's save against the shutdown time the cluster gives it
                rep.warnings += shutdown_warnings(plan.checkpoint_bytes, plan.step_s, STORAGE_GBPS,
                                                  cl.preempt_notice_s)
        if total is not None and cl.gpus_per_node > 0 and adapter is None and recommend and not rep.errors:
            dp = contract.parallel_dims(recipe, cl.nodes * cl.gpus_per_node).dp
            batch = tr.global_batch_size or tr.micro_batch_size * tr.grad_accum * dp
            recommend_layout(rep, recipe, cfg, total, largest, hw, rows, batch, moe_imbalance)

    # 5: layout and batch arithmetic
    if cl.gpus_per_node < 0:
        rep.errors.append(f"cluster.gpus_per_node: must be >= 0, got {cl.gpus_per_node}")
    dp, layout = report.layout_line(rep, recipe, cfg if size and total is not None else None)
    per_step = tr.micro_batch_size * tr.grad_accum
    effective = per_step * dp
    if tr.global_batch_size is not None and tr.global_batch_size != effective:
        rep.errors.append(f"train.global_batch_size: {tr.global_batch_size} != micro_batch_size "
                          f"{tr.micro_batch_size} x grad_accum {tr.grad_accum} x data-parallel {dp} "
                          f"(= {effective})")
    rep.add("layout", layout)
    rep.numbers["effective_batch"] = effective
    rep.add("batch", f"{tr.micro_batch_size} per rank x {tr.grad_accum} accumulation x {dp} ranks "
                     f"= {effective} sequences per step, {tr.steps} steps")

    # 6: the static checks recipes.train runs before its model (recipes.checks.preflight): objective,
    # model config, data and its statistics, run directory; the layout's world is section 5's
    # the tokenizer: compared with the data's, and asked for what the terms need of it (DEL's decimal point)
    has_manifest = _manifest(recipe.data.train) is not None
    loaded = _model_tokenizer(recipe, offline, rep) if has_manifest or checks.tokenizer_needs(recipe) else None
    if loaded is not None:
        rep.errors.extend(checks.tokenizer_problems(recipe, loaded))
    tokenizer = checks.tokenizer_identity(loaded) if loaded is not None and has_manifest else None
    found = checks.static_checks(recipe, None, dp, tokenizer=tokenizer, config=cfg, offline=offline,
                                 missing_data_is_error=False, check_model=not (size and cfg is None))
    rep.errors.extend(found.errors)
    if cfg is not None:  # which of them are layouts the model cannot take (exit 2)
        rep.layout_errors.extend(e for e in parallel_layout_problems(recipe, cfg) if e in found.errors)
    rep.warnings.extend(found.warnings)
    for key, note in found.notes:
        rep.add(key, note)
    terms = set(recipe.loss.objective.terms)
    rep.add("objective", "CE" + "".join(f" + {t}" for t in sorted(terms)) +
            f" over the {recipe.loss.numeric_policy} numeric vocabulary")
    chunked_head_note(rep, recipe, hidden_size)

    # 7: data
    hints = build_hints(path)
    eval_dir = recipe.eval.data or recipe.data.eval
    for key, where, kind in (("data.train", recipe.data.train, "train"),
                             ("eval.data" if recipe.eval.data else "data.eval", eval_dir, "eval")):
        if not where:
            continue
        man = _manifest(where)
        if man is None:
            how = hints.get(kind) or f"python -m data_prep build --source ... --tokenizer ... --out {where}"
            msg = f"{key}: data missing at {where}: build it with {how}"
            (rep.errors if strict else rep.warnings).append(msg)
            continue
        nv = man.get("numeric_vocab", {})
        tok = man.get("tokenizer", {})
        rep.add(key, f"{where}: {man.get('totals', {}).get('rows', '?')} rows, numeric vocab "
                     f"{nv.get('policy')} (N={nv.get('size')}), tokenizer {tok.get('name')}")
        # (the training data's own checks ran in section 6)
        if kind == "eval" and nv.get("policy") and nv["policy"] != recipe.loss.numeric_policy:
            rep.errors.append(f"loss.numeric_policy: {recipe.loss.numeric_policy!r} but {where} was built "
                              f"with the {nv['policy']!r} policy (its numeric_mask would not match)")
        if man.get("packed") and kind == "eval":
            rep.errors.append(f"{key}: {where} is packed; evaluation needs one example per row")
        want = m.tokenizer or m.name_or_path
        if want and tok.get("name") and _same_source(tok["name"]) != _same_source(want):
            rep.warnings.append(f"{key}: built with tokenizer {tok['name']!r}, the recipe uses {want!r}")
    rep.errors = list(dict.fromkeys(rep.errors))  # a layout error the plan and the checks both find: said once
    return rep


def _report_lora(rep, cfg, model, total: int) -> int:
    """The LoRA lines: the adapter's parameter count (returned) and the layers it adapts; an error when
    `model.lora.target_modules` matches no linear layer."""
    lora = model.lora
    adapter, adapted = adapter_parameters(cfg, lora.target_modules, lora.r, model.vision)
    rep.numbers["lora_params"] = adapter
    rep.add("LoRA", f"r {lora.r}: {params_text(adapter)} adapter parameters in {adapted} layers "
                    f"({100 * adapter / total:.2f}% of the base, frozen in {model.dtype})")
    if not adapted:
        rep.errors.append(f"model.lora.target_modules: {lora.target_modules!r} matches no linear layer")
    return adapter


def _model_tokenizer(recipe, offline: bool, rep: Report):
    """The model's tokenizer, when it can be loaded here (else a warning: recipes.train checks it before training)."""
    try:
        return checks.model_tokenizer(recipe, offline=offline)
    except Exception as err:  # noqa: BLE001  (not cached offline, no fast version, ...)
        rep.warnings.append(f"model.tokenizer: not loadable here ({type(err).__name__}), so neither the data's "
                            f"tokenizer fingerprint nor what the objective's terms need of the tokenizer was checked "
                            f"(recipes.train checks both before training)")
        return None


def _imbalance(text: str) -> float:
    """--moe-imbalance's value, refused (exit 2) below 1 (recipes.planning.moe.imbalance_problem)."""
    try:
        value = float(text)
    except ValueError:
        value = text
    if imbalance_problem(value):
        raise argparse.ArgumentTypeError(imbalance_problem(value))
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipes.validate", description=__doc__.split("\n")[0])
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="key.path=value (YAML value)")
    p.add_argument("--strict", action="store_true", help="missing data is an error, not a warning")
    p.add_argument("--offline", action="store_true", help="never contact the hub (cache, then the fallback table)")
    p.add_argument("--gpu-mem-gb", type=float, default=None, help="GPU memory: 80 or 141 (GB, as sold: torch sees 79.1 / 139.8 GiB) or "
                   "the GiB torch shows; 10%% of it is kept free (cluster.gpu_mem_gb, else 80)")
    p.add_argument("--seq-len", type=int, default=None, help="rows of this many tokens (default: data.seq_len, else "
                   "the data's manifest, else 1024 assumed)")
    p.add_argument("--mean-row-tokens", type=float, default=None, help="mean tokens per row for compute and traffic")
    p.add_argument("--gpu", default=None, help="H100, H200 or A100: its GEMM rates, peak and memory (cluster.gpu, "
                   "else H100)")
    p.add_argument("--gpu-tflops", type=float, default=None, help="GEMM TFLOP/s at the largest shapes, the GPU's rate "
                   "table scaled to it (cluster.gpu_tflops, else the table's: docs/gemm-rates.md)")
    p.add_argument("--net-gbps", type=float, default=None, help="Gb/s of one NIC (cluster.nic_gbps, else 400: NDR)")
    p.add_argument("--nics-per-node", type=int, default=None, help="NICs per node (cluster.nics_per_node, else one "
                   "per GPU)")
    p.add_argument("--nvlink-gbps", type=float, default=None, help="NVLink Gb/s per GPU (cluster.nvlink_gbps, else "
                   "2880 = 360 GB/s, NCCL's bus bandwidth on 8 x H100 SXM)")
    p.add_argument("--gpu-peak-tflops", type=float, default=None, help="peak TFLOP/s per GPU for MFU "
                   "(cluster.gpu_peak_tflops, else 989: H100 bf16 dense)")
    p.add_argument("--moe-imbalance", type=_imbalance, default=1.0, help="MoE routing imbalance, >= 1: the busiest "
                   "expert-parallel rank receives this many times the mean tokens, which scales its expert "
                   "activations, all-to-alls and expert GEMMs in the Megatron plans (default 1: balanced)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    rep = validate_recipe(a.recipe, a.overrides, strict=a.strict, offline=a.offline, gpu_mem_gb=a.gpu_mem_gb,
                          seq_len=a.seq_len, mean_row_tokens=a.mean_row_tokens, moe_imbalance=a.moe_imbalance,
                          gpu=a.gpu, gpu_tflops=a.gpu_tflops,
                          net_gbps=a.net_gbps, nics_per_node=a.nics_per_node, nvlink_gbps=a.nvlink_gbps,
                          gpu_peak_tflops=a.gpu_peak_tflops)
    if a.json:
        print(json.dumps({"recipe": rep.recipe, "ok": rep.ok, "errors": rep.errors, "warnings": rep.warnings,
                          "info": dict(rep.info), "numbers": rep.numbers}, indent=1))
    else:
        print(rep.render())
    if rep.numbers.get("load_error") or rep.layout_errors:
        return 2
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
