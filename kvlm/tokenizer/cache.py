"""A GGUF model's tokenizer, cached next to the model file.

Rebuilding the tokenizer from GGUF metadata (`gguf_vocab`: tens of thousands of tokens and merges
through the `tokenizers` builders) costs most of a second at every start. The first load writes the
result, serialized by `tokenizers` plus the `Tokenizer` arguments, to `<model>.gguf.tokenizer.json`;
later loads read it when its key still matches: the model file's size and modification time, and a
hash of the code that builds tokenizers (so a fix there is not hidden by an old cache). A stale or
unreadable cache is ignored and rewritten; a read-only folder just means no cache. Nothing here is
executable: the cache is JSON read by `tokenizers`, never unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from kvlm.tokenizer.tokenizer import Tokenizer

FORMAT = 1


def cache_path(model: Path) -> Path:
    return model.with_name(model.name + ".tokenizer.json")


def cache_key(model: Path) -> dict[str, Any]:
    import kvlm.tokenizer.gguf_vocab as builder

    st = model.stat()
    code = hashlib.sha256(Path(builder.__file__).read_bytes()).hexdigest()[:16]
    return {"format": FORMAT, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "builder": code}


def load_cached(model: Path) -> Tokenizer | None:
    """The cached tokenizer of `model`, or None when there is none or it is stale."""
    from tokenizers import Tokenizer as Backend

    try:
        doc = json.loads(cache_path(model).read_text("utf-8"))
        if doc.get("key") != cache_key(model):
            return None
        return Tokenizer(Backend.from_str(doc["backend"]), **doc["kwargs"])
    except Exception:  # noqa: BLE001 (unreadable, malformed or stale: rebuild; tokenizers raises bare Exception)
        return None


def gguf_tokenizer(model: Path, fields: dict[str, Any]) -> Tokenizer:
    """The tokenizer of a GGUF model: from the cache when valid, else built (and cached)."""
    cached = load_cached(model)
    if cached is not None:
        return cached
    from kvlm.tokenizer.gguf_vocab import tokenizer_args_from_gguf

    backend, kwargs = tokenizer_args_from_gguf(fields)
    tok = Tokenizer(backend, **kwargs)
    doc = {"key": cache_key(model), "kwargs": kwargs, "backend": backend.to_str()}
    path = cache_path(model)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:  # write then rename: a reader never sees half a file
        tmp.write_text(json.dumps(doc), "utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
    return tok
