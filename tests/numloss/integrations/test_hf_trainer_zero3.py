"""The Trainer integration under DeepSpeed ZeRO-3 on 2 processes (gloo): the objective is computed from
hidden states inside the model's forward (`numloss.integrations.trainer_head`), where the LM head's weight
is a shard until ZeRO-3 gathers it for that forward and its backward. With micro-batch 1 x accumulation 2
per rank and one micro-batch without any label (its rank runs the head on no labelled position), the run
finishes, and the first step's logged loss, terms and gradient norm equal the whole global batch's
objective computed by hand in one forward at the initial weights, for an untied and a tied LM head."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from tests.distributed import run_ranks  # noqa: E402
from tests.numloss.integrations import hf_trainer_helpers as H  # noqa: E402
from tests.numloss.integrations.hf_trainer_ranks import zero3_rank  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.mark.timeout(600)
def test_zero3_through_the_trainer_trains_the_global_batch_with_a_gathered_head(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, DataCollatorForSeq2Seq

    from numloss import NumericVocab
    from recipes.experiments.tiny import tiny_llama_config

    tok = H.tokenizer(tmp_path / "tok")
    tok.save_pretrained(str(tmp_path / "tok"))
    run_ranks(2, zero3_rank, str(tmp_path / "tok"), str(tmp_path), timeout=540)
    result = json.loads((tmp_path / "zero3.json").read_text())
    rows = H.rows(tok, 4)
    rows[2]["labels"] = [-100] * len(rows[2]["labels"])
    batch = DataCollatorForSeq2Seq(tok, label_pad_token_id=-100)(rows)
    vocab = NumericVocab.from_tokenizer(tok, policy="digits")
    for tied in (False, True):
        spec = dict(tiny_llama_config(len(tok)), tie_word_embeddings=tied)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.pop("model_type"), **spec),
                                                 dtype=torch.float32)
        model.load_state_dict(torch.load(tmp_path / f"init_tied{tied}.pt"))
        want = H.whole_batch_objective(model, vocab, H.SPEC, batch)
        logged = result[f"tied{tied}"][0]
        for key in ("loss", "ce", "term/smmd", "term/ntl_was", "numeric_positions", "grad_norm"):
            assert logged[key] == pytest.approx(want[key], rel=1e-5), (tied, key, logged[key], want[key])
