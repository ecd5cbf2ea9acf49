"""recipes.validate and the shipped recipes: every recipe loads and validates; bad ones name the key."""

from pathlib import Path

import pytest

from recipes.validation import validate
from recipes.planning.backbones import count_parameters
from recipes.config import load_recipe

CONFIGS = Path(__file__).resolve().parents[3] / "recipes" / "configs"
SHIPPED = sorted(CONFIGS.rglob("*.yaml"))
DEMO = CONFIGS / "demo.yaml"
QWEN = CONFIGS / "qwen2.5-1.5b-gsm8k" / "smmd.yaml"


def test_the_papers_recipes_are_shipped():
    names = {str(p.relative_to(CONFIGS)) for p in SHIPPED}
    for loss in ("ce", "ntl", "ntil", "gce", "dist2", "smmd"):
        assert f"qwen2.5-1.5b-gsm8k/{loss}.yaml" in names
    for name in ("demo.yaml", "llama3-8b-gsm8k/smmd.yaml", "smollm3-3b-dm-math.yaml", "ministral3-3b-clock.yaml",
                 "qwen2.5-vl-7b-clock.yaml", "qwen2.5-vl-7b-chartqa.yaml", "scale/llama3-70b-4x8.yaml",
                 "scale/llama3-70b-8x8.yaml", "scale/llama3-70b-8x8-tp8.yaml"):
        assert name in names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_shipped_recipe_validates_offline(path):
    rep = validate.validate_recipe(path, offline=True)
    assert rep.ok, rep.render()
    assert rep.numbers["params"] > 0
    missing = [w for w in rep.warnings if "data missing" in w]
    for w in missing:  # every missing-data warning says how to build it
        assert "build it with python -m" in w
    recipe = load_recipe(path)
    if recipe.model.name_or_path and recipe.cluster.gpus_per_node:  # a real backbone on GPUs: a memory estimate
        assert rep.numbers["gpu_mem_bytes"] > 0
        assert all("data_prep build" in w for w in missing)


def test_strict_turns_missing_data_into_an_error(capsys):
    rep = validate.validate_recipe(QWEN, offline=True, strict=True, size=False)
    assert not rep.ok and any(e.startswith("data.train: data missing") for e in rep.errors)
    assert validate.main([str(QWEN), "--offline", "--strict"]) == 1
    assert "ERROR    data.train: data missing" in capsys.readouterr().out
    assert validate.main([str(QWEN), "--offline"]) == 0


def test_known_sizes_and_deepspeed_estimate():
    """Parameter counts of the offline table equal the published totals; the memory line is DeepSpeed's."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    rep = validate.validate_recipe(CONFIGS / "scale" / "llama3-70b-4x8.yaml", offline=True)
    assert rep.numbers["params"] == 70_553_706_496
    _, gpu, _ = estimate_zero3_model_states_mem_needs(
        total_params=rep.numbers["params"], largest_layer_params=rep.numbers["largest_layer_params"],
        num_gpus_per_node=8, num_nodes=4, cpu_offload=False, cpu_offload_params=False, zero_init=True)
    assert rep.numbers["gpu_mem_bytes"] == gpu
    assert validate.validate_recipe(QWEN, offline=True).numbers["params"] == 1_543_714_304


def test_parameter_count_equals_a_real_model(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    recipe = load_recipe(DEMO)
    cfg = dict(recipe.model.config)
    real = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    total, largest = count_parameters(real.config)
    assert total == sum(p.numel() for p in real.parameters())
    assert largest == max(p.numel() for p in real.parameters())


@pytest.mark.parametrize("override, key", [
    ("train.stepz=3", "train.stepz"),                               # unknown key
    ("optim.lr=fast", "optim.lr"),                                  # wrong type
    ("model.dtype=float16", "model.dtype"),                         # bad choice
    ("eval.answer_format=date", "eval.answer_format"),
    ("loss.objective={terms: {smmd2: {}}}", "loss.objective"),      # unknown term
    ("loss.objective={terms: {smmd: {sigmaz: [1.0]}}}", "loss.objective"),  # unknown term option
])
def test_bad_recipes_do_not_load_and_name_the_key(override, key, capsys):
    rep = validate.validate_recipe(DEMO, [override], offline=True)
    assert not rep.ok and key in rep.errors[0], rep.errors
    assert validate.main([str(DEMO), override, "--offline"]) == 2
    assert key in capsys.readouterr().out


@pytest.mark.parametrize("overrides, key", [
    (["train.global_batch_size=63"], "train.global_batch_size"),
    (["deepspeed.tp_size=3"], "deepspeed.tp_size"),
    (["loss.numeric_policy=integers", "loss.objective={terms: {ntil: 0.3}}"], "loss.objective.terms.ntil"),
])
def test_inconsistent_recipes_are_errors_naming_the_key(overrides, key, capsys):
    rep = validate.validate_recipe(QWEN, overrides, offline=True, size=False)
    assert not rep.ok and any(e.startswith(key) for e in rep.errors), rep.errors
    # a layout the cluster cannot take (TP spanning nodes) exits 2, other errors 1
    assert validate.main([str(QWEN), *overrides, "--offline"]) == (2 if key == "deepspeed.tp_size" else 1)


def test_batch_arithmetic_counts_data_parallel_ranks_after_tp():
    tp8 = CONFIGS / "scale" / "llama3-70b-8x8-tp8.yaml"
    rep = validate.validate_recipe(tp8, offline=True, size=False)
    assert rep.ok and rep.numbers["effective_batch"] == 64
    assert any("AutoTP + ZeRO-3" in w for w in rep.warnings)
    rep = validate.validate_recipe(tp8, ["deepspeed.tp_size=1"], offline=True, size=False)  # now 64 DP ranks: 512
    assert any("train.global_batch_size: 64 != " in e and "(= 512)" in e for e in rep.errors)


def test_built_data_is_checked_against_the_recipe(rec_data_dir, rec_tokenizer_dir):
    base = [f"data.train={rec_data_dir}", f"data.eval={rec_data_dir}", f"model.tokenizer={rec_tokenizer_dir}",
            "train.micro_batch_size=4", "train.global_batch_size=8", "train.steps=3",  # 24 rows: 3 steps of 8
            "model.config.vocab_size=512"]  # the test tokenizer's 388 tokens fit
    rep = validate.validate_recipe(DEMO, base, offline=True, strict=True, size=False)
    assert rep.ok and not rep.warnings, rep.render()
    rep = validate.validate_recipe(DEMO, base + ["loss.numeric_policy=integers"], offline=True, size=False)
    assert any(e.startswith("loss.numeric_policy") for e in rep.errors)


def test_cpu_recipes_count_their_ranks_from_cpu_ranks_per_node():
    rep = validate.validate_recipe(DEMO, offline=True, size=False)  # 1 node x 2 CPU ranks x 32 rows
    assert rep.numbers["effective_batch"] == 64 and not rep.errors
    rep = validate.validate_recipe(DEMO, ["cluster.cpu_ranks_per_node=4", "train.global_batch_size=128"], offline=True,
                            size=False)
    assert rep.numbers["effective_batch"] == 128 and not rep.errors
    rep = validate.validate_recipe(DEMO, ["cluster.cpu_ranks_per_node=4"], offline=True, size=False)
    assert any(e.startswith("train.global_batch_size: 64 != micro_batch_size 32 x grad_accum 1 x data-parallel 4")
               for e in rep.errors), rep.errors
    rep = validate.validate_recipe(DEMO, ["deepspeed.tp_size=2", "cluster.cpu_ranks_per_node=3"], offline=True, size=False)
    assert any(e.startswith("deepspeed.tp_size: 2 does not divide cluster.cpu_ranks_per_node 3") for e in rep.errors)
    rep = validate.validate_recipe(DEMO, ["cluster.cpu_ranks_per_node=0"], offline=True, size=False)
    assert not rep.ok and "cluster.cpu_ranks_per_node" in rep.errors[0]


def test_chunked_head_note_names_the_head_to_use():
    from types import SimpleNamespace

    def recipe(head, micro, seq):
        return SimpleNamespace(loss=SimpleNamespace(head=head), train=SimpleNamespace(micro_batch_size=micro),
                               data=SimpleNamespace(seq_len=seq))

    rep = validate.Report("r")
    for hidden in (8192, 4096):  # H = 8 T, 4 T: d W dominates
        rep = validate.Report("r")
        validate.chunked_head_note(rep, recipe("chunked", 1, 1024), hidden_size=hidden)
        assert len(rep.warnings) == 1 and "loss.head: logits" in rep.warnings[0]
    for head, micro, seq in (("chunked", 4, 1024), ("chunked", 1, 4096), ("logits", 1, 1024), ("chunked", 1, None)):
        rep = validate.Report("r")
        validate.chunked_head_note(rep, recipe(head, micro, seq), hidden_size=8192)
        assert rep.warnings == [], (head, micro, seq)


def test_memory_is_planned_against_the_usable_part_of_the_device():
    """An 80 GB GPU shows torch 79.1 GiB, and 10 % of that is kept for fragmentation: a plan between 71.2
    and 79.1 GiB (about 75 GiB: the 8B Megatron recipe at 2 rows of 1280-1400 tokens) fits the device
    but is refused, naming the usable 71.19 GiB; a 141 GB H200 (139.8 GiB, 125.8 usable) takes it."""
    from recipes.planning.device_memory import device_memory

    assert device_memory(80).usable_gib == pytest.approx(79.1 * 0.9)  # 71.19
    assert device_memory(141).usable_gib == pytest.approx(139.8 * 0.9)  # 125.82
    assert device_memory(100).usable_gib == pytest.approx(90.0)  # any other size: what torch shows
    meg8 = CONFIGS / "llama3-8b-gsm8k" / "megatron.yaml"
    two_rows = ["train.micro_batch_size=2", "train.grad_accum=4"]
    for seq in range(1024, 2049, 64):  # the plan's memory grows with the rows: find one between the two
        rep = validate.validate_recipe(meg8, two_rows, offline=True, seq_len=seq, gpu_mem_gb=80)
        if 71.19 * 2**30 < rep.numbers["gpu_total_bytes"] < 79.1 * 2**30:
            break
    else:
        pytest.fail("no row length gives a plan between 71.19 and 79.1 GiB")
    assert any(e.startswith("memory:") and "71.19 GiB" in e for e in rep.errors), rep.render()
    assert dict(rep.info)["GPU memory"].startswith("a GPU sold as 80 GB: torch sees 79.1 GiB; the plan may fill "
                                                   "71.2 GiB (10% kept for allocator fragmentation")
    assert rep.numbers["gpu_usable_bytes"] == int(79.1 * 0.9 * 2**30)
    assert validate.validate_recipe(meg8, two_rows, offline=True, seq_len=seq, gpu_mem_gb=141).ok


def test_every_engine_has_a_report_and_a_runtime():
    """validate prints each engine's plan through its contract's report lines, and the names of its runtime
    objects resolve: the engine class of that name, the converter where it has one."""
    from recipes.engines import ENGINES
    from recipes.engines.runtime import runtime_object

    for name, contract in ENGINES.items():
        assert callable(contract.report.add_plan) and callable(contract.report.layout_line)
        assert contract.report.__name__.startswith(f"recipes.engines.{name}.")
        assert runtime_object(contract.runtime_class).name == name
        assert contract.converter is None or callable(runtime_object(contract.converter))
