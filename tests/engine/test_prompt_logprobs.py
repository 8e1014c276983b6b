"""Prompt logprobs (`SamplingParams.prompt_logprobs`): log-softmax over the prompt positions, the first None,
equal to a full forward pass of Hugging Face transformers, however the prompt is chunked or batched."""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_reference_model, random_state_dict, tiny_config, write_tiny_gguf

from kvlm import LLM, SamplingParams


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = tiny_config()
    state = random_state_dict(cfg, seed=3)
    path = write_tiny_gguf(tmp_path_factory.mktemp("plp") / "m.gguf", cfg, state)
    return path, hf_reference_model(cfg, state)


@pytest.mark.parametrize("budget", [7, 2048])  # chunked prefill vs whole prompts
def test_prompt_logprobs_match_reference(setup, budget):
    path, ref = setup
    llm = LLM(str(path), num_threads=2, max_num_batched_tokens=budget)
    prompts = [[(5 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((23, 9, 2))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        with torch.no_grad():
            logp = ref(torch.tensor([p])).logits[0].log_softmax(-1)
        for i in range(1, len(p)):
            d = o.prompt_logprobs[i]
            assert d[p[i]] == pytest.approx(logp[i - 1, p[i]].item(), abs=1e-4)
            top = logp[i - 1].topk(2)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert d[t] == pytest.approx(v, abs=1e-4)
            assert len(d) in (2, 3)  # the top 2, plus the actual token when it is not among them


def test_no_prompt_logprobs_unless_asked(setup):
    out = LLM(str(setup[0]), num_threads=2).generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2),
                                                   use_tqdm=False)[0]
    assert out.prompt_logprobs is None
