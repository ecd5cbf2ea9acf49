"""recipes.evaluation.generation: stop strings per task, the length from the data, the HF backend's cut."""

import pyarrow.parquet as pq
import pytest

from recipes.config import recipe_from_dict

from recipes.sections import EVAL_STOP, EvalSection
from recipes.evaluation import evaluate as E
from recipes.evaluation import generation as G

# a string the tiny random model writes often and the arithmetic targets never hold
RANDOM_MODEL_WORD = "degrees"


def _capture(calls):
    def generate(model, tokenizer, rows, **kwargs):
        calls.append(kwargs)
        return [f"{r['answer']:g}" for r in rows]
    return generate


def _longest_target(data_dir):
    manifest = E.read_manifest(data_dir)
    longest = 0
    for shard in manifest["shards"]:
        for labels in pq.read_table(f"{data_dir}/{shard['file']}", columns=["labels"]).column("labels").to_pylist():
            longest = max(longest, sum(lab != -100 for lab in labels))
    return longest


def test_stops_and_length_come_from_the_tasks_and_the_data(rec_data_dir, rec_tokenizer_dir):
    from transformers import AutoTokenizer

    calls = []
    tok = AutoTokenizer.from_pretrained(rec_tokenizer_dir)
    res = E.evaluate("unused", rec_data_dir, model_and_tokenizer=(None, tok), generate=_capture(calls))
    longest = _longest_target(rec_data_dir)
    assert 0 < longest < 16  # arithmetic answers: the floor of 16 applies
    assert calls[0]["max_new_tokens"] == 16 and calls[0]["stop"] == ("\n",) == tuple(EVAL_STOP["arithmetic"])
    assert calls[0]["stop_ids"] == (tok.eos_token_id,)
    settings = res["settings"]
    assert settings["tasks"] == ["arithmetic"] and settings["stop"] == ["\n"] and settings["max_new_tokens"] == 16
    assert settings["backend"] == "hf" and settings["decoding"] == "greedy" and settings["data_parallel_ranks"] == 1
    assert res["metrics"]["exact_match"] == 1.0


def test_default_length_fits_chain_of_thought_targets():
    rows = [{"labels": [-100] * 5 + [1] * n} for n in (40, 300, 7)]
    assert G.default_max_new_tokens(rows) == 300 + 150
    assert G.default_max_new_tokens([{"labels": [-100, 1]}]) == G.MIN_NEW_TOKENS


def test_a_stop_string_inside_a_gold_target_is_refused_before_generating(rec_data_dir, rec_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rec_tokenizer_dir)

    def never(*args, **kwargs):
        raise AssertionError("generated although a stop string cuts a gold answer")

    section = EvalSection(stop={"arithmetic": ["1"]})
    with pytest.raises(ValueError, match=r"stop string '1' occurs in the gold target of example .*eval.stop"):
        E.evaluate("unused", rec_data_dir, model_and_tokenizer=(None, tok), generate=never, eval_section=section)


def test_recipe_stop_overrides_one_task_and_keeps_the_others():
    section = recipe_from_dict({"model": {"name_or_path": "x"}, "data": {"train": "d"}, "eval": {"stop": {"gsm8k": ["Q:"]}}}).eval
    assert section.stop_for("gsm8k") == ["Q:"] and section.stop_for("arithmetic") == ["\n"]
    assert section.stop_for("generic") == []  # EOS only
    assert G.stop_strings(["gsm8k", "arithmetic", "svamp"], section) == ("Q:", "\n", "Question:", "</s>", "<|im_end|>")
    for bad, message in [({"stop": {"gsm8k": "Q:"}}, "eval.stop.gsm8k"), ({"backend": "tgi"}, "eval.backend"),
                         ({"max_new_tokens": 0}, "eval.max_new_tokens")]:
        with pytest.raises(ValueError, match=message):
            recipe_from_dict({"model": {"name_or_path": "x"}, "data": {"train": "d"}, "eval": bad})


def test_cut_at_stop():
    assert G.cut_at_stop("18\n\nQuestion: 5", ["Question:", "\n\n"]) == "18"
    assert G.cut_at_stop("no stop here", ["Q:"]) == "no stop here"
    assert G.cut_at_stop("abc", []) == "abc"


def test_hf_generation_stops_at_the_stop_string(rec_model_dir, rec_data_dir):
    model, tok, _ = E.load_model(rec_model_dir)
    rows = E.load_rows(rec_data_dir, limit=12)
    free = E.generate_texts(model, tok, rows, batch_size=5, max_new_tokens=12)
    stopped = E.generate_texts(model, tok, rows, batch_size=5, max_new_tokens=12, stop=[RANDOM_MODEL_WORD])
    assert sum(RANDOM_MODEL_WORD in t for t in free) >= 3  # the case is exercised
    assert stopped == [t.split(RANDOM_MODEL_WORD)[0] for t in free]
