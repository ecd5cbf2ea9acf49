"""recipes.evaluation.vllm_generation on the CPU: prompts, sampling parameters, stop sequences and scoring,
with a stand-in for vllm.LLM that continues each token prompt with the same tiny model one row at a time and
applies SamplingParams as vLLM documents them. The vLLM path must give the HF path's results."""

from types import SimpleNamespace

import pytest

from recipes.sections import EvalSection
from recipes.evaluation import evaluate as E
from recipes.evaluation import vllm_generation as V
from recipes.evaluation.data_parallel import Ranks
from recipes.evaluation.generation import GenerationSettings

RANDOM_MODEL_WORD = "degrees"  # the tiny random model writes it often; no arithmetic target holds it


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
        self.kwargs = kwargs


class FakeLLM:
    """vllm.LLM's generate(): greedy, at most max_tokens, ends at a stop token id (not in the text), special
    tokens skipped, the text cut before the first stop string (include_stop_str_in_output False)."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.calls = []

    def generate(self, prompts, params, use_tqdm=True):
        import torch

        self.calls.append((prompts, params))
        outputs = []
        for p in prompts:
            ids = torch.tensor([p["prompt_token_ids"]])
            with torch.no_grad():
                gen = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                                          do_sample=False, eos_token_id=params.stop_token_ids,
                                          pad_token_id=self.tok.pad_token_id)
            toks = gen[0, ids.shape[1]:].tolist()
            cut = next((k for k, t in enumerate(toks) if t in params.stop_token_ids), len(toks))
            text = self.tok.decode(toks[:cut], skip_special_tokens=params.skip_special_tokens)
            at = min((i for i in (text.find(s) for s in params.stop) if i >= 0), default=len(text))
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(text=text[:at])]))
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch, rec_model_dir):
    made = {}

    def load_llm(model_dir, tensor_parallel_size=1, dtype=None, trust_remote_code=False):
        made["llm"] = FakeLLM(model_dir)
        made["tensor_parallel_size"] = tensor_parallel_size
        return made["llm"]

    monkeypatch.setattr(V, "vllm_importable", lambda: True)
    monkeypatch.setattr(V, "load_llm", load_llm)
    monkeypatch.setattr(V, "sampling_class", lambda: FakeSamplingParams)
    return made


def test_sampling_parameters_and_prompts():
    settings = GenerationSettings(max_new_tokens=300, stop=("Question:", "</s>"), stop_ids=(2, 7), batch_size=4)
    assert V.sampling_params(settings) == {"n": 1, "temperature": 0.0, "max_tokens": 300,
                                           "stop": ["Question:", "</s>"], "stop_token_ids": [2, 7],
                                           "include_stop_str_in_output": False, "skip_special_tokens": True}
    assert V.prompts([{"prompt_ids": [1, 5, 9]}, {"prompt_ids": []}]) == [{"prompt_token_ids": [1, 5, 9]},
                                                                       {"prompt_token_ids": []}]


def test_the_vllm_path_gives_the_hf_path_results(fake_vllm, rec_model_dir, rec_data_dir):
    section = EvalSection(stop={"arithmetic": [RANDOM_MODEL_WORD]})
    kwargs = dict(batch_size=5, max_new_tokens=10, limit=12, eval_section=section)
    via_vllm = E.evaluate(rec_model_dir, rec_data_dir, **kwargs)  # backend auto: vLLM imports (the stand-in)
    via_hf = E.evaluate(rec_model_dir, rec_data_dir, backend="hf", **kwargs)
    assert via_vllm["settings"]["backend"] == "vllm" and via_hf["settings"]["backend"] == "hf"
    assert fake_vllm["tensor_parallel_size"] == 1  # the CPU placement
    (prompts, params), = fake_vllm["llm"].calls  # one call with every row
    rows = E.load_rows(rec_data_dir, limit=12)
    assert prompts == [{"prompt_token_ids": r["prompt_ids"]} for r in rows]
    assert params.kwargs == V.sampling_params(GenerationSettings(10, (RANDOM_MODEL_WORD,),
                                                                 tuple(via_hf["settings"]["stop_ids"])))
    texts = [e["prediction"] for e in via_vllm["examples"]]
    assert texts == [e["prediction"] for e in via_hf["examples"]]
    assert via_vllm["metrics"] == via_hf["metrics"] and via_vllm["examples"] == via_hf["examples"]
    assert any(t for t in texts) and not any(RANDOM_MODEL_WORD in t for t in texts)
    free = E.evaluate(rec_model_dir, rec_data_dir, backend="hf", batch_size=5, max_new_tokens=10, limit=12)
    assert sum(RANDOM_MODEL_WORD in e["prediction"] for e in free["examples"]) >= 3  # the stop string mattered


def test_backend_choice(monkeypatch):
    one, two = Ranks(), Ranks(0, 2, 0)
    monkeypatch.setattr(V, "vllm_importable", lambda: False)
    assert E.choose_backend("auto", False, one, own_generate=False) == "hf"
    with pytest.raises(ValueError, match="import vllm"):
        E.choose_backend("vllm", False, one, own_generate=False)
    monkeypatch.setattr(V, "vllm_importable", lambda: True)
    assert E.choose_backend("auto", False, one, own_generate=False) == "vllm"
    assert E.choose_backend("auto", True, one, own_generate=False) == "hf"  # images: HF only
    assert E.choose_backend("auto", False, two, own_generate=False) == "hf"  # torchrun ranks: data-parallel HF
    assert E.choose_backend("hf", False, one, own_generate=False) == "hf"
    with pytest.raises(ValueError, match="images"):
        E.choose_backend("vllm", True, one, own_generate=False)
    with pytest.raises(ValueError, match="one process"):
        E.choose_backend("vllm", False, two, own_generate=False)
    with pytest.raises(ValueError, match="backend"):
        E.choose_backend("sglang", False, one, own_generate=False)
