"""What one more row costs a step, from the steps' own timings: the scheduler's view of whether
the batch is memory-bound (a row is nearly free: speculate) or compute-bound (it is not).

A step of r rows is modelled as T(r) = t0 + t1 r (weights streamed once, then per-row work),
fitted by least squares over recent steps with exponentially fading weights. Steps vary in size
by themselves (prefill chunks beside decodes), which is what the fit needs; until two sizes have
been seen the slope is taken as 0 (rows free), so speculation starts on and backs off as the
timings come in.
"""

from __future__ import annotations

FADE = 0.98
"""Each step's weight in the fit, relative to the one after it (about the last 50 steps count)."""


class StepCostModel:
    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def record(self, rows: int, seconds: float) -> None:
        self._w = self._w * FADE + 1.0
        self._x = self._x * FADE + rows
        self._y = self._y * FADE + seconds
        self._xx = self._xx * FADE + rows * rows
        self._xy = self._xy * FADE + rows * seconds

    def coefficients(self) -> tuple[float, float]:
        """(t0, t1): seconds per step and per row; t1 is 0 until the steps differ in size."""
        if self._w == 0:
            return 0.0, 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x <= 1e-9 * max(1.0, mean_x * mean_x):
            return mean_y, 0.0
        slope = max(0.0, (self._xy / self._w - mean_x * mean_y) / var_x)
        return max(0.0, mean_y - slope * mean_x), slope

    def row_cost(self, rows: int) -> float:
        """The share of a step of `rows` rows that one row adds, relative to a row's average:
        a draft row pays off when more than this share of it is accepted (0: free, 1: full)."""
        t0, t1 = self.coefficients()
        total = t0 + t1 * rows
        return t1 * rows / total if total > 0 else 0.0
