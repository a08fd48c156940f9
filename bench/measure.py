"""Measurement pieces of bench/h200_decode.py: ceilings, bytes and flops per step, timed
decode / verify / prefill steps of a GraphModel, and transformers' eager generate."""

from __future__ import annotations

import statistics
import time

import torch

from kestrel_rt.cuda.timing import (
    median_event_s,
    time_graph,  # noqa: F401  (the benchmarks' import point)
)
from kestrel_rt.quant_weights import QuantizedWeight


# -- ceilings --------------------------------------------------------------------------------
def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy of random bf16 data: (bytes read + written) / s, median of 10."""
    a = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    return nbytes / median_event_s(lambda: b.copy_(a), 10)


def matmul_flops(n: int = 8192) -> float:
    """bf16 n x n x n matmul on random data, FLOP/s, median of 10."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    return 2 * n**3 / median_event_s(lambda: a @ b, 10)


# -- bytes and flops of a step -----------------------------------------------------------------
def _nbytes(w) -> int:
    if isinstance(w, QuantizedWeight):
        return w.nbytes
    return w.numel() * w.element_size()


def expected_experts(shape, tokens: int) -> float:
    """Distinct experts a layer reads for `tokens` tokens under uniform top-k routing."""
    e, k = shape.num_experts, shape.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens)


def weight_bytes_per_step(model, tokens: int) -> float:
    """Weight bytes one forward of `tokens` new tokens reads: every weight once, except the
    embedding (one row per token, unless tied: then lm_head reads it whole) and MoE experts
    (only the distinct experts hit)."""
    be, shape = model.backend, model.shape
    lm_head = be.weight("lm_head")
    seen, total = set(), 0.0
    for key in be.weight_names():
        name = key.split("/", 1)[1]
        w = be.weight(name)
        if id(w) in seen:
            continue
        seen.add(id(w))
        size = _nbytes(w)
        if name == "embed" and w is not lm_head:
            size = tokens * shape.hidden_size * w.element_size()
        elif "experts" in name:
            size *= expected_experts(shape, tokens) / shape.num_experts
        total += size
    return total


def shape_weight_bytes(shape, itemsize: int = 2) -> float:
    """Weight bytes a batch-1 decode step of a dense `shape` reads in bf16 (embedding: one
    row, unless tied)."""
    from kestrel_rt.weights import expected_tensors

    total = 0.0
    for name, dims in expected_tensors(shape).items():
        n = itemsize
        for d in dims:
            n *= d
        if name == "model.embed_tokens.weight" and not shape.tie_word_embeddings:
            n = shape.hidden_size * itemsize
        total += n
    return total


def kv_bytes_per_step(shape, batch: int, m: int, context: int, itemsize: int = 2) -> float:
    """K/V bytes read (context + new tokens) and written (new tokens) by one step."""
    per_token = shape.kv_elements_per_token * itemsize
    return batch * per_token * (context + 2 * m)


def step_flops(shape, batch: int, m: int, context: int) -> float:
    """Matmul + attention FLOPs of one step (active parameters only, no embedding)."""
    h, d = shape.hidden_size, shape.head_dim
    hq, hkv = shape.num_attention_heads, shape.num_key_value_heads
    attn_params = h * (hq + 2 * hkv) * d + hq * d * h
    if shape.is_moe:
        mlp = 3 * h * shape.moe_intermediate_size * shape.num_experts_per_tok
    else:
        mlp = 3 * h * shape.intermediate_size
    params = shape.num_hidden_layers * (attn_params + mlp) + shape.vocab_size * h
    tokens = batch * m
    # each new token attends to context + its causal prefix (mean m / 2)
    attn = 4 * shape.num_hidden_layers * hq * d * tokens * (context + m / 2)
    return 2 * params * tokens + attn


# -- timed steps -----------------------------------------------------------------------------
def time_steps(model, batch: int, m: int, context: int, steps: int, gen,
               max_s: float = 6.0) -> dict:
    """`steps` forwards of [batch, m] new tokens per sequence at `context` cached tokens.

    Like a greedy decode loop with overlap scheduling (what vLLM's async scheduling and
    SGLang's overlap scheduler do), and as kestrel_rt.engine.generate runs one: the argmax
    of step n (model.forward_greedy: inside a GraphModel's graph, which also writes the ids
    to the host) stays on the device and is step n + 1's input (m = 1), the host enqueues
    step n + 1 and only then reads step n's tokens (a sync on step n alone), so host work
    hides behind the device. Lengths roll back
    to `context` after each step so every step sees the same context (the cache holds random
    garbage there; timing does not depend on values). A first forward captures the graph,
    then four steps of the same loop warm it up (pinned buffers, the copy back). Stops early
    after `max_s` seconds (slow eager configurations). Returns wall tok/s (from the first
    step's enqueue to the last step's tokens on the host: the loop's start and end are in it,
    so few steps understate the steady rate) and the median device time of one forward
    (CUDA events around it).
    """
    kv = model.kv
    slots = [kv.allocate() for _ in range(batch)]
    try:
        for s in slots:
            kv.advance([s], [context])
        tok = torch.randint(0, model.shape.vocab_size, (batch, m), generator=gen)
        tok = tok.to(model.device)

        def one(tok: torch.Tensor):
            chosen = model.forward_greedy(tok, slots)  # ids [B, M], on their way to the host
            for s in slots:
                kv.rollback(s, context)
            return chosen

        def loop(tok: torch.Tensor, n: int) -> tuple[float, list]:
            """n overlapped steps: (wall seconds, [(start, end) events])."""
            events, pending = [], None
            t0 = time.perf_counter()
            for _ in range(n):
                if len(events) >= 4 and time.perf_counter() - t0 > max_s:
                    break
                s_ev = torch.cuda.Event(enable_timing=True)
                e_ev = torch.cuda.Event(enable_timing=True)
                s_ev.record()
                chosen = one(tok)
                e_ev.record()
                if m == 1:
                    tok = chosen.tokens  # [B, 1] on the device
                if pending is not None:  # the host reads the previous step's tokens
                    pending.read()
                pending = chosen
                events.append((s_ev, e_ev))
            if pending is not None:
                pending.read()
            return time.perf_counter() - t0, events

        one(tok)  # captures the graph
        loop(tok, 4)  # warm-up of the whole loop (pinned buffers, the async copy back)
        torch.cuda.synchronize()
        wall, events = loop(tok, steps)
        ms = statistics.median(s.elapsed_time(e) for s, e in events)
        steps = len(events)
    finally:
        for s in slots:
            kv.free(s)
    return {"tok_s": batch * m * steps / wall, "ms": ms, "samples": steps,
            "replays": getattr(model, "replays", 0)}


def time_prefill(model, length: int, reps: int, gen) -> dict:
    """One prompt of `length` tokens into an empty slot (eager: cuBLAS + torch attention)."""
    kv = model.kv
    slot = kv.allocate()
    try:
        prompt = torch.randint(0, model.shape.vocab_size, (1, length), generator=gen)
        model.forward(prompt, [slot], last_only=True)  # warm-up
        kv.rollback(slot, 0)
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            model.forward(prompt, [slot], last_only=True)
            e.record()
            e.synchronize()
            kv.rollback(slot, 0)
            times.append(s.elapsed_time(e))
    finally:
        kv.free(slot)
    ms = statistics.median(times)
    return {"tok_s": length / ms * 1e3, "ms": ms, "samples": reps}


# -- transformers baseline -------------------------------------------------------------------
def transformers_generate(shape, new_tokens: tuple[int, int] = (8, 40)) -> dict:
    """transformers' eager `generate` (greedy) on a random-weight model of `shape`, bf16.

    Decode tok/s from the difference of two generate calls (so the prompt pass cancels)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        tie_word_embeddings=shape.tie_word_embeddings, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta})
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(old)
    prompt = torch.randint(0, shape.vocab_size, (1, 32), device="cuda")
    walls = []
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        for n in new_tokens:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
    del model
    torch.cuda.empty_cache()
    return {"tok_s": (new_tokens[1] - new_tokens[0]) / (walls[1] - walls[0]),
            "ms": (walls[1] - walls[0]) / (new_tokens[1] - new_tokens[0]) * 1e3,
            "samples": new_tokens[1] - new_tokens[0]}


# -- where a decode step's time goes ------------------------------------------------------------
def kernel_breakdown(model, context: int, steps: int = 5) -> dict:
    """Per-kernel device time of batch-1 decode steps (graph replays, torch.profiler/CUPTI).

    Returns {"step_ms": device time of one step (events), "kernels": [(name, launches per
    step, us per step)], "busy_ms": summed kernel time per step}: step_ms - busy_ms is the
    time between kernels (launch gaps, ramp-up and tail)."""
    from torch.profiler import ProfilerActivity, profile

    kv = model.kv
    slot = kv.allocate()
    try:
        kv.advance([slot], [context])
        tok = torch.zeros(1, 1, dtype=torch.long)

        def one():
            model.forward(tok, [slot], greedy=True)  # as time_steps: the argmax in the step
            kv.rollback(slot, context)

        for _ in range(3):
            one()
        torch.cuda.synchronize()
        step_s = median_event_s(one, 10)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                one()
            torch.cuda.synchronize()
    finally:
        kv.free(slot)
    totals: dict[str, list[float]] = {}
    spans = []  # (name, start us, end us) of every device event
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        name = ev.name if len(ev.name) <= 60 else ev.name[:57] + "..."
        t = totals.setdefault(name, [0, 0.0])
        t[0] += 1
        t[1] += ev.device_time
        spans.append((name, ev.time_range.start, ev.time_range.end))
    kernels = sorted(((n, c / steps, us / steps) for n, (c, us) in totals.items()),
                     key=lambda r: -r[2])
    advance, idle = frontier(spans)
    return {"step_ms": step_s * 1e3, "kernels": kernels,
            "busy_ms": sum(r[2] for r in kernels) / 1e3,
            "advance": sorted(((n, us / steps) for n, us in advance.items()), key=lambda r: -r[1]),
            "idle_us": idle / steps}


def breakdown_table(b: dict, top: int = 14) -> list[str]:
    """Markdown lines of a kernel_breakdown: per kernel its launches, its summed duration and
    what it adds to the step (frontier; with PDL the durations include early waits)."""
    adds = dict(b["advance"])
    lines = ["| kernel | launches / step | us / step | us each | adds us / step |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| `{n}` | {c:g} | {us:.1f} | {us / c:.2f} | {adds.get(n, 0.0):.1f} |"
              for n, c, us in b["kernels"][:top]]
    lines.append(f"| (nothing running, between steps too) | | | | {b['idle_us']:.1f} |")
    return lines


def frontier(spans) -> tuple[dict[str, float], float]:
    """What each kernel adds to the device's timeline when kernels overlap (PDL): events
    (name, start, end) in start order push the completion frontier (the latest end so far);
    a kernel's share is how far its end moves it, the idle time is where nothing runs. The
    shares and the idle time add up to the span from the first start to the last end, so
    they say what a kernel costs the step rather than how long it was resident (with PDL a
    kernel launched early waits inside its own duration). Returns ({name: share}, idle)."""
    shares: dict[str, float] = {}
    idle, front = 0.0, None
    for name, start, end in sorted(spans, key=lambda r: (r[1], r[2])):
        if front is None:
            front = start
        if start > front:
            idle += start - front
            front = start
        shares[name] = shares.get(name, 0.0) + max(0.0, end - front)
        front = max(front, end)
    return shares, idle
