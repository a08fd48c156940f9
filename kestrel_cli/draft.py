"""`kestrel generate --draft`: speculative generation from the command line.

    kestrel generate --model qwen3-8b --draft qwen3-0.6b --k 4 --correction fused \
        --prompt-ids 1,2,3 --max-new-tokens 64 [--draft-device cpu] [--alpha 0.8] --json

The draft is its own model instance on its own backend (kestrel_rt/runner.py), on the
target's device unless --draft-device says otherwise (a CPU draft runs the torch backend).
Greedy output equals plain greedy generation token for token; --alpha (or random dummy
weights, which never agree) makes acceptance controlled: all the real draft, verify and
correction work, the number accepted drawn with probability alpha per token.
"""

from __future__ import annotations

from typing import Any

from kestrel_sim.errors import KestrelError

CORRECTIONS = ("fused", "separate")


class DraftError(KestrelError):
    """A --draft / --k / --correction / --draft-device choice that cannot run."""


def check_draft(draft: str, k: int, correction: str, target_shape: Any) -> Any:
    """The draft's shape, after refusing what cannot run with this target (before loading)."""
    from kestrel_rt.loading import resolve

    if correction not in CORRECTIONS:
        raise DraftError(f"--correction '{correction}' is not a correction mode: expected one "
                         f"of {', '.join(CORRECTIONS)}")
    if not 1 <= k <= 16:
        raise DraftError(f"--k {k}: expected 1..16 draft tokens per round")
    shape, _ = resolve(draft)
    if shape.vocab_size != target_shape.vocab_size:
        raise DraftError(
            f"draft '{draft}' has vocab_size {shape.vocab_size} but the target "
            f"'{target_shape.name}' has {target_shape.vocab_size}: a draft must share its "
            "target's vocabulary")
    return shape


def run_speculative(target, draft: str, draft_shape, draft_device, ids: list[int],
                    max_new_tokens: int, k: int, correction: str, temperature: float,
                    top_p: float, seed: int | None, eos, alpha: float | None):
    """Build and prepare the draft (checked by check_draft: `draft_shape`), then generate:
    (SpecResult, draft load seconds)."""
    import time

    from kestrel_rt.options import default_options
    from kestrel_rt.runner import build_model, prepare
    from kestrel_rt.spec import SpecConfig, speculative_generate
    from kestrel_sim.scenario import Acceptance

    t0 = time.perf_counter()
    model = build_model(draft, draft_device, None, None,
                        default_options(draft_device, draft_shape), seed=0)
    max_len = len(ids) + max_new_tokens + k
    prepare(model, 1, max_len, new_tokens=(1,), prefill=(len(ids), 2))
    load_s = time.perf_counter() - t0
    acceptance = None if alpha is None else Acceptance(alpha=alpha)
    config = SpecConfig.parse(k=k, correction=correction, temperature=temperature,
                              top_p=top_p, seed=seed, acceptance=acceptance)
    return speculative_generate(target, model, [ids], max_new_tokens, config,
                                eos_token_id=eos), load_s
