"""The scenario's speculative decoding on a worker: kestrel_rt/spec's SpecDecoder over the
worker's target and draft, with the simulator's span names, and one SpecSequence per
request (sharing the request's token list; its slots are the worker's, set each round).

Acceptance (spec.acceptance.on_hardware): controlled takes the accepted lengths from
spec.acceptance (alpha or per_position: all the draft, verify and correction work is done,
the number accepted is drawn from a seeded generator per request); organic accepts what
the target really agrees with (greedy: the longest agreeing prefix, so the output is plain
greedy generation's); auto is controlled on dummy weights (a preset target or draft: a
random draft never agrees with its target) and organic with both models from folders. The
organic pair on dummy weights is a preset draft that is a quantized copy of its preset
target (draft.quant int4-last-N, the same seed).
"""

from __future__ import annotations

from kestrel_rt.serve.requests import Sequence
from kestrel_rt.spec import SpecConfig, SpecDecoder, SpecSequence
from kestrel_rt.spec.controlled import accept_rng
from kestrel_sim.errors import ConfigError
from kestrel_sim.models import PRESETS
from kestrel_sim.scenario import Scenario


def dummy_weights(sc: Scenario) -> bool:
    """Whether the target or the draft is a preset (random weights)."""
    return sc.model in PRESETS or (sc.draft is not None and sc.draft.model in PRESETS)


def spec_config(sc: Scenario, controlled: bool) -> SpecConfig:
    """The decoder's settings from the scenario's spec (greedy; seeded by workload.seed)."""
    try:
        return SpecConfig.parse(k=sc.spec.k, correction=sc.spec.correction,
                                seed=sc.workload.seed,
                                acceptance=sc.spec.acceptance if controlled else None)
    except ConfigError as err:
        raise ConfigError(f"spec: the runtime cannot run this scenario's spec ({err})") from None


class ServingDecoder(SpecDecoder):
    """A SpecDecoder whose verify forward can carry work alongside it: `alongside()` runs
    right after the target's verify forward, inside the verify span (the mixed step's
    prompt chunks, as the simulator puts them in the verify forward)."""

    alongside = None

    def verify(self, seqs, drafts, limits, last=None):
        verified = super().verify(seqs, drafts, limits, last)
        if self.alongside is not None:
            self.alongside()
        return verified

    def sequence(self, seq: Sequence) -> SpecSequence:
        """seq's SpecSequence: the same token list, its own accepted-length generator."""
        return SpecSequence(seq.rid, seq.tokens, seq.prompt_len, seq.output_len, seq.slot,
                            seq.slot, accept_rng=accept_rng(self.config.seed, seq.rid)
                            if self.controlled is not None else None)


def build_decoder(target, draft, config: SpecConfig, target_name: str,
                  draft_name: str) -> ServingDecoder:
    decoder = ServingDecoder(target, draft, config)
    decoder.target_worker, decoder.draft_worker = target_name, draft_name  # the sim's names
    return decoder

