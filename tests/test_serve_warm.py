"""Serving's warm-up captures every CUDA graph a run replays, prompts of several chunks and
chunks cut by max_batched_tokens included: on the CPU, with a GraphModel whose capture
records the graph's shape and whose replay runs the captured step from its static buffers
(what a CUDA graph does), serving counts no capture in the run (trace meta
graph_captures_in_run) and still gives plain greedy generation's tokens. Without warming
mid-sequence starts, the same run captures prefill graphs mid-run: the stall this guards
against (110 ms for a continuation chunk of an 8B model on the H200)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kestrel_rt.backend.torch_backend import TorchBackend
from kestrel_rt.cuda.graphs import Captured, GraphModel, static_step
from kestrel_rt.engine import generate
from kestrel_rt.loading import load_folder
from kestrel_rt.model import Chosen
from kestrel_rt.serve import build, forward, serve
from kestrel_rt.serve.models import build_model
from kestrel_sim.scenario import Scenario

PREFILL_BUCKETS = (32, 64)  # chunks of 17..64 tokens replay a prefill graph
MIN_KEYS = 64  # keys levels 64, 128, 256 and the whole cache, as 2048, 4096, ... on a GPU


class ReplayedGraphModel(GraphModel):
    """A GraphModel on the CPU: `_capture` keeps the step's static buffers and a 'graph'
    whose replay computes the step from them into its static output."""

    def _capture(self, key, tokens, meta):
        rows, m, last_only, greedy, keys = key
        inputs = meta.clone()
        static = torch.zeros(rows, m, dtype=torch.long)
        static[: tokens.shape[0], : tokens.shape[1]] = tokens
        step = static_step(inputs, rows, m, keys)
        eager = self.compute(static, step, last_only, greedy).clone()
        # greedy decode writes its ids over its token input, as the real graph does
        out = static if greedy and m == 1 else eager.clone()

        def replay():
            out.copy_(self.compute(static, step, last_only, greedy))

        cap = Captured(SimpleNamespace(replay=replay), inputs, step, static, out, None)
        self.graphs[key] = cap
        self.captures += 1
        return eager, cap

    def forward_greedy(self, tokens, slots, n_new=None, last_only=False) -> Chosen:
        """The ids copied out of the static buffer at once: what the GPU's copy to the host,
        ordered on the stream before the next replay, reads (a round run ahead replays
        before the host reads the ids of the one before)."""
        out = self.forward(tokens, slots, n_new, last_only, greedy=True)
        return Chosen(out, out.clone(), None)


def replayed_model(name_or_folder, device, dtype=None, quant="none"):
    shape, weights = load_folder(name_or_folder, "cpu", torch.float32)
    backend = TorchBackend("cpu", torch.float32)
    backend.graph_safe = lambda rows, m: True
    return ReplayedGraphModel(shape, weights, backend, prefill_buckets=PREFILL_BUCKETS,
                              prefill_min_keys=MIN_KEYS)


@pytest.fixture
def graphed(monkeypatch):
    """serve() builds ReplayedGraphModels; the models it built, by build order."""
    built = []

    def make(*args, **kwargs):
        built.append(replayed_model(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(build, "build_model", make)
    return built


def scenario(folder, serving: dict, k: int = 0) -> Scenario:
    """Prompts of up to four 64-token chunks (the tiny model's context is 256), all sent at
    once; k > 0 speculates with the target's folder as its draft."""
    spec = {} if not k else {
        "draft": {"model": str(folder), "device": "cpu"},
        "spec": {"k": k, "correction": "fused", "acceptance": {"alpha": 0.5}}}
    return Scenario.load_from_dict({
        "name": "tiny-chunks", "hardware": "cpu-xeon", "model": str(folder),
        "serving": serving, **spec,
        "workload": {"arrivals": {"process": "closed", "concurrency": 6, "think_time_s": 0},
                     "requests": 6,
                     "prompt_tokens": {"dist": "uniform", "low": 40, "high": 200},
                     "output_tokens": {"dist": "uniform", "low": 2, "high": 12},
                     "seed": 1}})


def same_as_greedy(served, folder) -> None:
    reference = build_model(str(folder), "cpu")
    longest = max(len(out) for out in served.outputs)
    expected = generate(reference, served.prompts, longest).token_ids
    for i, out in enumerate(served.outputs):
        assert out == expected[i][:len(out)], f"request {i}"


CHUNKED = {"max_batch": 3, "max_batched_tokens": 100, "prefill_chunk": 64}


@pytest.mark.parametrize(("serving", "k"), [
    (CHUNKED, 0),
    (CHUNKED, 2),
    ({**CHUNKED, "mode": "disaggregated"}, 0),
], ids=["colocated", "speculative", "disaggregated"])
def test_a_run_captures_no_graph_after_its_warm_up(folder, graphed, serving, k):
    served = serve(scenario(folder, serving, k), "cpu", threads=False)
    assert served.trace.meta["graph_captures_in_run"]["count"] == 0
    same_as_greedy(served, folder)
    assert all(m.replays > 0 for m in graphed)
    prefill = {key[4] for m in graphed for key in m.graphs if key[1] in PREFILL_BUCKETS}
    assert {64, 128, 256} <= prefill  # chunks after the first read more keys
    if serving.get("mode") == "disaggregated":  # no prefill graph on the decode worker
        prefill_worker, decode_worker = graphed
        assert any(key[1] in PREFILL_BUCKETS for key in prefill_worker.graphs)
        assert not any(key[1] in PREFILL_BUCKETS for key in decode_worker.graphs)
        assert not any(key[1] == 1 and not key[2] for key in prefill_worker.graphs)


def test_warming_starts_at_zero_only_leaves_captures_to_the_run(folder, graphed, monkeypatch):
    monkeypatch.setattr(build, "chunk_limits",
                        lambda s, prompt, request: (forward.chunk_limits(s, prompt, request)[0],
                                                    False))
    served = serve(scenario(folder, CHUNKED), "cpu", threads=False)
    assert served.trace.meta["graph_captures_in_run"]["count"] > 0
    same_as_greedy(served, folder)
