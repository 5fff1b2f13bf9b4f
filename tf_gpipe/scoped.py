"""A flag that holds for the extent of a ``with`` block, in the thread that set it.

Tracing carries a few facts sideways, from the code that opens a scope to code it calls
deep inside (the replay of a stage, a forward that nothing differentiates, stage
functions to inline). Replicas of a pipeline trace in threads of their own, so each
thread sees only the scopes it opened; a scope may open inside itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__: list[str] = []


class Flag:
    """Set inside ``with flag.scope():``, in this thread; ``bool(flag)`` reads it."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __bool__(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1
