"""Speculative decoding: a draft model proposes, the target verifies (see round.py)."""

from kestrel_rt.spec.config import SpecConfig
from kestrel_rt.spec.generate import SpecResult, speculative_generate
from kestrel_rt.spec.round import SpecDecoder
from kestrel_rt.spec.sequence import SpecSequence
from kestrel_rt.spec.stats import SpecStats

__all__ = ["SpecConfig", "SpecDecoder", "SpecResult", "SpecSequence", "SpecStats",
           "speculative_generate"]
