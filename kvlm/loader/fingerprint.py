"""A model's identity on disk: which files define it, and a content hash over them.

The engine roots its prefix-cache hash chain in the files' names, sizes and modification times
(cheap, at every start); KV snapshots record the content hash (`model_fingerprint`), computed once per
file version and cached in `$KVLM_HOME/fingerprints`, so a snapshot never loads into another model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvlm.paths import kvlm_home


def model_files(path: Path) -> list[Path]:
    """The files that define a model's weights and shapes: the GGUF file, or a folder's config and weights."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.name == "config.json" or p.suffix in (".safetensors", ".gguf"))


def model_fingerprint(path: Path) -> str:
    """sha256 over the model's files (names, sizes, contents). Computed once per file version and cached
    in $KVLM_HOME/fingerprints, keyed by path, size and modification time."""
    files = model_files(path)
    ident = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    cache = kvlm_home() / "fingerprints" / (hashlib.sha256(ident.encode()).hexdigest()[:32] + ".txt")
    try:
        return cache.read_text().strip()
    except OSError:
        pass
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(digest + "\n")
    except OSError:  # a read-only home only costs recomputing next time
        pass
    return digest
