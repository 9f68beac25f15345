"""Exponential backoff with jitter, so a restarted controller is not met by every agent at once."""

from __future__ import annotations

import random


class Backoff:
    """Delays double from `initial` up to `maximum`; each is drawn from [d/2, d] ("equal jitter")."""

    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        self._initial = initial
        self._maximum = maximum
        self._rng = rng or random.Random()
        self._attempt = 0

    def next(self) -> float:
        ceiling = min(self._maximum, self._initial * (2**self._attempt))
        self._attempt = min(self._attempt + 1, 32)
        return ceiling / 2 + self._rng.random() * ceiling / 2

    def reset(self) -> None:
        self._attempt = 0
