"""The Trainer integration's layout check on 2 real processes (gloo, `tests.distributed.run_ranks`: a
process group made by hand, as `mp.spawn` + `init_process_group` scripts make it), and the install hint
of a missing TRL.

- without WORLD_SIZE / RANK in the environment the Trainer believes it is alone (world size 1) beside a
  group of 2, over which the step's counts are summed: the first step raises on both processes, naming
  the Trainer's world size and index and torch.distributed's (before the check each process trained on
  its own and logged the loss over the other's counts too, with no error);
- with the variables set (what torchrun sets) the same script trains and logs the objective of the
  whole global batch and its gradient's norm, computed by hand in one forward at the initial weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("trl")

from tests.distributed import run_ranks  # noqa: E402
from tests.numloss.integrations import hf_trainer_helpers as H  # noqa: E402
from tests.numloss.integrations.hf_trainer_ranks import layout_rank  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tok")
    H.tokenizer(path).save_pretrained(str(path))
    return path


def _run(tok_dir, out, launched: bool) -> list[dict]:
    run_ranks(2, layout_rank, str(tok_dir), str(out), launched, timeout=240)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_a_trainer_that_does_not_see_the_process_group_is_refused_at_the_first_step(tok_dir, tmp_path):
    results = _run(tok_dir, tmp_path, launched=False)
    for rank, result in enumerate(results):
        assert "error" in result, (rank, result)
        message = result["error"]
        assert "does not match the process group" in message
        for r in range(2):  # every process's pair of values, on every process
            assert (f"process {r}: the Trainer (accelerate) has world size 1, process index 0, but"
                    f" torch.distributed has world size 2, rank {r}") in message, message


def test_the_same_script_launched_with_its_layout_trains_on_the_whole_global_batch(tok_dir, tmp_path):
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq

    from numloss import NumericVocab

    results = _run(tok_dir, tmp_path, launched=True)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    initial = H.model(tok)
    initial.load_state_dict(torch.load(tmp_path / "rank0" / "init.pt"))
    vocab = NumericVocab.from_tokenizer(tok, policy="digits")
    want = H.whole_batch_objective(initial, vocab, H.SPEC,
                                   DataCollatorForSeq2Seq(tok, label_pad_token_id=-100)(H.rows(tok, 4)))
    for result in results:
        assert result.get("world_size") == 2, result
        logged = result["log_history"][0]
        for key in ("loss", "ce", "term/smmd", "term/ntl_was", "numeric_positions", "grad_norm"):
            assert logged[key] == pytest.approx(want[key], rel=1e-5), (key, logged[key], want[key])


def test_without_trl_the_sft_trainer_names_the_extra_to_install():
    code = ("import sys; sys.modules['trl'] = None\n"  # `import trl` now raises ImportError, as when missing
            "from numloss.integrations import hf_trainer\n"
            "try:\n    hf_trainer.NumericSFTTrainer\n"
            "except ImportError as err:\n    print(err)\nelse:\n    raise SystemExit('no ImportError')\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=H.REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(H.REPO)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "NumericSFTTrainer needs TRL's SFTTrainer" in run.stdout and "pip install -e '.[hf]' in a clone of numloss" in run.stdout


def test_deepspeed_through_the_trainer_trains_the_global_batch_and_its_accumulation_is_checked(tok_dir, tmp_path):
    """ZeRO-2 in one process (the Trainer's DeepSpeed path, which steps the optimizer on DeepSpeed's own
    accumulation boundary): at accumulation 2 the logged loss and gradient norm are the whole batch's;
    a gradient_accumulation_steps changed on trainer.args after the trainer was made (DeepSpeed's config
    kept 1, so it would step after every micro-batch on counts of two) is refused naming both."""
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq

    from numloss import NumericVocab
    from tests.numloss.integrations.hf_trainer_ranks import deepspeed_rank

    run_ranks(1, deepspeed_rank, str(tok_dir), str(tmp_path), timeout=240)
    result = json.loads((tmp_path / "deepspeed.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    initial = H.model(tok)
    initial.load_state_dict(torch.load(tmp_path / "init.pt"))
    want = H.whole_batch_objective(initial, NumericVocab.from_tokenizer(tok, policy="digits"), H.SPEC,
                                   DataCollatorForSeq2Seq(tok, label_pad_token_id=-100)(H.rows(tok, 4)))
    logged = result["trained"]["log_history"][0]
    for key in ("loss", "ce", "term/smmd", "term/ntl_was", "numeric_positions", "grad_norm"):
        assert logged[key] == pytest.approx(want[key], rel=1e-5), (key, logged[key], want[key])
    assert "DeepSpeed steps every 1 micro-batches but the Trainer's gradient_accumulation_steps is 2" \
        in result["changed"]["error"], result["changed"]


@pytest.mark.parametrize("sizes, named", [({"sp_size": 2, "sp_backend": "deepspeed"}, "sp_size 2"),
                                          ({"cp_size": 2}, "cp_size 2")])
def test_a_parallelism_config_that_splits_rows_is_refused_at_construction(tok_dir, tmp_path, sizes, named):
    """accelerate's sequence-parallel backend hands each rank its slice of `shift_labels` only: the whole rows'
    labels that numbers and sequences are counted from are on no rank. Refused before the Trainer is made
    (accelerate alone would say only that the config needs a distributed type), naming what to use."""
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import AutoTokenizer, TrainingArguments

    from numloss import NumericVocab
    from numloss.integrations.hf_trainer import NumericTrainer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[],
                             parallelism_config=ParallelismConfig(**sizes))
    vocab = NumericVocab.from_tokenizer(tok, policy="digits")
    with pytest.raises(ValueError, match=f"parallelism_config with {named} .* deepspeed.sp_size"):
        NumericTrainer(model=H.model(tok), args=args, train_dataset=H.rows(tok, 4), numeric_vocab=vocab)
