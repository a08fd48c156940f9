"""The running (decode) batch of one worker, as parallel numpy arrays.

Kept in join order, so the newest request is last (the one preempted first). Requests
that joined since the last round wait in `pending` and are merged at the next round, so
a round costs a handful of numpy operations however large the batch.
"""

from __future__ import annotations

import numpy as np

from kestrel_sim.acceptance import WINDOW, RequestAcceptance

_EMPTY = np.empty(0, dtype=np.int64)


_NO_LAG = np.empty(0, dtype=bool)
_NO_DRAWS = np.empty((0, WINDOW), dtype=np.int8)


class RunningBatch:
    __slots__ = ("acc", "acc_at", "ctx", "ctx_sum", "ids", "lag", "pending", "rem")

    def __init__(self):
        self.ids = _EMPTY  # [b] request ids
        self.ctx = _EMPTY  # [b] tokens in the KV cache (prompt + emitted)
        self.rem = _EMPTY  # [b] output tokens still to emit
        # [b] the draft lags by a token: its last round accepted all k proposals, so its
        # next round's first draft step feeds two tokens (kestrel_rt/spec/round.py)
        self.lag = _NO_LAG
        # [b, WINDOW] each row's next accepted lengths from its own stream, and [b] the
        # offset of its next one in them (WINDOW: none left, drawn at the next round)
        self.acc = _NO_DRAWS
        self.acc_at = _EMPTY
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
        self.acc = np.concatenate((self.acc, np.zeros((len(new), WINDOW), dtype=np.int8)))
        self.acc_at = np.concatenate((self.acc_at, np.full(len(new), WINDOW)))
        self.ctx_sum += int(new[:, 1].sum())
        return new[:, 0].tolist()

    def accepted(self, draws: RequestAcceptance) -> np.ndarray:
        """[b] this round's accepted lengths (uncapped), each row's next from its own stream:
        a gather, and a fresh window for the rows that used theirs up (or just joined)."""
        at = self.acc_at
        for i in np.flatnonzero(at >= WINDOW).tolist():
            self.acc[i] = draws.window(int(self.ids[i]))
            at[i] = 0
        out = self.acc[np.arange(len(at)), at].astype(np.int64)
        at += 1
        draws.used[self.ids] += 1
        return out

    def grow(self, emitted: np.ndarray, total: int) -> None:
        """Each request gained `emitted` tokens ([b]; `total` of them in all)."""
        self.rem -= emitted
        self.ctx += emitted
        self.ctx_sum += total

    def keep(self, mask: np.ndarray) -> None:
        self.ids, self.ctx, self.rem = self.ids[mask], self.ctx[mask], self.rem[mask]
        self.lag = self.lag[mask]
        self.acc, self.acc_at = self.acc[mask], self.acc_at[mask]
        self.ctx_sum = int(self.ctx.sum())

    def pop_newest(self) -> tuple[int, int, int]:
        """Remove and return the most recently joined request (id, ctx, rem)."""
        if self.pending:
            return self.pending.pop()
        out = int(self.ids[-1]), int(self.ctx[-1]), int(self.rem[-1])
        self.ids, self.ctx, self.rem = self.ids[:-1], self.ctx[:-1], self.rem[:-1]
        self.lag = self.lag[:-1]
        self.acc, self.acc_at = self.acc[:-1], self.acc_at[:-1]
        self.ctx_sum -= out[1]
        return out
