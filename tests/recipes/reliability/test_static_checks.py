"""Issue 38: every check that needs only the recipe, the manifest and the model's config runs before any model
is built (`recipes.checks.preflight.preflight`, on every rank of `recipes.train`, and `recipes.validate`).

Each case is a fault that used to surface after the model was built (exit 1, a traceback, some without
a shard or row): data built with a Llama-3-sized tokenizer (128,256 tokens, assembled offline) against
a model config whose vocabulary, positions or heads do not fit it; a row whose labels are one short; a
data.seq_len below the longest row; data with no scored label; a TP that does not divide the KV heads or
a PP the layers on Megatron, on a CPU recipe too; LoRA resuming onto another data-parallel size; settings
the engine ignores. The expected places (shard, row, record) are read from the Parquet files here, not
from the manifest's statistics.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.stats import write_stats
from recipes.config import recipe_from_dict
from recipes.checks import preflight as checks
from recipes.validation import validate as V
from recipes.checks.model_checks import context_limit

REPO = Path(__file__).resolve().parents[3]
VOCAB = 128_256


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """A 128,256-token Llama-3-like tokenizer, 24 arithmetic rows built with it, and that tokenizer loaded."""
    from transformers import AutoTokenizer

    from data_prep import BuildConfig, ShardConfig, SourceConfig, TokenizeConfig, build
    from recipes.experiments.real_tokenizers import assemble_tokenizer

    root = tmp_path_factory.mktemp("static_checks")
    tok = assemble_tokenizer(str(root / "tok"), "llama3")
    build(BuildConfig(sources=[SourceConfig("arithmetic", options={"n": 24, "max_digits": 3})],
                      tokenize=TokenizeConfig(tok, max_length=64),
                      shards=ShardConfig(shard_bytes=3000, row_group_rows=8)),
          str(root / "data"), workers=0, progress=False)
    return {"root": root, "tok": tok, "data": root / "data", "tokenizer": AutoTokenizer.from_pretrained(tok)}


def _recipe(real, *overrides, data=None):
    """A tiny Llama (vocabulary 128,256) on `data` (default: the built rows): 24 rows, a global batch of 8."""
    base = {"name": "checks", "model": {"config": {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 16,
                                                   "intermediate_size": 32, "num_hidden_layers": 4,
                                                   "num_attention_heads": 4, "num_key_value_heads": 2,
                                                   "max_position_embeddings": 128},
                                        "tokenizer": real["tok"], "dtype": "float32"},
            "data": {"train": str(data or real["data"])},
            "train": {"steps": 3, "micro_batch_size": 4, "out_dir": str(real["root"] / "run")}}
    return recipe_from_dict(base, list(overrides))


def _refused(real, recipe, world_size=2) -> str:
    with pytest.raises(checks.RecipeCheckError) as err:
        checks.preflight(recipe, world_size, tokenizer=real["tokenizer"])
    return str(err.value)


def _rows(path) -> list[dict]:
    return pq.read_table(path).to_pylist()


def _copy_with(real, tmp_path, change) -> Path:
    """The built data copied, every shard's rows passed through `change(shard_file, rows)`, its statistics
    recomputed (`python -m data_prep stats`' pass), as data another tool wrote would be."""
    data = tmp_path / "data"
    shutil.copytree(real["data"], data)
    manifest = json.loads((data / "manifest.json").read_text())
    for shard in manifest["shards"]:
        path = data / shard["file"]
        f = pq.ParquetFile(path)
        rows = change(shard["file"], f.read().to_pylist())
        pq.write_table(pa.Table.from_pylist(rows, schema=f.schema_arrow), path, row_group_size=8)
        shard["bytes"] = os.path.getsize(path)
        del shard["stats"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    assert write_stats(str(data)) == len(manifest["shards"])
    return data


def test_the_recipe_passes(real):
    lines = checks.preflight(_recipe(real), 2, tokenizer=real["tokenizer"])
    assert lines == ["3 steps x 8 rows = 1 epochs of 24 rows (3 steps each)"]


def test_seq_len_below_the_longest_row_names_its_shard_and_row(real):
    n = max(len(r["input_ids"]) for s in real["data"].glob("shard-*.parquet") for r in _rows(s))
    message = _refused(real, _recipe(real, f"data.seq_len={n - 1}"))
    m = re.search(rf"data.seq_len: {n - 1} is shorter than the longest row of {re.escape(str(real['data']))}, {n} "
                  rf"tokens at {re.escape(str(real['data']))}/(shard-\d+\.parquet) row (\d+) \(record (\d+)\)", message)
    assert m, message
    row = _rows(real["data"] / m[1])[int(m[2])]  # the row named is one of the longest
    assert len(row["input_ids"]) == n and row["record"] == int(m[3])
    checks.preflight(_recipe(real, f"data.seq_len={n}"), 2, tokenizer=real["tokenizer"])


def test_rows_past_the_models_positions_are_refused_and_rope_scaling_counts(real):
    message = _refused(real, _recipe(real, "model.config.max_position_embeddings=16"))
    assert "has rows that use" in message and "more than the model's 16 (max_position_embeddings 16)" in message
    scaled = _recipe(real, "model.config.max_position_embeddings=16",
                     "model.config.rope_scaling={rope_type: linear, factor: 4.0}")  # 64 positions
    checks.preflight(scaled, 2, tokenizer=real["tokenizer"])
    message = _refused(real, _recipe(real, "data.seq_len=256"))
    assert "data.seq_len: 256 is more than the model's 128 positions" in message


def test_context_limit_reads_both_rope_conventions():
    from transformers import AutoConfig

    llama31 = AutoConfig.for_model("llama", max_position_embeddings=131072, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    qwen_yarn = AutoConfig.for_model("qwen2", max_position_embeddings=32768, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert context_limit(llama31)[0] == 131072  # written extended: 16 x 8192, not 8 x 8192
    assert context_limit(qwen_yarn)[0] == 131072  # written original: 4 x 32768
    assert context_limit(AutoConfig.for_model("gpt2", n_positions=1024))[0] == 1024


def test_a_vocabulary_smaller_than_the_tokenizer_and_its_labels_is_refused(real):
    message = _refused(real, _recipe(real, "model.config.vocab_size=128000"))
    assert f"model.tokenizer: {VOCAB} tokens, but the model's embedding and logits have vocab_size 128000" in message
    eos = real["tokenizer"].convert_tokens_to_ids("<|end_of_text|>")  # 128,001: the rows' last label
    assert f"data.train: label {eos} at {real['data']}/shard-" in message
    assert "is outside the model's vocabulary [0, 128000)" in message


def test_a_label_outside_the_vocabulary_names_shard_row_and_position(real, tmp_path):
    def plant(file, rows):
        if file == "shard-00001.parquet":
            rows[3]["labels"][5] = VOCAB + 7
        return rows

    data = _copy_with(real, tmp_path, plant)
    record = _rows(data / "shard-00001.parquet")[3]["record"]
    message = _refused(real, _recipe(real, data=data))
    assert (f"data.train: label {VOCAB + 7} at {data}/shard-00001.parquet row 3 (record {record}), position 5 is "
            f"outside the model's vocabulary [0, {VOCAB})") in message


def test_a_row_whose_labels_are_one_short_is_refused_naming_it(real, tmp_path):
    def shorten(file, rows):
        if file == "shard-00000.parquet":
            rows[2]["labels"].pop()
        return rows

    data = _copy_with(real, tmp_path, shorten)
    n = len(_rows(data / "shard-00000.parquet")[2]["input_ids"])
    message = _refused(real, _recipe(real, data=data))
    assert (f"{data}/shard-00000.parquet row 2 (record {_rows(data / 'shard-00000.parquet')[2]['record']}): its "
            f"per-token columns differ in length (input_ids {n}, labels {n - 1}, num_tokens {n}, numeric_mask {n})"
            in message)


def test_data_without_a_scored_label_is_refused(real, tmp_path):
    def unlabel(file, rows):
        for r in rows:
            r["labels"] = [-100] * len(r["labels"])
        return rows

    message = _refused(real, _recipe(real, data=_copy_with(real, tmp_path, unlabel)))
    assert "data.train: no row of" in message and "has a scored label" in message


@pytest.mark.parametrize("overrides, world, expected", [
    (["megatron.tp_size=4"], 8, "megatron.tp_size: 4 does not divide the model's 2 KV heads (query groups)"),
    (["megatron.pp_size=3"], 6, "megatron.pp_size x megatron.virtual_pp_size: 3 x 1 does not divide the model's 4 layers"),
    (["megatron.pp_size=2", "megatron.virtual_pp_size=4", "train.grad_accum=2"], 2,
     "megatron.pp_size x megatron.virtual_pp_size: 2 x 4 does not divide the model's 4 layers"),
    (["megatron.tp_size=2"], 3, "megatron.tp_size x megatron.pp_size: 2 x 1 does not divide the world of 3 ranks"),
    (["megatron.tp_size=3", "model.config.num_attention_heads=6", "model.config.num_key_value_heads=6",
      "model.config.hidden_size=18", "model.config.intermediate_size=32"], 3,
     "megatron.tp_size: 3 does not divide the model's 32 intermediate size"),
])
def test_megatron_layouts_the_model_cannot_take_are_refused(real, overrides, world, expected):
    recipe = _recipe(real, "train.engine=megatron", *overrides)
    assert expected in _refused(real, recipe, world)
    cpu = [f"cluster.cpu_ranks_per_node={world}", "cluster.gpus_per_node=0"]  # recipes.validate, a CPU recipe
    rep = V.validate_recipe(REPO / "recipes/configs/demo.yaml", [
        f"model.tokenizer={real['tok']}", f"data.train={real['data']}", "train.engine=megatron",
        "train.micro_batch_size=4", "train.global_batch_size=null", "data.eval=null", "model.config.vocab_size=128256",
        "model.config.num_hidden_layers=4", "model.config.num_key_value_heads=2", "model.config.intermediate_size=32",
        *overrides, *cpu], offline=True, size=False)
    key = expected.split(":")[0]  # validate words the world's error after the recipe's cluster section
    assert any(e.startswith(key) for e in rep.errors), rep.render()


def test_autotp_with_fewer_kv_heads_than_ranks_under_zero3_is_refused(real):
    message = _refused(real, _recipe(real, "deepspeed.tp_size=4", "train.micro_batch_size=2"), 4)
    assert "deepspeed.tp_size: the model has 2 KV heads, fewer than tp_size 4" in message
    checks.preflight(_recipe(real, "deepspeed.tp_size=4", "train.micro_batch_size=2", "deepspeed.zero_stage=2"), 4,
                     tokenizer=real["tokenizer"])  # AutoTP splits unevenly at ZeRO 0-2
    assert "deepspeed.tp_size: 2 does not divide the world of 3 ranks" in _refused(
        real, _recipe(real, "deepspeed.tp_size=2"), 3)


def _checkpoint(out_dir: Path, layout: dict) -> None:
    """A run directory whose latest checkpoint recorded `layout` (as recipes.reliability.checkpoints writes it)."""
    step = out_dir / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (step / "layout.json").write_text(json.dumps(layout))
    (out_dir / "checkpoints" / "latest").write_text("step_00000002")


def test_lora_resume_onto_another_data_parallel_size_is_refused_before_the_base_loads(real, tmp_path):
    _checkpoint(tmp_path / "run", {"data_parallel": 2, "tensor_parallel": 1, "zero_stage": 3, "lora": True})
    lora = _recipe(real, f"train.out_dir={tmp_path / 'run'}", "model.lora={r: 4}")
    message = _refused(real, lora, world_size=4)
    assert f"model.lora: {tmp_path / 'run/checkpoints/step_00000002'} was saved on 2 data-parallel ranks" in message
    assert "(this run has 4)" in message
    checks.preflight(lora, 2, tokenizer=real["tokenizer"])  # the same size resumes
    full = _recipe(real, f"train.out_dir={tmp_path / 'run'}")  # a full fine-tune onto a LoRA checkpoint
    assert "model.lora: " in (message := _refused(real, full, world_size=2)) and "lora=True; this run has None" in message
    megatron = _recipe(real, f"train.out_dir={tmp_path / 'run'}", "train.engine=megatron")
    assert "was saved by the deepspeed engine" in _refused(real, megatron, world_size=2)


def test_settings_the_engine_would_ignore_are_refused_or_mapped(real):
    message = _refused(real, _recipe(real, "train.engine=megatron", "deepspeed.offload_optimizer=true",
                                     "model.attn_implementation=sdpa"))
    assert "deepspeed.offload_optimizer: True is read by the deepspeed engine only" in message
    assert "model.attn_implementation: 'sdpa' is a Hugging Face attention kernel" in message
    # selective recomputation has no Hugging Face equivalent; full is gradient checkpointing (mapped)
    message = _refused(real, _recipe(real, "megatron.recompute=selective"))  # on DeepSpeed
    assert "megatron.recompute: 'selective' is read by the megatron engine only" in message
    assert "instead: model.gradient_checkpointing" in message
    full = _recipe(real, "megatron.recompute=full")
    lines = checks.preflight(full, 2, tokenizer=real["tokenizer"])
    assert full.model.gradient_checkpointing and full.megatron.recompute is None
    assert any("sets model.gradient_checkpointing: true" in line for line in lines)
    mapped = _recipe(real, "train.engine=megatron", "model.gradient_checkpointing=true")
    lines = checks.preflight(mapped, 2, tokenizer=real["tokenizer"])
    assert mapped.megatron.recompute == "full" and not mapped.model.gradient_checkpointing
    assert any("sets megatron.recompute: full" in line for line in lines)


def test_train_refuses_all_of_them_at_once_with_status_2_before_building_anything(real, tmp_path):
    """`python -m recipes.train` lists every error, exits 2 within seconds, builds no engine and writes
    nothing: out_dir names a file (left as it was), the vocabulary and positions do not fit the data."""
    (tmp_path / "recipe.yaml").write_text(json.dumps({
        "model": {"config": {"model_type": "llama", "vocab_size": 128000, "hidden_size": 16, "intermediate_size": 32,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "max_position_embeddings": 16}, "tokenizer": real["tok"], "dtype": "float32"},
        "data": {"train": str(real["data"]), "seq_len": 8}, "train": {"steps": 2, "micro_batch_size": 4}}))
    (tmp_path / "out").write_text("a file\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "recipes.train", str(tmp_path / "recipe.yaml"),
                           f"train.out_dir={tmp_path / 'out'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    for key in (f"train.out_dir: {tmp_path / 'out'} is a file", "model.tokenizer: 128256 tokens", "data.seq_len: 8 is "
                "shorter than the longest row", "is outside the model's vocabulary [0, 128000)",
                "more than the model's 16 (max_position_embeddings 16)"):
        assert key in proc.stderr, (key, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "[numloss] engine" not in proc.stdout
    assert (tmp_path / "out").read_text() == "a file\n"
    assert time.time() - started < 120


def test_a_manifest_without_statistics_is_scanned_or_refused_with_the_command(real, tmp_path, monkeypatch):
    """Data built before the statistics: scanned at start-up (a line per shard) and checked the same; above
    the scan limit, refused naming the one command that records them."""
    from recipes.checks import data_checks

    data = tmp_path / "old"
    shutil.copytree(real["data"], data)
    manifest = json.loads((data / "manifest.json").read_text())
    for shard in manifest["shards"]:
        del shard["stats"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    said: list[str] = []
    lines = checks.preflight(_recipe(real, data=data), 2, tokenizer=real["tokenizer"], say=said.append)
    shards = len(manifest["shards"])
    assert any("no per-shard token statistics" in line and f"scanned its {shards} shards" in line
               and f"`python -m data_prep stats {data}` records them once" in line for line in lines), lines
    assert len(said) == shards and all(line.startswith(f"scanning {data}/shard-") for line in said)
    assert "data.seq_len: 8 is shorter than the longest row" in _refused(real, _recipe(real, "data.seq_len=8", data=data))
    monkeypatch.setattr(data_checks, "SCAN_LIMIT_BYTES", 0)
    assert f"run `python -m data_prep stats {data}` once" in _refused(real, _recipe(real, data=data))
    assert "stats" not in json.loads((data / "manifest.json").read_text())["shards"][0]  # never written here
