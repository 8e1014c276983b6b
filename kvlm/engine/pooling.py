"""Embeddings: a prompt-only request's final-norm hidden rows pooled into one vector (`PoolingParams`), and
which pooling a model wants (`ModelPooling`: its sentence-transformers files, else the last token).

An embedding is an ordinary engine request that stops after its prefill: the scheduler admits and chunks
it like any prompt, the runner shows each step's rows of it to `keep_rows` (as it shows a scored
request's rows to scoring's observer) and samples nothing for it, and the step that completes its prompt
pools the kept rows, so the engine finishes it and frees its blocks in that same step.

Exact: a vector is a function of its own prompt's rows only, whose bits the kernels already make
independent of the batch, the chunking and the threads. The rows are kept until the prompt is complete
and pooled once, in a fixed order (the mean is a cumulative sum, a sequential scan down each column
whatever the thread count), so a text's vector has the same bits alone, in a batch, or split into chunks.

The prefix cache: an embedding takes no cached prefix (mean and cls pooling need every row; last could
take one, but then the same text's cost would depend on what ran before, for a saving only repeated
texts see) and registers none of its blocks. Registering would be free to compute but not harmless: a
RAG pipeline embedding thousands of documents, each once, would push the system prompts and chat turns
that later requests do reuse out of the cached-free LRU. Unregistered, its blocks go straight back to
the plain free list and the next embedding reuses them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlm.engine.scheduler import ScheduledBatch
from kvlm.errors import ParameterError
from kvlm.sampling_params import PoolingParams

log = logging.getLogger("kvlm")

# sentence-transformers' Pooling config -> ours (its `pooling_mode` string, or the older boolean keys)
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _st_pooling(folder: Path) -> str | None:
    """The pooling a sentence-transformers folder declares (`modules.json` names its Pooling module's
    folder, by default `1_Pooling`); None when it declares none. A mode kvlm does not implement (max,
    weighted mean) is logged and ignored."""
    path = "1_Pooling"
    modules = _read_json(folder / "modules.json")
    if isinstance(modules, list):
        for m in modules:
            if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling"):
                path = str(m.get("path") or path)
    cfg = _read_json(folder / path / "config.json")
    if not isinstance(cfg, dict):
        return None
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):
        modes = [mode]
    else:
        modes = [k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    ours = [_ST_MODES.get(m) or _ST_KEYS.get(f"pooling_mode_{m}") for m in modes]
    if len(ours) == 1 and ours[0] is not None:
        return ours[0]
    log.warning("kvlm: %s/config.json asks for pooling %s, which kvlm does not implement; pooling 'last' "
                "(set --pooling last|mean|cls)", path, "+".join(modes) or "none")
    return None


@dataclass(frozen=True, slots=True)
class ModelPooling:
    """What embeddings of one model may be: its default pooling (and where that came from) and the
    `dimensions` it supports besides its full size (Matryoshka models: None, any; else the listed ones)."""

    default: str
    source: str
    hidden_size: int
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @classmethod
    def of(cls, model_path: Path, hidden_size: int, override: str | None = None) -> ModelPooling:
        """`override` (the engine's `pooling`, `--pooling`), else the folder's sentence-transformers pooling,
        else "last". Matryoshka support comes from config.json (`matryoshka_dimensions`, `is_matryoshka`,
        as vLLM reads them); a GGUF file declares neither."""
        folder = model_path if model_path.is_dir() else None
        st = _st_pooling(folder) if folder is not None else None
        default, source = ((override, "--pooling") if override else (st, "sentence-transformers config") if st
                           else ("last", "default"))
        cfg = _read_json(folder / "config.json") if folder is not None else None
        cfg = cfg if isinstance(cfg, dict) else {}
        dims = cfg.get("matryoshka_dimensions")
        dims = tuple(d for d in dims if isinstance(d, int)) if isinstance(dims, list) else None
        return cls(default, source, hidden_size, bool(dims) or cfg.get("is_matryoshka") is True, dims or None)

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """`params` with its pooling filled in, or `ParameterError` for `dimensions` this model cannot give."""
        d, h = params.dimensions, self.hidden_size
        if d is not None and d != h:
            if not self.matryoshka:
                raise ParameterError("dimensions", f"dimensions is supported only by Matryoshka models; this model's "
                                                   f"embeddings have {h} dimensions (omit dimensions, or pass {h})")
            if d > h or (self.matryoshka_dimensions and d not in self.matryoshka_dimensions):
                allowed = list(self.matryoshka_dimensions or ()) or f"1..{h}"
                raise ParameterError("dimensions", f"dimensions must be one of {allowed}, got {d}")
        return params if params.pooling else dataclasses.replace(params, pooling=self.default)


def keep_rows(batch: ScheduledBatch, hidden: torch.Tensor) -> None:
    """After a step's forward: keep the rows each pooling request needs from `hidden` (T, hidden), and
    pool those whose prompt this step completed (`Request.embedding`). A chunk starting at position 0
    starts over (a preempted request recomputes its prompt)."""
    row = 0
    for req, n in zip(batch.requests, batch.num_new_tokens):
        p = req.pooling
        if p is not None:
            start = req.num_computed_tokens
            if start == 0:
                req.pooled_rows = []
            rows = hidden[row : row + n]
            end = start + n == req.num_tokens
            if p.pooling == "mean":
                req.pooled_rows.append(rows.clone())  # (n, hidden): a copy frees the step's activations
            elif (p.pooling == "cls" and start == 0) or (p.pooling == "last" and end):
                req.pooled_rows.append((rows[:1] if p.pooling == "cls" else rows[-1:]).clone())
            if end:
                req.embedding = pool(torch.cat(req.pooled_rows), p)
                req.pooled_rows = []
        row += n


def pool(rows: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """One request's kept rows (n, hidden) -> its vector (hidden or dimensions,) float32: the mean, or the
    one row kept; then truncated to `dimensions` and L2-normalized as asked."""
    rows = rows.float()
    v = rows.cumsum(0)[-1] / rows.shape[0] if params.pooling == "mean" else rows[0]  # (hidden,)
    if params.dimensions is not None:
        v = v[: params.dimensions]
    if params.normalize:
        v = v / torch.linalg.vector_norm(v).clamp_min(1e-12)
    return v
