"""The running (decode) batch of one worker, as parallel numpy arrays.

Kept in join order, so the newest request is last (the one preempted first). Requests
that joined since the last round wait in `pending` and are merged at the next round, so
a round costs a handful of numpy operations however large the batch.
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.empty(0, dtype=np.int64)


_NO_LAG = np.empty(0, dtype=bool)


class RunningBatch:
    __slots__ = ("ctx", "ctx_sum", "ids", "lag", "pending", "rem")

    def __init__(self):
        self.ids = _EMPTY  # [b] request ids
        self.ctx = _EMPTY  # [b] tokens in the KV cache (prompt + emitted)
        self.rem = _EMPTY  # [b] output tokens still to emit
        # [b] the draft lags by a token: its last round accepted all k proposals, so its
        # next round's first draft step feeds two tokens (kestrel_rt/spec/round.py)
        self.lag = _NO_LAG
        self.ctx_sum = 0  # == ctx.sum(), kept up to date by every change below
        self.pending: list[tuple[int, int, int]] = []  # (id, ctx, rem) joined since last round

    def __len__(self) -> int:
        return len(self.ids) + len(self.pending)

    def join(self, rid: int, ctx: int, rem: int) -> None:
        self.pending.append((rid, ctx, rem))

    def merge(self) -> list[int]:
        """Move pending joiners into the arrays; returns their ids."""
        if not self.pending:
            return []
        new = np.array(self.pending, dtype=np.int64)  # [n, 3]
        self.pending = []
        self.ids = np.concatenate((self.ids, new[:, 0]))
        self.ctx = np.concatenate((self.ctx, new[:, 1]))
        self.rem = np.concatenate((self.rem, new[:, 2]))
        self.lag = np.concatenate((self.lag, np.zeros(len(new), dtype=bool)))
        self.ctx_sum += int(new[:, 1].sum())
        return new[:, 0].tolist()

    def grow(self, emitted: np.ndarray, total: int) -> None:
        """Each request gained `emitted` tokens ([b]; `total` of them in all)."""
        self.rem -= emitted
        self.ctx += emitted
        self.ctx_sum += total

    def keep(self, mask: np.ndarray) -> None:
        self.ids, self.ctx, self.rem = self.ids[mask], self.ctx[mask], self.rem[mask]
        self.lag = self.lag[mask]
        self.ctx_sum = int(self.ctx.sum())

    def pop_newest(self) -> tuple[int, int, int]:
        """Remove and return the most recently joined request (id, ctx, rem)."""
        if self.pending:
            return self.pending.pop()
        out = int(self.ids[-1]), int(self.ctx[-1]), int(self.rem[-1])
        self.ids, self.ctx, self.rem = self.ids[:-1], self.ctx[:-1], self.rem[:-1]
        self.lag = self.lag[:-1]
        self.ctx_sum -= out[1]
        return out
