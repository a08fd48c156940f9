"""Batched speculative generation of a closed set of prompts: what `kestrel generate --draft`
runs. Continuous batching over a fixed number of slots, as kestrel_rt.engine.generate: a
sequence leaves at max_new_tokens, an end-of-sequence token or the context, and a waiting
prompt takes its slots (one in each model's cache). Greedy controlled rounds with the fused
correction run ahead of the host (kestrel_rt/spec/ahead.py); the others are
SpecDecoder.round, one at a time."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kestrel_rt.engine import GenerateResult, check_prompts, sync
from kestrel_rt.model import Qwen3Model
from kestrel_rt.spec.ahead import ahead_rounds, runs_ahead
from kestrel_rt.spec.config import SpecConfig
from kestrel_rt.spec.round import SpecDecoder
from kestrel_rt.spec.stats import SpecStats
from kestrel_rt.trace import Tracer
from kestrel_sim.errors import KestrelError


@dataclass
class SpecResult(GenerateResult):
    """GenerateResult (decode_steps counts rounds) with the speculative statistics;
    rounds_ahead of the rounds were launched before the host read the round before."""

    stats: SpecStats | None = None
    rounds_ahead: int = 0


def check_request(decoder: SpecDecoder, prompts: list[list[int]], max_new: list[int]) -> None:
    """Prompts and limits a user can get wrong, refused with what is expected."""
    for i, n in enumerate(max_new):
        if n < 0:
            raise KestrelError(f"max_new_tokens of prompt {i} is {n}: expected >= 0")
    name = decoder.target.shape.name
    check_prompts(prompts, decoder.target.shape.vocab_size, decoder.context,
                  f"target '{name}' and its draft")



def speculative_generate(
    target: Qwen3Model,
    draft: Qwen3Model,
    prompts: list[list[int]],
    max_new_tokens: int | list[int],
    config: SpecConfig | None = None,
    eos_token_id: int | list[int] | None = None,
    max_batch: int | None = None,
    tracer: Tracer | None = None,
    run_ahead: bool = True,
) -> SpecResult:
    """Generate up to max_new_tokens (one for all, or one per prompt) for every prompt,
    speculatively with `draft`; greedy output equals kestrel_rt.engine.generate's token for
    token. At most max_batch sequences run at once (default: all). The generated ids include
    the end-of-sequence token that stops a sequence; prompt + generated never exceed the
    context (the smaller max_position_embeddings of the two models). With run_ahead, rounds
    that can run ahead of the host do (kestrel_rt/spec/ahead.py: the same tokens, statistics
    and spans); False runs every round with SpecDecoder.round (for comparison)."""
    config = config or SpecConfig()
    decoder = SpecDecoder(target, draft, config, tracer)
    max_new = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
               else list(max_new_tokens))
    if len(max_new) != len(prompts):
        raise KestrelError(f"{len(max_new)} max_new_tokens for {len(prompts)} prompts: "
                           "expected one per prompt (or one number for all)")
    check_request(decoder, prompts, max_new)
    if max_batch is not None and max_batch < 1:
        raise KestrelError(f"max_batch is {max_batch}: expected at least 1 sequence at once")
    eos = frozenset() if eos_token_id is None else frozenset(
        [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
    out: list[list[int]] = [[] for _ in prompts]
    waiting = deque(i for i, n in enumerate(max_new) if n > 0)
    if not waiting:
        return SpecResult(out, sum(map(len, prompts)), 0.0, 0.0, 0, decoder.stats)
    longest = max(len(prompts[i]) + max_new[i] for i in waiting)
    decoder.allocate_kv(min(len(waiting), max_batch or len(waiting)),
                        min(longest, decoder.context))
    ahead = run_ahead and runs_ahead(decoder, eos)
    running = []
    prefill_s = decode_s = 0.0
    rounds = rounds_ahead = 0
    while waiting or running:
        admitted = []
        while waiting and decoder.can_allocate():
            i = waiting.popleft()
            admitted.append(decoder.add(i, prompts[i], max_new[i], eos))
        if admitted:
            t0 = time.perf_counter()
            decoder.prefill(admitted)
            sync(target.device)
            sync(draft.device)
            prefill_s += time.perf_counter() - t0
            running += admitted
        if running := finish(decoder, running, out):
            t0 = time.perf_counter()
            # ahead until a round leaves a row done (no slot frees before), unless a prompt
            # waits for a slot that is free now (it joins after this round)
            if ahead and not (waiting and decoder.can_allocate()):
                n, n_ahead = ahead_rounds(decoder, running)
            else:
                decoder.round(running)
                n, n_ahead = 1, 0
            sync(target.device)
            sync(draft.device)
            decode_s += time.perf_counter() - t0
            rounds += n
            rounds_ahead += n_ahead
            running = finish(decoder, running, out)
    return SpecResult(out, sum(map(len, prompts)), prefill_s, decode_s, rounds, decoder.stats,
                      rounds_ahead)


def finish(decoder: SpecDecoder, running: list, out: list[list[int]]) -> list:
    """Release the sequences that are done (their tokens into `out`); the rest go on."""
    for s in running:
        if s.done:
            out[s.request] = s.generated
            decoder.release(s)
    return [s for s in running if not s.done]
