#!/usr/bin/env python3
"""The default model in the formats people download, made from the default file into $KVLM_HOME/fixtures/.

1. A float32 export of the default GGUF (SmolLM2-135M-Instruct Q4_1): every tensor dequantized by the
   `gguf` package, the metadata copied, written with `gguf.GGUFWriter`.
2. That file requantized by llama.cpp's own `llama_model_quantize` (llama-cpp-python, run by
   `--llama-python`, which may be another virtual environment's interpreter) to each `--types` recipe:
   Q4_K_M, Q5_K_M, Q6_K and Q8_0 by default (llama.cpp's recipes pick each tensor's type: rows whose
   length is not a multiple of 256 fall back to Q5_0 / Q8_0 etc.).
Files that exist are kept (`--force` remakes them). Prints each file's path and its tensor types.
Usage: PYTHONPATH=. python scripts/make_quant_fixtures.py --llama-python PATH/TO/llama-venv/bin/python
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from kvlm.paths import kvlm_home

# llama.cpp's LLAMA_FTYPE_MOSTLY_* ids (llama.h)
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16,
          "Q5_K_M": 17, "Q6_K": 18}

_QUANTIZE = """
import ctypes, sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = int(sys.argv[3]), 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p))
sys.exit(rc)
"""


def fixtures_dir() -> Path:
    return kvlm_home() / "fixtures"


def export_f32(src: Path, dst: Path) -> None:
    """Every tensor of `src` as float32, its metadata copied (file type: all F32)."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order (rows, row length)
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            arr = np.asarray(t.data, np.float32).reshape(shape)
        else:
            arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32).reshape(shape)
        writer.add_tensor(t.name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tensor_types(path: Path) -> str:
    import gguf

    counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors)
    return ", ".join(f"{n} {k}" for k, n in counts.most_common())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-python", required=True, help="an interpreter that can import llama_cpp")
    p.add_argument("--types", nargs="+", default=["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"], choices=sorted(FTYPES))
    p.add_argument("--force", action="store_true", help="remake files that exist")
    a = p.parse_args()
    from kvlm.bench.common import DEFAULT_MODEL
    from kvlm.loader import resolve_model

    src = resolve_model(DEFAULT_MODEL, quiet=True)
    out = fixtures_dir()
    out.mkdir(parents=True, exist_ok=True)
    stem = src.name.split(".")[0]
    f32 = out / f"{stem}.F32.gguf"
    if a.force or not f32.exists():
        export_f32(src, f32)
    print(f"{f32}: {tensor_types(f32)}")
    for name in a.types:
        dst = out / f"{stem}.{name}.gguf"
        if a.force or not dst.exists():
            r = subprocess.run([a.llama_python, "-c", _QUANTIZE, str(f32), str(dst), str(FTYPES[name])],
                               capture_output=True, text=True, check=False)
            if r.returncode != 0:
                sys.exit(f"llama_model_quantize {name} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        print(f"{dst}: {tensor_types(dst)}")


if __name__ == "__main__":
    main()
