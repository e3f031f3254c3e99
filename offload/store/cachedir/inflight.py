"""Writes in flight against a directory's byte budget.

A file enters the budget's index only once it has landed, so every write in
flight could take the directory past its budget. A write therefore holds its
bytes here from before it starts until its record is in: the budget counts
them as used and evicts for them ahead (`DirBudget.reserving`). What other
instances sharing the directory cannot see is bounded as well: one instance
never has more than its cap in flight (a write larger than the cap goes
alone).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class InFlight:
    def __init__(self) -> None:
        self.bytes = 0
        self._cv = threading.Condition()

    @contextmanager
    def hold(self, n: int, cap: int | None) -> Iterator[None]:
        """Count `n` bytes until the block ends, waiting while `cap` would be passed."""
        with self._cv:
            while cap and self.bytes and self.bytes + n > cap:
                self._cv.wait()
            self.bytes += n
        try:
            yield
        finally:
            with self._cv:
                self.bytes -= n
                self._cv.notify_all()
