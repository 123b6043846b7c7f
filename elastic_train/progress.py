"""Progress inside an epoch, on rank 0: a bar on a terminal, a line now and then in a log.

* On an interactive terminal (stderr is a tty): tqdm's bar for the epoch's steps, with the
  rate and the time left, removed at the epoch's end so the seed's epoch line stands alone.
* Elsewhere (a log file, Slurm's output): no bar, whose carriage returns would fill the log,
  but one line every ``line_every_s`` seconds (default 60) of a long epoch, e.g.
  ``Epoch 3/10: 1200/5000 steps (24%), 41.2 steps/s, 0:01:32 left``. Epochs shorter than that
  print nothing extra: their epoch line comes soon enough.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

LINE_EVERY_S = 60.0


class ProgressBar:
    def __init__(
        self,
        enabled: bool,
        stream: TextIO | None = None,
        refresh_s: float = 0.2,
        terminal: bool | None = None,
        line_every_s: float = LINE_EVERY_S,
    ) -> None:
        """``enabled``: this process reports at all (rank 0). ``terminal``: draw a bar (default:
        whether ``stream`` is a tty); otherwise print a line every ``line_every_s`` seconds."""
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.refresh_s = refresh_s
        self.line_every_s = line_every_s
        self._bar: tqdm[Any] | None = None
        self._label = ""
        self._total = 0
        self._started = 0.0
        self._last_line = 0.0
        self._first = 0

    @classmethod
    def for_terminal(cls, wanted: bool) -> ProgressBar:
        """Rank 0's: a bar on a terminal, lines on stdout otherwise (where the epoch lines go)."""
        if sys.stderr.isatty():
            return cls(enabled=wanted, stream=sys.stderr, terminal=True)
        return cls(enabled=wanted, stream=sys.stdout, terminal=False)

    def start(self, label: str, total: int, done: int = 0) -> None:
        self._label, self._total, self._first = label, total, done
        self._started = self._last_line = time.monotonic()
        if self.enabled and self.terminal:
            self._bar = tqdm(
                total=total,
                initial=done,
                desc=label,
                unit="step",
                file=self.stream,
                leave=False,
                mininterval=self.refresh_s,
                dynamic_ncols=True,
            )

    def update(self, done: int, extra: str = "") -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(done - self._bar.n)
            if extra:
                self._bar.set_postfix_str(extra, refresh=False)
            return
        now = time.monotonic()
        if now - self._last_line < self.line_every_s or done >= self._total:
            return
        self._last_line = now
        rate = (done - self._first) / max(now - self._started, 1e-9)
        left = (self._total - done) / rate if rate > 0 else float("inf")
        eta = _hms(left) if left != float("inf") else "?"
        percent = 100 * done // max(self._total, 1)
        line = f"{self._label}: {done}/{self._total} steps ({percent}%), {rate:.1f} steps/s, {eta} left"
        self.stream.write(line + (f", {extra}" if extra else "") + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _hms(seconds: float) -> str:
    """``1:02:03`` (hours unbounded: a long epoch's time left may exceed a day)."""
    whole = int(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"
