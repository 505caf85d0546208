"""`Progress`: the bar an evaluation draws while it runs, only when its stream is a terminal
(in CI logs, or piped, a bar would be noise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``done`` of ``total`` runs on one line, redrawn at most every ``interval`` seconds."""

    def __init__(self, total: int, *, label: str = "", file: TextIO | None = None, enabled: bool | None = None,
                 interval: float = 0.1) -> None:
        self.file = file if file is not None else sys.stderr
        isatty = getattr(self.file, "isatty", None)
        self.enabled = enabled if enabled is not None else bool(isatty is not None and isatty())
        self.total = total
        self.label = label
        self.done = 0
        self.failed = 0
        self.interval = interval
        self._drawn = 0.0

    def advance(self, passed: bool) -> None:
        self.done += 1
        self.failed += 0 if passed else 1
        now = time.monotonic()
        if self.enabled and (now - self._drawn >= self.interval or self.done == self.total):
            self._drawn = now
            self._draw()

    def _draw(self) -> None:
        width = 30
        filled = width * self.done // self.total if self.total else width
        failed = f", {self.failed} failed" if self.failed else ""
        self.file.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total}{failed}")
        self.file.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw()
            self.file.write("\n")
            self.file.flush()
