"""Batched generation: prefill new prompts into free KV slots, decode all running ones.

Continuous batching over a fixed number of slots: a sequence leaves the batch when it hits
max_new_tokens, an end-of-sequence token or the context, and a waiting prompt takes its
slot. Every request has its own seeded generator, so what it samples does not depend on
what it is batched with.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

import torch

from kestrel_rt.kv_cache import KVCache
from kestrel_rt.model import Chosen, Qwen3Model
from kestrel_rt.sampling import SEED_RANGE, choose, request_generator
from kestrel_sim.errors import KestrelError


class PromptTooLongError(KestrelError):
    """A prompt longer than the model's context."""


@dataclass
class GenerateResult:
    token_ids: list[list[int]]  # generated ids only, one list per prompt
    prompt_tokens: int
    prefill_s: float  # wall time in prefill forwards (incl. sampling the first token)
    decode_s: float  # wall time in decode steps
    decode_steps: int

    @property
    def generated_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens over the whole wall time (prefill + decode)."""
        total = self.prefill_s + self.decode_s
        return self.generated_tokens / total if total > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens made by decode steps over decode time (the first tokens come from prefill)."""
        n = self.generated_tokens - sum(1 for t in self.token_ids if t)
        return n / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class _Step:
    """A greedy decode step enqueued on the device whose tokens the host has not read yet."""

    slots: list[int]
    reqs: list[int]
    chosen: Chosen  # [B, 1] ids: on the device (the next step's input), to the host
    lengths: list[int]  # each slot's cache length after this step

    def read(self) -> list[int]:
        return [row[0] for row in self.chosen.read()]


def sync(device: torch.device) -> None:
    """Wait for the device's work (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_sampling(temperature: float, top_p: float, seed: int | None) -> None:
    """Sampling settings a user can get wrong, refused with what is expected."""
    if not (math.isfinite(temperature) and temperature >= 0):
        raise KestrelError(f"temperature is {temperature}: expected a finite number >= 0 "
                           "(0 is greedy)")
    if not 0 < top_p <= 1:
        raise KestrelError(f"top_p is {top_p}: expected a value in (0, 1]")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < SEED_RANGE):
        raise KestrelError(f"seed {seed} is not usable: expected an integer in "
                           f"0..{SEED_RANGE - 1} (torch's generator seeds)")


def check_prompts(prompts: list[list[int]], vocab: int, context: int, what: str) -> None:
    """Refuse an empty prompt, one that fills the context, or a token id outside the
    vocabulary, naming the prompt; `what` names the model(s) in the message."""
    for i, p in enumerate(prompts):
        if not p:
            raise KestrelError(f"prompt {i} is empty: expected at least one token id")
        if len(p) >= context:
            raise PromptTooLongError(
                f"prompt {i} has {len(p)} tokens: {what} has a context of {context} "
                f"(max_position_embeddings), so a prompt may have at most {context - 1}")
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise KestrelError(f"prompt {i} has token id {bad[0]}: expected ids in "
                               f"0..{vocab - 1} (vocab_size of {what})")


def _check(model: Qwen3Model, prompts: list[list[int]], max_new_tokens: int) -> None:
    if max_new_tokens < 0:
        raise KestrelError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    s = model.shape
    check_prompts(prompts, s.vocab_size, s.max_position_embeddings, f"model '{s.name}'")


def kv_cache_for(model: Qwen3Model, num_slots: int, max_len: int) -> KVCache:
    """The model's KV cache when it has num_slots free sequences of max_len tokens
    (one prepared at load: kestrel_rt/runner.py prepare, its graphs already captured), else
    a new one."""
    kv = model.backend.kv
    if kv is not None and kv.max_len >= max_len and kv.free_slots() >= num_slots:
        return kv
    return model.allocate_kv(num_slots, max_len)


def generate(
    model: Qwen3Model,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    max_batch: int | None = None,
    overlap: bool | None = None,
) -> GenerateResult:
    """Generate up to max_new_tokens for every prompt (token ids); greedy at temperature 0.

    Request i samples with a CPU torch.Generator seeded `(seed + i) mod 2**64` (random
    when seed is None). At most `max_batch` sequences run at once (default: all). The
    generated ids include the end-of-sequence token when one stops a sequence. A sequence
    also stops when it fills the context: prompt plus generated tokens never exceed
    max_position_embeddings.
    """
    _check(model, prompts, max_new_tokens)
    check_sampling(temperature, top_p, seed)
    if max_batch is not None and max_batch < 1:
        raise KestrelError(f"max_batch is {max_batch}: expected at least 1 sequence at once")
    out: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens == 0 or not prompts:
        return GenerateResult(out, sum(map(len, prompts)), 0.0, 0.0, 0)
    eos = set() if eos_token_id is None else (
        {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
    gens = [request_generator(seed, i) for i in range(len(prompts))]
    max_len = min(max(map(len, prompts)) + max_new_tokens, model.shape.max_position_embeddings)
    kv = kv_cache_for(model, min(len(prompts), max_batch or len(prompts)), max_len)

    def pick(logits: torch.Tensor, reqs: list[int]) -> list[int]:  # logits [B, V]
        uniforms = None
        if temperature > 0:
            uniforms = torch.cat([torch.rand(1, generator=gens[r]) for r in reqs])  # [B]
        return choose(logits, temperature, top_p, uniforms).tolist()

    waiting = deque(range(len(prompts)))
    running: dict[int, int] = {}  # slot -> request
    prefill_s = decode_s = 0.0
    steps = 0
    # Greedy on a GPU overlaps the host with the device (as vLLM's async scheduling): step
    # n + 1 is enqueued with step n's argmax still on the device, then step n's tokens are
    # read. A sequence that ends on an EOS read late has had one extra step, dropped.
    if overlap is None:
        overlap = temperature == 0 and model.device.type == "cuda"
    elif overlap and temperature != 0:
        raise KestrelError("overlap=True needs greedy decoding (temperature 0)")
    pending: _Step | None = None  # a decode step enqueued, its tokens not read yet

    def record(reqs: list[int], slots: list[int], tokens: list[int],
               lengths: list[int] | None = None) -> None:
        lengths = lengths or [kv.length(s) for s in slots]
        for r, s, t, n in zip(reqs, slots, tokens, lengths):
            if running.get(s) != r:  # ended (EOS) while this step was in flight
                continue
            out[r].append(t)
            # the cache holds every token but t: prompt + generated = length + 1 <= max_len
            if len(out[r]) >= max_new_tokens or t in eos or n + 1 >= max_len:
                del running[s]
                kv.free(s)

    def read(step: _Step) -> None:
        record(step.reqs, step.slots, step.read(), step.lengths)

    while waiting or running:
        if pending is not None and waiting:  # finishing sequences free slots for prompts
            read(pending)
            pending = None
        admitted = []
        while waiting and kv.can_allocate():
            admitted.append((kv.allocate(), waiting.popleft()))
        if admitted:
            slots, reqs = [s for s, _ in admitted], [r for _, r in admitted]
            running.update(admitted)
            t0 = time.perf_counter()
            logits = model.prefill([prompts[r] for r in reqs], slots)  # [B, V]
            tokens = pick(logits, reqs)
            sync(model.device)
            prefill_s += time.perf_counter() - t0
            record(reqs, slots, tokens)
        if not running:
            continue
        t0 = time.perf_counter()
        if pending is None:
            slots = list(running)
            reqs = [running[s] for s in slots]
            last = torch.tensor([[out[r][-1]] for r in reqs])  # [B, 1]
        else:  # the rows that go on after their pending token (an EOS is seen only later)
            keep = [i for i, (s, r, n) in enumerate(zip(pending.slots, pending.reqs,
                                                        pending.lengths))
                    if running.get(s) == r and len(out[r]) + 1 < max_new_tokens
                    and n + 1 < max_len]
            slots = [pending.slots[i] for i in keep]
            reqs = [pending.reqs[i] for i in keep]
            last = pending.chosen.tokens  # [B, 1] on the device (a graph's own input: no copy)
            if len(keep) < len(pending.slots):
                last = last[keep]
        launched = None
        if slots:
            if overlap:  # the argmax on the device (inside the decode graph of a GraphModel)
                launched = _Step(slots, reqs, model.forward_greedy(last, slots),
                                 [kv.length(s) for s in slots])
            else:
                tokens = pick(model.forward(last, slots)[:, 0], reqs)  # logits [B, V]
        if pending is not None:
            read(pending)
        pending = launched
        if slots and not overlap:
            sync(model.device)
            record(reqs, slots, tokens)
        decode_s += time.perf_counter() - t0
        steps += bool(slots)
    return GenerateResult(out, sum(map(len, prompts)), prefill_s, decode_s, steps)
