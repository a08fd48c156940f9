"""The speculative round: a draft model proposes k tokens, the target verifies them in one
forward, the caches roll back by length. Two model instances, each with its own backend
(the draft may run on the CPU while the target runs on a GPU).

What each KV cache holds, for a sequence of L tokens x_1..x_L (prompt + generated):

- target: x_1..x_{L-1}, every token but the last (as in plain decoding);
- draft:  x_1..x_{L-1}, or x_1..x_{L-2} after a round that accepted all k proposals (the
  draft proposed d_k but never ran it).

A round, for a sequence that may still emit r tokens (limit = min(k, r - 1) proposals count):

1. draft: step 1 feeds the tokens the draft has not cached (x_L =: t0, with x_{L-1} when it
   lags), steps 2..k the previous step's proposal: d_1..d_k. The draft cache grows to
   L + k - 1 (t0, d_1..d_{k-1}).
2. verify: the target runs [t0, d_1..d_limit] (padded to k+1) in ONE forward: its choice g_i
   after each position i (greedy: argmax; sampled: probabilities p_i).
3. accept n <= limit: greedy, the longest prefix with d_i == g_{i-1}; sampled, rejection
   sampling (kestrel_rt/spec/accept.py); controlled, drawn (kestrel_rt/spec/controlled.py).
   Emit d_1..d_n and the target's token after them, g_n (the correction, or the bonus when
   n == limit): the sequence is now L + n + 1 tokens long.
4. roll back by length (host bookkeeping only): target to L + n (t0, d_1..d_n kept: all but
   g_n); draft to L + min(n, k - 1) (all but g_n, and but d_k when n == k).

`fused` takes g_n from the verify. `separate` rolls the target back to L + n - 1 (without
its last accepted input: d_n, or t0 when n = 0) and forwards that token alone, taking g_n
from that forward (the same token in exact arithmetic; what the simulator prices as
"correction").

Greedy on a GPU: proposals stay on the device (one step's argmax is the next step's input),
the verify returns device argmax ids, acceptance is the backend's kernel, and the host reads
the round once (accepted lengths, the target's tokens and the proposals: it needs them to
roll back); `separate` reads its correction token a second time.
"""

from __future__ import annotations

import torch

from kestrel_rt.engine import kv_cache_for
from kestrel_rt.model import Qwen3Model, padded
from kestrel_rt.sampling import probabilities, request_generator, sample_from
from kestrel_rt.spec.accept import draft_probs_at, greedy_accept, rejection_sample, residual
from kestrel_rt.spec.config import SpecConfig
from kestrel_rt.spec.controlled import ControlledAcceptance, accept_rng
from kestrel_rt.spec.sequence import SpecSequence
from kestrel_rt.spec.stats import SpecStats
from kestrel_rt.trace import NullTracer, Tracer
from kestrel_sim.errors import KestrelError


def worker_name(device: torch.device, role: str) -> str:
    """A trace worker: "gpu0/target", "cpu/draft", ..."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"gpu{index}/{role}"
    return f"{device.type}/{role}"


class SpecDecoder:
    """Speculative decoding of a target model with a draft model; see the module docstring.

    The caller owns the running sequences: `add` one (slots in both caches), `prefill` new
    ones, call `round` on the running ones, `release` the finished ones.
    """

    def __init__(self, target: Qwen3Model, draft: Qwen3Model, config: SpecConfig | None = None,
                 tracer: Tracer | None = None) -> None:
        if target.backend is draft.backend:
            raise KestrelError("the draft model shares its target's backend: each model "
                               "instance needs its own backend (weights must never be shared)")
        if target.shape.vocab_size != draft.shape.vocab_size:
            raise KestrelError(
                f"draft '{draft.shape.name}' has vocab_size {draft.shape.vocab_size} but target "
                f"'{target.shape.name}' has {target.shape.vocab_size}: a draft must share its "
                "target's vocabulary")
        self.target, self.draft = target, draft
        self.config = config or SpecConfig()
        self.tracer = tracer or NullTracer()
        self.k = self.config.k
        self.stats = SpecStats(self.k, controlled=self.config.controlled)
        self.controlled = (ControlledAcceptance(self.config.acceptance, self.k)
                           if self.config.controlled else None)
        self.context = min(target.shape.max_position_embeddings,
                           draft.shape.max_position_embeddings)
        self.target_worker = worker_name(target.device, "target")
        self.draft_worker = worker_name(draft.device, "draft")
        self.target_gpu = target.device.type == "cuda"  # spans: CUDA events, else host clock
        self.draft_gpu = draft.device.type == "cuda"
        self.verify_span = None  # the last round's verify span

    # -- sequences -----------------------------------------------------------------------
    def allocate_kv(self, num_slots: int, max_len: int) -> None:
        """Both caches, for sequences of up to max_len tokens (each k more, for proposals);
        a model's cache prepared at load with room enough is kept, with its CUDA graphs
        (kestrel_rt/runner.py prepare)."""
        for model in (self.target, self.draft):
            kv_cache_for(model, num_slots, max_len + self.k)

    @property
    def room(self) -> int:
        """The most tokens (prompt + generated) a sequence may reach."""
        return min(self.context, self.target.kv.max_len - self.k,
                   self.draft.kv.max_len - self.k)

    def can_allocate(self) -> bool:
        return self.target.kv.can_allocate() and self.draft.kv.can_allocate()

    def add(self, request: int, prompt: list[int], max_new_tokens: int,
            eos: frozenset[int] | set[int] = frozenset()) -> SpecSequence:
        """A new sequence with a slot in each cache and its own generators."""
        cfg = self.config
        generator = None if cfg.greedy else request_generator(cfg.seed, request)
        return SpecSequence(
            request, list(prompt), len(prompt), max_new_tokens, self.target.kv.allocate(),
            self.draft.kv.allocate(), frozenset(eos), generator,
            accept_rng(cfg.seed, request) if self.controlled else None)

    def release(self, seq: SpecSequence) -> None:
        self.target.kv.free(seq.target_slot)
        self.draft.kv.free(seq.draft_slot)

    # -- prefill -------------------------------------------------------------------------
    def prefill(self, seqs: list[SpecSequence]) -> None:
        """Both models take the prompts; each sequence emits the target's first token."""
        prompts = [s.tokens for s in seqs]
        reqs, n = [s.request for s in seqs], sum(map(len, prompts))
        with self.tracer.span("prefill", self.target_worker, reqs, tokens=n,
                              on_device=self.target_gpu):
            logits = self.target.prefill(prompts, [s.target_slot for s in seqs])  # [B, V]
            if self.config.greedy:
                first = logits.argmax(dim=-1)  # [B]
            else:
                uniforms = torch.cat([torch.rand(1, generator=s.generator) for s in seqs])
                first = sample_from(self.probs(logits), uniforms.to(logits.device))  # [B]
        with self.tracer.span("prefill", self.draft_worker, reqs, tokens=n,
                              on_device=self.draft_gpu):
            tokens, lengths = padded(prompts)
            self.draft.forward(tokens, [s.draft_slot for s in seqs], lengths, last_only=True,
                               greedy=True)
        room = self.room
        for s, t in zip(seqs, first.tolist()):
            s.emit([t], room)

    # -- the round -----------------------------------------------------------------------
    def round(self, seqs: list[SpecSequence]) -> list[list[int]]:
        """One speculative round on running sequences; returns the tokens each emitted."""
        k, room, target = self.k, self.room, self.target
        if any(s.remaining(room) < 1 for s in seqs):
            raise ValueError("round() takes running sequences only (one has nothing to emit)")
        lengths = [len(s.tokens) for s in seqs]  # L: tokens before the round
        limits = [min(k, s.remaining(room) - 1) for s in seqs]  # proposals that may count
        uniforms = self.uniforms(seqs)  # [B, 2k+1] from each request's generator, or None
        drafts, q = self.propose(seqs, uniforms)  # d_1..d_k [B, k]; draft probs [B, k, V]
        # while the GPU runs the draft steps: what verify and judge need from the host, in
        # one copy (each small copy costs ~30 us of host time: docs/performance.md)
        drawn = (self.controlled.draw([s.accept_rng for s in seqs], limits)
                 if self.controlled is not None else None)
        packed = to_device([[s.tokens[-1] for s in seqs], limits]
                           + ([drawn] if drawn is not None else []), target.device)  # [2|3, B]
        with self.trace_verify(seqs, limits, lengths) as span:
            verified = self.verify(seqs, drafts, limits, packed[0])  # ids [B, k+1] / probs
            accepted, after = self.judge(seqs, drafts, q, verified, limits, uniforms,
                                         packed)  # n, g_n
        rows = torch.cat([accepted[:, None], after[:, None], drafts], 1).tolist()  # one read
        accepted = [row[0] for row in rows]
        self.roll_back(seqs, lengths, accepted)
        if self.config.correction == "fused":
            after = [row[1] for row in rows]  # g_n from the verify
        else:  # separate: g_n from the target's last accepted input, forwarded alone
            after = self.correct(seqs, rows, q, uniforms, limits)
        span.accepted = accepted
        self.verify_span = span  # the round's verify (serving puts its prompt chunks on it)
        for limit, n in zip(limits, accepted):
            self.stats.record(limit, n)
        return [s.emit(row[2: 2 + n] + [g], room)  # d_1..d_n, g_n
                for s, row, n, g in zip(seqs, rows, accepted, after)]

    def trace_verify(self, seqs: list[SpecSequence], limits: list[int], lengths: list[int]):
        """The round's verify span (a context manager): its proposals, tokens and context."""
        return self.tracer.span("verify", self.target_worker, [s.request for s in seqs],
                                on_device=self.target_gpu, proposed=self.k,
                                tokens=sum(limits) + len(seqs), context=sum(lengths) - len(seqs),
                                extra={"controlled": self.config.controlled})

    def roll_back(self, seqs: list[SpecSequence], lengths: list[int], accepted: list[int]
                  ) -> None:
        """Both caches after a round that accepted n of each row (L tokens before it): host
        lengths only. The target keeps t0, d_1..d_n; the draft the same, never d_k."""
        for s, L, n in zip(seqs, lengths, accepted):
            self.target.kv.rollback(s.target_slot, L + n)
            self.draft.kv.rollback(s.draft_slot, L + min(n, self.k - 1))

    # -- its stages ----------------------------------------------------------------------
    def uniforms(self, seqs: list[SpecSequence]) -> torch.Tensor | None:
        """Sampling: 2k+1 uniforms per request from its own generator (k draft draws, k
        acceptance tests, the final token), [B, 2k+1] on the host; None when greedy."""
        if self.config.greedy:
            return None
        return torch.stack([torch.rand(2 * self.k + 1, generator=s.generator) for s in seqs])

    def propose(self, seqs: list[SpecSequence], uniforms: torch.Tensor | None,
                first: tuple[torch.Tensor, list[int]] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft steps -> proposals [B, k] on the target's device and, sampled, their
        draft probabilities q [B, k, V] there too (None when greedy). The first step feeds
        the tokens the draft has not cached, or `first` (tokens [B, M] on the draft's
        device, n_new) where the caller has them there (kestrel_rt/spec/ahead.py)."""
        draft, B, k = self.draft, len(seqs), self.k
        slots = [s.draft_slot for s in seqs]
        if first is None:
            first = padded([s.tokens[draft.kv.length(s.draft_slot):] for s in seqs])
        tokens, n_new = first
        drafts = torch.empty(B, k, dtype=torch.long, device=draft.device)  # [B, k]
        q = []
        if uniforms is not None:
            uniforms = uniforms[:, :k].to(draft.device)  # [B, k]
        requests = [s.request for s in seqs]
        context = sum(draft.kv.length(s) for s in slots)
        for i in range(k):
            with self.tracer.span("draft", self.draft_worker, requests,
                                  on_device=self.draft_gpu, tokens=sum(n_new), context=context):
                if uniforms is None:  # greedy: the argmax stays on the device
                    ids = self.draft_argmax(tokens, slots, n_new)  # [B, 1]
                else:
                    q.append(self.probs(draft.forward(tokens, slots, n_new, last_only=True)))
                    ids = sample_from(q[-1], uniforms[:, i])[:, None]  # [B, 1]
                drafts[:, i: i + 1].copy_(ids)  # before the next step reuses a graph's buffer
            context += sum(n_new)
            tokens, n_new = ids, [1] * B
        device = self.target.device
        return drafts.to(device), (torch.stack(q, 1).to(device) if q else None)

    def draft_argmax(self, tokens: torch.Tensor, slots: list[int], n_new: list[int]
                     ) -> torch.Tensor:
        """One greedy draft step: tokens [B, M] -> the choice after each row's last real
        token [B, 1] (M = 1 is a plain decode step, the same CUDA graph as decoding)."""
        if tokens.shape[1] == 1:
            return self.draft.forward(tokens, slots, greedy=True)  # [B, 1]
        return self.draft.forward(tokens, slots, n_new, last_only=True, greedy=True)[:, None]

    def verify(self, seqs: list[SpecSequence], drafts: torch.Tensor, limits: list[int],
               last: torch.Tensor | None = None) -> torch.Tensor:
        """The target runs [t0, d_1..d_k] in one forward (n_new = limit + 1 real rows):
        greedy, its argmax ids [B, k+1]; sampled, its probabilities [B, k+1, V]. `last`: t0
        of each sequence [B] on the target's device, where the caller copied it already."""
        target = self.target
        if last is None:
            last = to_device([s.tokens[-1] for s in seqs], target.device)  # [B]
        tokens = torch.cat([last[:, None], drafts], 1)  # [B, k+1]
        slots, n_new = [s.target_slot for s in seqs], [limit + 1 for limit in limits]
        if self.config.greedy:
            return target.forward(tokens, slots, n_new, greedy=True)  # [B, k+1]
        return self.probs(target.forward(tokens, slots, n_new))  # [B, k+1, V]

    def judge(self, seqs, drafts, q, verified, limits, uniforms, packed=None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted [B], the token after them [B]) on the target's device. `packed` [2|3, B]
        (round()'s one copy): its row 1 the limits, row 2 the controlled draws."""
        device, k = self.target.device, self.k
        limit = to_device(limits, device) if packed is None else packed[1]  # [B]
        if self.controlled is not None:
            if packed is None:
                drawn = self.controlled.draw([s.accept_rng for s in seqs], limits)
                accepted = to_device(drawn, device)  # [B]
            else:
                accepted = packed[2]  # [B]
        elif uniforms is None:
            accepted = greedy_accept(self.target.backend, drafts, verified, limit)
        else:
            u = uniforms.to(device)
            return rejection_sample(verified, q, drafts, u[:, k: 2 * k], u[:, 2 * k], limit)
        if uniforms is None:
            return accepted, verified.gather(1, accepted[:, None])[:, 0]  # g_n
        p_next = verified[torch.arange(len(seqs), device=device), accepted]  # [B, V]
        return accepted, sample_from(p_next, uniforms[:, 2 * k].to(device))

    def correct(self, seqs, rows, q, uniforms, limits) -> list[int]:
        """separate: roll the target back past its last accepted input and forward it alone;
        returns the token after it (argmax, a sample of p, or of the residual)."""
        target, k = self.target, self.k
        slots = [s.target_slot for s in seqs]
        accepted = [row[0] for row in rows]
        inputs = [[s.tokens[-1]] + row[2:] for s, row in zip(seqs, rows)]  # [t0, d_1..d_k]
        for s in slots:  # at L + n after the round's rollback: now without x[n]
            target.kv.rollback(s, target.kv.length(s) - 1)
        tokens = torch.tensor([[x[n]] for x, n in zip(inputs, accepted)])  # [B, 1]
        with self.tracer.span("correction", self.target_worker, [s.request for s in seqs],
                              on_device=self.target_gpu, tokens=len(seqs),
                              context=sum(target.kv.length(s) for s in slots)):
            if uniforms is None:
                final = target.forward(tokens, slots, greedy=True)[:, 0]  # [B]
            else:
                p = self.probs(target.forward(tokens, slots, last_only=True))  # [B, V]
                if self.controlled is None:
                    n = torch.tensor(accepted, device=p.device)
                    p = residual(p, draft_probs_at(q, n, torch.tensor(limits, device=p.device)))
                final = sample_from(p, uniforms[:, 2 * k].to(p.device))
        return final.tolist()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> probabilities after temperature and top-p, same shape."""
        flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
        return probabilities(flat, self.config.temperature, self.config.top_p).view(logits.shape)


def to_device(values: list, device: torch.device) -> torch.Tensor:
    """Host ints as an int64 tensor on `device`; to a GPU from pinned memory, asynchronously
    (a pageable copy can stall the host until the stream drains)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
