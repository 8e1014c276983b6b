"""The GGUF tokenizer cache: same tokenizer as a fresh build, written next to the model, stale or
broken caches ignored and rewritten."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from kvlm.loader.gguf import read_gguf
from kvlm.tokenizer.cache import cache_key, cache_path, gguf_tokenizer, load_cached
from kvlm.tokenizer.tokenizer import Tokenizer

TEXTS = ["hello world", "Héllo, wörld! 123 4567\n\n  tabs\tand spaces", "<|im_start|>user\nhi<|im_end|>", "日本語 🙂"]


def same(a: Tokenizer, b: Tokenizer) -> None:
    for t in TEXTS:
        assert a.encode(t) == b.encode(t), t
        assert a.decode(a.encode(t)) == b.decode(b.encode(t))
    assert (a.eos_token_ids, a.bos_token_id, a.add_bos_token, a.chat_template, a.special_ids, a.byte_ids) == \
        (b.eos_token_ids, b.bos_token_id, b.add_bos_token, b.chat_template, b.special_ids, b.byte_ids)


def test_cache_written_then_used(tiny_gguf: Path, tmp_path: Path) -> None:
    model = Path(shutil.copy(tiny_gguf, tmp_path / "m.gguf"))
    fields = read_gguf(model)[1]
    assert load_cached(model) is None
    fresh = gguf_tokenizer(model, fields)
    assert cache_path(model).is_file()
    cached = load_cached(model)
    assert cached is not None
    same(fresh, cached)
    same(Tokenizer.from_gguf_fields(fields), gguf_tokenizer(model, fields))


def test_stale_or_broken_cache_is_ignored(tiny_gguf: Path, tmp_path: Path) -> None:
    model = Path(shutil.copy(tiny_gguf, tmp_path / "m.gguf"))
    fields = read_gguf(model)[1]
    gguf_tokenizer(model, fields)
    # A cache whose tokenizer differs (as if written for another file) but whose key is now stale:
    doc = json.loads(cache_path(model).read_text())
    doc["kwargs"]["add_bos_token"] = not doc["kwargs"]["add_bos_token"]
    cache_path(model).write_text(json.dumps(doc))
    assert load_cached(model).add_bos_token != Tokenizer.from_gguf_fields(fields).add_bos_token  # key still valid
    st = model.stat()
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # the model file changed
    assert load_cached(model) is None
    tok = gguf_tokenizer(model, fields)
    same(tok, Tokenizer.from_gguf_fields(fields))
    assert json.loads(cache_path(model).read_text())["key"] == cache_key(model)  # rewritten
    cache_path(model).write_text("{not json")
    assert load_cached(model) is None
    same(gguf_tokenizer(model, fields), Tokenizer.from_gguf_fields(fields))


def test_read_only_folder_means_no_cache(tiny_gguf: Path, tmp_path: Path) -> None:
    d = tmp_path / "ro"
    d.mkdir()
    model = Path(shutil.copy(tiny_gguf, d / "m.gguf"))
    d.chmod(0o555)
    try:
        if os.access(d, os.W_OK):  # running as root: permissions do not bind
            return
        tok = gguf_tokenizer(model, read_gguf(model)[1])
        assert not cache_path(model).exists() and tok.encode("hello") == tok.encode("hello")
    finally:
        d.chmod(0o755)


def test_default_model_cached_tokenizer_equals_fresh(smollm2_gguf: Path, tmp_path: Path) -> None:
    model = tmp_path / smollm2_gguf.name
    model.symlink_to(smollm2_gguf)  # the cache goes next to the link, in tmp_path
    fields = read_gguf(model)[1]
    gguf_tokenizer(model, fields)
    cached = load_cached(model)
    assert cached is not None
    fresh = Tokenizer.from_gguf_fields(fields)
    same(fresh, cached)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert cached.apply_chat_template(msgs) == fresh.apply_chat_template(msgs)
