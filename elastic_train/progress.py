"""A per-epoch progress bar for interactive terminals; silent in batch logs.

Deliberately tiny (no dependency): one carriage-returned line on stderr, redrawn at most
``refresh_s`` apart, erased at the end of the epoch so the seed's epoch line stands alone.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, enabled: bool, stream: TextIO | None = None, refresh_s: float = 0.2) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.refresh_s = refresh_s
        self._last = 0.0
        self._label = ""
        self._total = 0

    @classmethod
    def for_terminal(cls, wanted: bool) -> ProgressBar:
        return cls(enabled=wanted and sys.stderr.isatty())

    def start(self, label: str, total: int) -> None:
        self._label, self._total, self._last = label, total, 0.0

    def update(self, done: int, extra: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < self._total and now - self._last < self.refresh_s:
            return
        self._last = now
        width = 30
        filled = width * done // max(self._total, 1)
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r{self._label} [{bar}] {done}/{self._total} {extra}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()
