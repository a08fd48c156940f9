"""Non-negative least squares in numpy: min ||A x - b|| subject to x >= 0.

Lawson and Hanson's active-set method (Solving Least Squares Problems, 1974, ch. 23):
move the variable with the largest gradient into the free set, solve the unconstrained
problem on the free set, and step back toward the last feasible point whenever a free
variable would turn negative. Exact in a finite number of steps; the fits here have at
most a handful of columns, so it costs microseconds.
"""

from __future__ import annotations

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """x >= 0 minimising ||a @ x - b||_2; a: [rows, cols], b: [rows]."""
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    n = a.shape[1]
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(1.0, np.linalg.norm(a, 1)) * max(a.shape)
    for _ in range(max_iter or 3 * n + 10):
        grad = a.T @ (b - a @ x)  # [cols]: descent direction of each variable
        candidates = ~free & (grad > tol)
        if not candidates.any():
            break
        free[np.argmax(np.where(candidates, grad, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > tol).all():
                x = z
                break
            # step from x toward z as far as feasibility allows; drop who hits zero
            shrink = free & (z <= tol)
            alpha = np.min(x[shrink] / (x[shrink] - z[shrink]))
            x = x + alpha * (z - x)
            free &= x > tol
            x[~free] = 0.0
    return x


def nnls_scaled(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """nnls with a's columns scaled to unit norm for the solve (terms of very different
    sizes, as ms and bytes), the result in a's own units."""
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    return nnls(a / scale, b) / scale
