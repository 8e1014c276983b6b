"""lm-eval's `local-completions` against `kvlm serve` on a local task (no hub): generate_until and loglikelihood,
with loglikelihoods equal to the ones computed offline from the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from deps import need
from tiny_models import hf_reference_model

need("lm_eval")  # in the test extra: skipped without it, except in CI

DOCS = [{"context": "hello", "continuation": " world"}, {"context": "hello hello", "continuation": " hello"},
        {"context": "abc", "continuation": "def"}, {"context": "the cat", "continuation": " sat on"}]

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
{extra}
"""


def test_lm_eval_local_completions(tiny_server, tmp_path: Path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "ll.yaml").write_text(TASK.format(name="kvlm_ll", data=data, kind="loglikelihood",
                                                  extra="metric_list:\n  - metric: perplexity\n  - metric: acc"))
    (tmp_path / "gen.yaml").write_text(TASK.format(
        name="kvlm_gen", data=data, kind="generate_until",
        extra="generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\nmetric_list:\n  - metric: exact_match"))
    out = tmp_path / "out"
    args = (f"base_url={tiny_server.url}/v1/completions,model=tiny,tokenizer_backend=remote,"
            "tokenized_requests=True,num_concurrent=4,max_retries=1")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf"), "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                           "--tasks", "kvlm_ll,kvlm_gen", "--include_path", str(tmp_path), "--log_samples",
                           "--output_path", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    def samples(task: str) -> list[dict]:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        return sorted((json.loads(x) for x in path.read_text().splitlines()), key=lambda s: s["doc_id"])

    gens = samples("kvlm_gen")
    assert len(gens) == len(DOCS) and all(isinstance(s["resps"][0][0], str) for s in gens)

    # Offline: the same weights in transformers, the server's tokenizer, lm-eval's context/continuation split.
    from kvlm.loader import load_checkpoint

    _, _, tok = load_checkpoint(tiny_server.model_path)
    model = hf_reference_model(tiny_server.cfg, tiny_server.state)
    lls = samples("kvlm_ll")
    assert len(lls) == len(DOCS)
    for s, d in zip(lls, DOCS):
        whole = tok.encode(d["context"] + d["continuation"], add_special_tokens=False)
        ctx = tok.encode(d["context"], add_special_tokens=False)
        with torch.no_grad():
            logp = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
        want = sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))
        got = float(s["resps"][0][0][0])  # lm-eval logs (loglikelihood, is_greedy) as strings
        assert got == pytest.approx(want, abs=1e-3), (d, got, want)
