"""Speculative rounds run ahead: round r + 1 is enqueued from round r's results on the device
before the host reads them, as plain decoding's overlapped loop does (kestrel_rt/engine.py,
kestrel_rt/serve/ahead.py). On a GPU the host's work between rounds (reading the round,
emitting, launching the next draft steps) then runs while the device runs the next round,
instead of leaving the device idle (docs/performance.md).

The host can plan round r + 1 before reading round r when it knows what round r does to
every row: controlled acceptance (a row's accepted count n is drawn on the host before the
verify), greedy, `fused` correction, no end-of-sequence token, the draft on the target's
device (`runs_ahead`); no prompt waiting for a free slot (it would join after round r:
speculative_generate checks); and every row still running after round r (it emits exactly
n + 1 tokens: n + 1 < what it may still emit, so no slot frees). Then, from the drawn n
(KV invariants: kestrel_rt/spec/round.py):

- round r's KV rollbacks (host lengths only) are done as soon as it is launched;
- round r + 1's limits follow from the known lengths, its draws go over in one pinned
  asynchronous copy (kestrel_rt/spec/round.py to_device);
- its verify's t0 is round r's g_n, on the device;
- its draft's first step feeds [g_n], or [d_k, g_n] where n == k (the draft never ran d_k).

Round r's rows (n, g_n, d_1..d_k) are read one round behind and emitted; the n read back
must be the n drawn. A stretch of rounds starts from the host's tokens, as SpecDecoder.round
does, and ends with a round after which some row is done; tokens, statistics and spans are
round()'s, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel_rt.model import Chosen
from kestrel_rt.spec.round import SpecDecoder, to_device
from kestrel_rt.spec.sequence import SpecSequence
from kestrel_rt.trace import OpenSpan


def runs_ahead(decoder: SpecDecoder, eos: frozenset[int]) -> bool:
    """Whether the decoder's rounds may run ahead (the module docstring), `eos` the rows'
    end-of-sequence tokens."""
    cfg = decoder.config
    return (cfg.controlled and cfg.greedy and cfg.correction == "fused" and not eos
            and decoder.draft.device == decoder.target.device)


@dataclass
class Launched:
    """A round enqueued on the device whose rows the host has not read yet."""

    seqs: list[SpecSequence]
    lengths: list[int]  # L: each row's tokens before the round
    remaining: list[int]  # tokens each row may still emit before the round
    limits: list[int]  # proposals that may count
    drawn: list[int]  # n, drawn on the host
    accepted: torch.Tensor  # [B] the same n on the device
    drafts: torch.Tensor  # [B, k] d_1..d_k on the device
    after: torch.Tensor  # [B] g_n on the device
    rows: Chosen  # [B, 2 + k] (n, g_n, d_1..d_k) on their way to the host
    span: OpenSpan  # its verify

    def keeps_running(self) -> bool:
        """Whether every row still runs after this round (emits n + 1 < remaining)."""
        return all(n + 1 < r for n, r in zip(self.drawn, self.remaining))


def ahead_rounds(decoder: SpecDecoder, seqs: list[SpecSequence]) -> tuple[int, int]:
    """Rounds over `seqs` (running, greedy and controlled: runs_ahead), each launched before
    the previous one is read while every row keeps running; stops after a round that leaves
    a row done. Returns (rounds, rounds launched ahead)."""
    room = decoder.room
    pending = launch(decoder, seqs, [len(s.tokens) for s in seqs],
                     [s.remaining(room) for s in seqs])
    rounds = ahead = 0
    while True:
        nxt = None
        if pending.keeps_running():
            nxt = launch(decoder, seqs, [L + n + 1 for L, n in zip(pending.lengths, pending.drawn)],
                         [r - n - 1 for r, n in zip(pending.remaining, pending.drawn)], pending)
            ahead += 1
        emit(decoder, pending)
        rounds += 1
        if nxt is None:
            return rounds, ahead
        pending = nxt


def launch(decoder: SpecDecoder, seqs: list[SpecSequence], lengths: list[int],
           remaining: list[int], previous: Launched | None = None) -> Launched:
    """Enqueue one round (round()'s stages and spans), from the host's tokens or from
    `previous`'s results on the device, and roll the caches back to its drawn n."""
    k, target = decoder.k, decoder.target
    limits = [min(k, r - 1) for r in remaining]
    first = None if previous is None else draft_inputs(previous, k)
    drafts, _ = decoder.propose(seqs, None, first)  # d_1..d_k [B, k]
    drawn = decoder.controlled.draw([s.accept_rng for s in seqs], limits)
    if previous is None:  # t0 from the host, with the draws in one copy
        packed = to_device([[s.tokens[-1] for s in seqs], drawn], target.device)  # [2, B]
        last, accepted = packed[0], packed[1]
    else:  # t0 = g_n of the round before, still on the device
        last, accepted = previous.after, to_device(drawn, target.device)  # [B], [B]
    with decoder.trace_verify(seqs, limits, lengths) as span:
        verified = decoder.verify(seqs, drafts, limits, last)  # ids [B, k+1]
        after = verified.gather(1, accepted[:, None])[:, 0]  # [B] g_n
    decoder.verify_span = span
    rows = Chosen.copy_back(torch.cat([accepted[:, None], after[:, None], drafts], 1))
    decoder.roll_back(seqs, lengths, drawn)
    return Launched(seqs, lengths, remaining, limits, drawn, accepted, drafts, after, rows,
                    span)


def draft_inputs(previous: Launched, k: int) -> tuple[torch.Tensor, list[int]]:
    """The draft's first-step input after `previous`, on the device: [g_n] per row, or
    [d_k, g_n] where n == k (0-padded, as round()'s padded host rows): (tokens [B, 1|2],
    n_new)."""
    g = previous.after[:, None]  # [B, 1]
    lags = [n == k for n in previous.drawn]
    if not any(lags):
        return g, [1] * len(lags)
    lag = (previous.accepted == k)[:, None]  # [B, 1]: the draft never ran d_k
    pairs = torch.cat([previous.drafts[:, k - 1:], g], 1)  # [B, 2] d_k, g_n
    singles = torch.cat([g, torch.zeros_like(g)], 1)  # [B, 2] g_n, padding
    return torch.where(lag, pairs, singles), [1 + lagging for lagging in lags]


def emit(decoder: SpecDecoder, launched: Launched) -> None:
    """Read a launched round's rows (waiting for it if need be), check that it accepted
    what was drawn, and emit d_1..d_n, g_n into each sequence; statistics as round()."""
    rows = launched.rows.read()  # [B, 2 + k] on the host
    room = decoder.room
    for s, row, n, limit in zip(launched.seqs, rows, launched.drawn, launched.limits):
        if row[0] != n:
            raise RuntimeError(f"request {s.request}: a round run ahead accepted {row[0]} "
                               f"tokens where {n} were drawn (a bug in kestrel_rt/spec/ahead.py)")
        decoder.stats.record(limit, n)
        s.emit(row[2: 2 + n] + [row[1]], room)
    launched.span.accepted = [row[0] for row in rows]
