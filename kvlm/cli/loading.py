"""Loading with the cyclic garbage collector paused, and frozen out of later collections in a `kvlm` process."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def loading(freeze: bool = False) -> Iterator[None]:
    """Import torch and load the model with the cyclic garbage collector paused: those imports and the
    load create a million objects and no cyclic garbage, and the collector's passes over them cost
    ~0.15 s of every start. freeze (a `kvlm` process, `cli.main.run`, not a caller of `main()`): everything
    alive then is frozen out of later collections too (`gc.freeze`), so decode steps never walk torch's
    objects."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if was:
            gc.enable()
