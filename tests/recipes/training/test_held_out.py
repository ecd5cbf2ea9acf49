"""Evaluation during training (`eval.every`, recipes.training.held_out), in one process: the argmax over a
vocabulary split across 2 ranks, the teacher-forced answers' tokens and sums.

Through `python -m recipes.train` on both engines (the training unchanged to the bit, the eval/* values at
the steps asked for equal to an independent computation on the export, in TensorBoard, whole batches only):
test_eval_step_in_training.py, whose runs also serve the terms' scale check.
"""

from __future__ import annotations

import torch


def _argmax_ranks(rank, world):
    import torch.distributed as dist

    from recipes.training.held_out import vocab_parallel_argmax

    torch.manual_seed(0)
    full = torch.randint(-3, 4, (3, 5, 11)).float()  # small integers: many ties across the two ranks' columns
    full[0, 0, 10] = 100.0  # a padded column: never the answer
    widths = [6, 5]  # uneven split, ranks in order
    start = sum(widths[:rank])
    local = full[..., start:start + widths[rank]]
    got = vocab_parallel_argmax(local, group=dist.group.WORLD, real_vocab_size=10)
    assert torch.equal(got, full[..., :10].argmax(-1)), (got, full[..., :10].argmax(-1))


def test_vocab_parallel_argmax_equals_torch_argmax_over_the_whole_vocabulary():
    from tests.distributed import run_ranks

    run_ranks(2, _argmax_ranks)


def test_answer_tokens_and_sums():
    from types import SimpleNamespace

    from recipes.training.held_out import answer_sums, answer_tokens

    labels = torch.tensor([[-100, -100, 5, 6], [-100, 7, 8, -100]])
    predicted = torch.tensor([[0, 1, 5, 9], [3, 7, 4, 2]])
    assert answer_tokens(predicted, labels) == [[5, 9], [7, 4]]
    words = {1: "12", 2: "1,200", 3: "x", 4: "-3/4"}
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(words[i] for i in ids))
    # "12" right, "1,200" read as 1200 against 1000, "x" no number, "-3/4" right, a row without an answer
    sums = answer_sums([[1], [2], [3], [4], [1]], [12.0, 1000.0, 5.0, -0.75, float("nan")], tok)
    assert sums == {"n": 4.0, "hits": 2.0, "parsed": 3.0, "abs_error": 200.0}
