"""The demo's path end to end at a tiny size: data split, tokenizer, training, decoding, outputs."""

import json
import math

import pytest
import torch

import numloss
from recipes import demo

TINY = dict(steps=40, batch_size=32, lr=3e-3, warmup=5, n_test=40, max_digits=1, hidden=64, layers=2, heads=2, log_every=20)


def test_problems_split_without_overlap():
    train, test = demo.make_problems(max_digits=2, ops="+-", n_test=300, seed=0)
    assert len(train) + len(test) == 2 * 100 * 100
    assert not {p for p, _, _ in train} & {p for p, _, _ in test}
    assert demo.make_problems(2, "+-", 300, 0)[1] == test  # fixed seed, same split
    for prompt, answer, value in test[:50]:
        a, op, b = prompt[:-1].partition("+") if "+" in prompt else prompt[:-1].partition("-")
        assert value == (int(a) + int(b) if op == "+" else int(a) - int(b)) and float(answer) == value


def test_tokenizer_is_character_level_with_ten_digit_tokens():
    train, _ = demo.make_problems(1, "+-", 10, 0)
    tok = demo.build_tokenizer([p + a for p, a, _ in train])
    assert len(tok.encode("12+-34=", add_special_tokens=False)) == 7
    vocab = numloss.NumericVocab.from_tokenizer(tok, policy="digits")
    assert vocab.size == 10 and sorted(vocab.values.tolist()) == list(range(10))


def test_collate_masks_prompt_and_padding():
    train, _ = demo.make_problems(2, "+", 10, 0)
    tok = demo.build_tokenizer([p + a for p, a, _ in train])
    examples = demo.encode_examples(tok, [("1+2=", "3", 3.0), ("10+20=", "30", 30.0)])
    input_ids, mask, pos, labels = demo.collate(examples, tok.pad_token_id)
    assert input_ids.shape == (2, 10)  # <bos> 1 0 + 2 0 = 3 0 <eos>
    assert mask[0].tolist() == [0] * 3 + [1] * 7 and pos[0].tolist() == [0] * 4 + [1, 2, 3, 4, 5, 6]
    assert tok.decode(labels[0][labels[0] != -100]) == "3<eos>"
    assert tok.decode(labels[1][labels[1] != -100]) == "30<eos>"


def test_batched_greedy_decoding_matches_one_by_one():
    train, _ = demo.make_problems(2, "+-", 10, 0)
    cfg = demo.DemoConfig(hidden=32, layers=1, heads=2)
    tok = demo.build_tokenizer([p + a for p, a, _ in train])
    torch.manual_seed(0)
    model = demo.build_model(cfg, tok)
    prompts = ["1+2=", "99-10=", "5-57=", "40+4="]  # different lengths: left padding in the batch
    batched = demo.greedy_answers(model, tok, prompts, max_new_tokens=4)
    single = [demo.greedy_answers(model, tok, [p], max_new_tokens=4)[0] for p in prompts]
    assert batched == single


@pytest.mark.timeout(120)
def test_run_demo_trains_both_objectives_and_writes_results(tmp_path):
    logged = []
    results = demo.run_demo(out_dir=tmp_path, log=logged.append, **TINY)
    assert set(results["runs"]) == {"CE", "CE+SMMD"}
    ce_run, smmd_run = results["runs"]["CE"], results["runs"]["CE+SMMD"]
    # same initial weights and the same first batch: the same CE at step 0
    assert ce_run["history"][0]["ce"] == pytest.approx(smmd_run["history"][0]["ce"], rel=1e-6)
    assert "term/smmd" in smmd_run["history"][0] and smmd_run["history"][0]["loss"] > smmd_run["history"][0]["ce"]
    for run in (ce_run, smmd_run):
        losses = [h["loss"] for h in run["history"]]
        assert len(losses) == TINY["steps"]
        assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
        m = run["metrics"]
        assert set(m) == {"n", "parse_rate", "exact_match", "mae", "r2"} and m["n"] == TINY["n_test"]
        assert 0 <= m["exact_match"] <= 1 and 0 <= m["parse_rate"] <= 1
        assert math.isfinite(run["held_out_ce"]) and run["samples"]
    assert any("step" in line for line in logged) and any("exact match" in line for line in logged)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["runs"]) == {"CE", "CE+SMMD"} and saved["config"]["steps"] == TINY["steps"]
    assert (tmp_path / "curves.png").stat().st_size > 1000
