"""A run is finished only when `final/` holds its last step; an interrupted save or export is finished by the
same command (recipes/reliability/export_writer.py, resume_policy.py, checkpoints.py). Real torchrun jobs
of `recipes.train` on a tiny Llama, faults injected by tests/recipes/faults (a sitecustomize),
one run directory per engine, in order (DeepSpeed 5 launches of 2 ranks, Megatron 4 of 1):

1. 4 steps with export: `final/` records step 4.
2. The same run for 6 steps, saving every step; SIGTERM to torchrun and the rank while step 6's save is
   staged (SLURM's delivery): the save completes, exit 75 with the export not started; `final/` is still
   step 4's, whole. Step 6's save is the process's second: what its first started (Megatron: the
   checkpoint writers' manager, in the rank's process group, which torchrun signals) must outlive the
   stop request.
   A start that judged the run by `final/`'s presence alone would say "already finished", exit 0, and
   `final/` would keep the 4-step weights for good.
3. The same command sees step 6 trained but not exported and exports it, with rank 1 (Megatron: rank 0)
   SIGKILLed right after writing its export shard: `final/` is step 4's, whole, and loads.
4. DeepSpeed only (2 ranks): 8 steps (the start first removes the killed export's leftovers); at step 8's
   commit, after its checkpoint.json, SIGTERM and rank 0 stalls; torchrun's shutdown timeout (3 s)
   SIGKILLs the ranks mid-commit. `latest` still names step 6.
5. The same command (DeepSpeed 8 steps, Megatron 6): DeepSpeed commits the verified step 8 (not thrown
   away: the run would resume from 6) and trains nothing; Megatron removes the killed export's leftovers;
   both export the last step without training: `final/` loads with from_pretrained (weights and
   tokenizer) and its weights are that step's checkpoint read independently. The next start's decision
   (resume_policy.decide on the run's files) is "already finished".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

from tests.recipes.torchrun_helpers import _descendants, launch, read_metrics, run_in_ranks, tiny_workspace  # noqa: E402

pytestmark = pytest.mark.timeout(1800)

FAULTS = Path(__file__).parent / "faults"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("final")
    recipe = tiny_workspace(root, problems=32, max_digits=2, hidden=32,
                            train={"steps": 4, "micro_batch_size": 2, "save_every": 2, "keep_last": 2,
                                   "tensorboard": False, "export": True})
    return root, recipe


def _run(recipe: Path, out: Path, *overrides: str, nproc: int, fault: str | None = None,
         shutdown_timeout: int = 300) -> tuple[int, str]:
    """One torchrun job to its end; its output goes to a file (a process the killed rank forked may keep a
    pipe open after the job has ended)."""
    env = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(shutdown_timeout)}
    if fault:
        env["NUMLOSS_TEST_FAULT"] = fault
    log = out.parent / f"{out.name}-{len(list(out.parent.glob(f'{out.name}-*.log')))}.log"
    proc = launch(recipe, out, *overrides, nproc=nproc, site=FAULTS if fault else None, env=env, log=log)
    try:
        proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *_descendants(proc.pid)]:
            os.kill(pid, signal.SIGKILL)
        raise
    return proc.returncode, log.read_text()


def _final_step(out: Path) -> int:
    from recipes.reliability.export_writer import read_record

    record = read_record(out / "final")
    assert record is not None, sorted(p.name for p in (out / "final").iterdir())
    return record.step


def _loaded(out: Path, tokenizer_dir: Path) -> dict[str, torch.Tensor]:
    """final/'s weights as from_pretrained loads them, after checking its tokenizer loads as the run's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = out / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tokenizer_dir).get_vocab()
    return AutoModelForCausalLM.from_pretrained(final).state_dict()


def _deepspeed_checkpoint(out: Path, step: int) -> dict[str, torch.Tensor]:
    """Step `step`'s weights, read from its ZeRO-3 checkpoint by DeepSpeed's own consolidation (the fp32
    master weights; the run trains in fp32), under the HF model's names."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(out / "checkpoints"), tag=f"step_{step:08d}")
    return {k.removeprefix("model."): v for k, v in state.items()}


def _megatron_checkpoint(out: Path, step: int) -> dict[str, torch.Tensor]:
    """Step `step`'s weights from its dist_checkpointing directory (torch's own DCP reader, no process group),
    those whose HF counterpart is the same tensor (or rows of it: Megatron pads the vocabulary, stacks the
    layers, and holds [gate; up] in one matrix at TP 1), under the HF model's names."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    plain_file = out.parent / f"{out.name}-step{step}.pt"
    dcp_to_torch_save(str(out / "checkpoints" / f"step_{step:08d}" / "megatron"), str(plain_file))
    plain = torch.load(plain_file, weights_only=False)
    found = {"model.embed_tokens.weight": plain["embedding.word_embeddings.weight"],
             "lm_head.weight": plain["output_layer.weight"], "model.norm.weight": plain["decoder.final_layernorm.weight"]}
    for i in range(plain["decoder.layers.self_attention.linear_proj.weight"].shape[0]):
        layer = f"model.layers.{i}."
        gate, up = plain["decoder.layers.mlp.linear_fc1.weight"][i].chunk(2)
        found.update({layer + "input_layernorm.weight": plain["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i],
                      layer + "post_attention_layernorm.weight": plain["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i],
                      layer + "self_attn.o_proj.weight": plain["decoder.layers.self_attention.linear_proj.weight"][i],
                      layer + "mlp.down_proj.weight": plain["decoder.layers.mlp.linear_fc2.weight"][i],
                      layer + "mlp.gate_proj.weight": gate, layer + "mlp.up_proj.weight": up})
    return found


def _same(loaded: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], every: bool = True) -> None:
    """`reference`'s tensors (all of `loaded`'s with `every`) equal to `loaded`'s, a padded vocabulary's
    rows cut to the export's."""
    assert set(reference) == set(loaded) if every else set(reference) <= set(loaded), set(loaded) ^ set(reference)
    for key, value in reference.items():
        assert torch.equal(loaded[key], value[:loaded[key].shape[0]].to(loaded[key].dtype)), key


def _finished(recipe: Path, out: Path, *overrides: str) -> str:
    """What the next start of the same command decides, by its own rule (resume_policy.decide on the run's
    files, the checkpoint's recorded recipe): the decision comes before any engine is built, so no launch is
    needed to read it (tests/recipes/reliability/test_resume_policy.py starts a finished run)."""
    from recipes.config import load_recipe
    from recipes.reliability.resume_policy import decide

    tag = (out / "checkpoints" / "latest").read_text()
    saved = json.loads((out / "checkpoints" / tag / "recipe.json").read_text())
    plan = decide(load_recipe(recipe, [f"train.out_dir={out}", *overrides]), tag, saved, out)
    assert plan.finished, plan
    return plan.message


def _sequence(root: Path, recipe: Path, engine: str) -> None:
    out, tok = root / engine, root / "tok"
    nproc = 2 if engine == "deepspeed" else 1
    args = (f"train.engine={engine}",)
    checkpoint = _deepspeed_checkpoint if engine == "deepspeed" else _megatron_checkpoint
    every = engine == "deepspeed"  # Megatron: the tensors its checkpoint holds as the export does

    # 1. 4 steps with export (no fault: the loop in pre-started ranks)
    run_in_ranks(recipe, out, *args, nproc=nproc)
    assert _final_step(out) == 4
    step4 = _loaded(out, tok)

    # 2. SIGTERM while the last save is staged
    code, output = _run(recipe, out, *args, "train.steps=6", "train.save_every=1", nproc=nproc,
                        fault="0:sigterm_at_save:6")
    assert code != 0 and "the export not started; the same command exports it" in output, output[-4000:]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000006"
    assert _final_step(out) == 4
    _same(_loaded(out, tok), step4)

    # 3. the same command exports it, and is SIGKILLed mid-export over the existing final/
    victim = "1" if engine == "deepspeed" else "0"
    code, output = _run(recipe, out, *args, "train.steps=6", nproc=nproc, fault=f"{victim}:kill_mid_export:0")
    assert code != 0, output[-4000:]
    assert "trained all 6 steps but is not exported" in output and f"{out / 'final'} holds step 4" in output, output[-4000:]
    assert "already finished" not in output
    assert (out / "checkpoints" / "latest").read_text() == "step_00000006"
    assert [p.name for p in out.iterdir() if p.name.startswith(".final")], "the export never started"
    assert _final_step(out) == 4
    _same(_loaded(out, tok), step4)  # the old model, whole
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))

    steps = "train.steps=6"
    if engine == "deepspeed":
        # 4. 8 steps (the killed export's leftovers removed first); the commit of step 8 cut short by
        # torchrun's shutdown timeout
        steps = "train.steps=8"
        code, output = _run(recipe, out, *args, steps, nproc=nproc, fault="0:slow_commit:8", shutdown_timeout=3)
        assert code != 0, output[-4000:]
        assert "removed" in output and ".final.partial" in output, output[-4000:]  # the killed export's leftovers
        assert (out / "checkpoints" / "latest").read_text() == "step_00000006"
        assert (out / "checkpoints" / ".step_00000008.partial" / "checkpoint.json").is_file()
        assert _final_step(out) == 4

    # 5. the same command: DeepSpeed commits the verified step 8 (not thrown away: the run would resume from
    # 6) and trains nothing; both export the last step
    code, output = _run(recipe, out, *args, steps, nproc=nproc)
    assert code == 0, output[-4000:]
    last = 8 if engine == "deepspeed" else 6
    if engine == "deepspeed":
        assert "whose commit was cut short" in output and "committed as step_00000008" in output, output[-4000:]
        assert "resumed tiny from step 8" in output
    else:
        assert "removed" in output and ".final.partial" in output, output[-4000:]  # the killed export's leftovers
    assert f"trained all {last} steps but is not exported" in output and f"{out / 'final'} holds step 4" in output
    assert (out / "checkpoints" / "latest").read_text() == f"step_{last:08d}"
    assert _final_step(out) == last
    loaded = _loaded(out, tok)
    _same(loaded, checkpoint(out, last), every)
    assert any(not torch.equal(loaded[k], step4[k]) for k in step4)
    assert [r["step"] for r in read_metrics(out)] == list(range(1, last + 1))
    assert not [p.name for p in out.iterdir() if p.name.startswith(".final")]

    # now finished: the same command has nothing to do
    message = _finished(recipe, out, *args, steps)
    assert "already finished" in message and f"{out / 'final'} holds it" in message, message


def test_deepspeed_an_interrupted_save_or_export_is_finished_by_the_same_command(workspace):
    _sequence(*workspace, "deepspeed")


def test_megatron_an_interrupted_save_or_export_is_finished_by_the_same_command(workspace):
    _sequence(*workspace, "megatron")
