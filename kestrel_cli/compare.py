"""`kestrel run SCENARIO --on both`: the scenario on this machine's runtime and on the
simulator, held against each other.

    both = run_both(scenario, console)     # predicts, then measures
    both.files                             # hardware/*, sim/*, parity.html, comparison.json
    failures(both.rows)                    # checked metrics past validate.tolerance_pct
    again = kept_both(scenario, kept, SOURCE, console)  # again, against a kept measurement

The simulator runs first (seconds: a scenario it refuses is refused before the runtime
spends any time); each side's files are the ones `kestrel run --on sim|hardware`
writes, in OUT/hardware/ and OUT/sim/. comparison.json holds every row of the comparison
with the date and the fingerprint of the machine that measured (for committed results).

`kept_both` re-predicts a scenario measured before (`kestrel validate --measured SOURCE`: an
earlier output, or its measured.json.gz; kestrel_cli/kept.py), so a changed simulator or profile
is checked against the hardware without measuring again. It refuses a scenario that differs from the one measured in anything the
runtime ran (all but `costs` and `validate`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from kestrel_cli.kept import Kept, differing
from kestrel_sim.comparison import Row, compare, failures
from kestrel_sim.errors import KestrelError
from kestrel_sim.metrics import Metrics
from kestrel_sim.scenario import Scenario

ROOT = Path(__file__).resolve().parents[1]


class PendingScenarioError(KestrelError):
    """The scenario says the runtime cannot run it yet (validate.pending)."""


def refuse_pending(sc: Scenario) -> None:
    if sc.validate_.pending:
        raise PendingScenarioError(
            f"validate.pending: scenario {sc.name} cannot run on hardware yet: "
            f"{sc.validate_.pending.strip()} (run it on the simulator: --on sim)")


@dataclass
class Both:
    measured: Metrics
    predicted: Metrics
    rows: list[Row]
    files: dict[str, str]
    measured_on: str  # the device, as the runtime names it
    predicted_with: str  # the simulator's costs label

    @property
    def failed(self) -> list[Row]:
        return failures(self.rows)


def git_commit() -> str | None:
    """This tree's commit (with '+dirty' when files differ), or None outside git. The
    environment's KESTREL_COMMIT, where set, says it instead: a copy of the tree whose .git is
    older than its files (the GPU machine's) would name the wrong commit."""
    given = os.environ.get("KESTREL_COMMIT", "").strip()
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10,
                               check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty.strip() else "")


def fingerprint(meta: dict) -> dict:
    """Where the measurement ran: the runtime's device, backend and dtype, torch and CUDA
    versions, the GPU driver, the host and the commit."""
    out = {k: meta.get(k) for k in ("device", "backend", "dtype")}
    try:
        import torch

        out["torch"] = torch.__version__
        out["host_threads"] = torch.get_num_threads()  # a CPU draft's steps scale with them
        out["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            out["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=False
            ).stdout.strip().splitlines()[0]
    except (ImportError, OSError, IndexError, subprocess.SubprocessError):
        pass
    out["host"] = platform.node()
    out["git_commit"] = git_commit()
    return out


def comparison_doc(sc: Scenario, rows: list[Row], measured_meta: dict, costs: str) -> dict:
    """comparison.json: the verdict, every row, and where and when it was measured; with
    the CUDA graphs the measured run captured mid-run (each stalled a worker: the warm-up
    did not foresee its shape), or None where the measurement does not say."""
    return {
        "scenario": sc.name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "held_out": sc.validate_.held_out,
        "note": sc.validate_.note,
        "predicted_with": costs,
        "acceptance_controlled": bool(measured_meta.get("acceptance_controlled")),
        "graph_captures_in_run": measured_meta.get("graph_captures_in_run"),
        "fingerprint": fingerprint(measured_meta),
        "checks": sc.validate_.checks(),
        "failed": [r.metric for r in failures(rows)],
        "rows": [r.to_dict() for r in rows],
    }


def kept_both(sc: Scenario, kept: Kept | None, source: Path, console: Console,
              trace: str = "sample") -> Both:
    """Predict `sc` and compare it with its measurement `kept` (from `source`: see the module
    docstring): the files of `run_both`, with the kept measurement's metrics, scenario and
    fingerprint (comparison.json's `measured_at`: where and when it was measured)."""
    from kestrel_cli.render import costs_label, render_run, simulate_with_progress
    from kestrel_sim.stage_audit import reprice
    from kestrel_sim.trace import Trace
    from reports.parity import parity_report

    if kept is None:
        raise KestrelError(f"--measured holds no measurement of {sc.name} (in {source}): "
                           "run it with --on both first")
    ran, now = kept.scenario, sc.model_dump(mode="json")
    differ = differing(ran, now)
    if differ:
        raise KestrelError(f"--measured: {sc.name} in {source} was measured with other values "
                           f"of {', '.join(differ)} than the scenario now has: measure it "
                           "again (--on both)")
    measured = Metrics.model_validate(kept.metrics)
    before = kept.comparison
    meta = {**before.get("fingerprint", {}), "source": "hardware",
            "acceptance_controlled": before.get("acceptance_controlled", False),
            "graph_captures_in_run": before.get("graph_captures_in_run")}
    costs = costs_label(sc)
    predicted_trace = simulate_with_progress(sc, console, trace)
    predicted, sim_files = render_run(sc, predicted_trace)
    rows = compare(measured, predicted, sc.validate_, meta["acceptance_controlled"])
    doc = comparison_doc(sc, rows, meta, costs)
    audit = None
    if before.get("stage_audit"):  # the kept stages, priced by today's costs
        audit = doc["stage_audit"] = reprice(before["stage_audit"], scenario_costs(sc))
    if before.get("gaps") is not None:  # what only the measured trace told: kept as is
        doc["gaps"] = before["gaps"]
    doc["fingerprint"] = before.get("fingerprint", {})  # the machine that measured
    doc["measured_at"] = before.get("measured_at") or before.get("date")
    doc["predicted_at"] = git_commit()
    files = {"hardware/metrics.json": measured.model_dump_json(indent=2),
             "hardware/scenario.json": json.dumps(ran, indent=2)}
    files |= {f"sim/{name}": text for name, text in sim_files.items()}
    files["parity.html"] = parity_report(sc.name, rows, measured, predicted,
                                         Trace(spans=[], requests=[], meta=meta),
                                         predicted_trace, now, audit)
    files["comparison.json"] = json.dumps(doc, indent=2)
    return Both(measured, predicted, rows, files, str(meta.get("device")), costs)


def scenario_costs(sc: Scenario):
    """The SimCosts the simulator prices `sc`'s steps with (kestrel_sim.costs.build)."""
    import numpy as np

    from kestrel_sim.costs.build import build_costs

    return build_costs(sc, np.random.default_rng(sc.workload.seed))


def audit_of(sc: Scenario, measured_trace) -> list[dict]:
    """The measured run's stages priced by the scenario's costs (kestrel_sim.stage_audit),
    from every span the runtime recorded (the measured Trace is kept whole)."""
    from kestrel_sim.stage_audit import stage_audit

    return stage_audit(measured_trace, scenario_costs(sc))


def traced_doc(measured_trace, predicted_trace) -> dict:
    """Per worker, the share of its working time its steps cover, measured and predicted
    (kestrel_sim/traced.py; the rest is time between steps: the host's, or the simulator's
    round overheads); predicted None where the simulator's trace kept a sample only."""
    from kestrel_sim.traced import traced_share

    measured = traced_share(measured_trace)
    complete = (predicted_trace.meta.get("trace") or {}).get("complete", True)
    predicted = traced_share(predicted_trace) if complete else {}
    return {w: {"measured": measured[w]["working"],
                "predicted": predicted[w]["working"] if w in predicted else None}
            for w in measured}


def run_both(sc: Scenario, console: Console, trace: str = "sample",
             include_raw: bool = False) -> Both:
    """Predict `sc` on the simulator, measure it on this machine, compare; the files of
    both runs and of the comparison, not yet written."""
    from kestrel_cli.render import costs_label, render_run, simulate_with_progress
    from kestrel_cli.run_hardware import run_on_hardware
    from kestrel_sim.gaps import gap_causes
    from reports.parity import parity_report

    refuse_pending(sc)
    costs = costs_label(sc)
    # predicted first: seconds, and whatever the simulator refuses is refused before the
    # runtime spends any device time
    predicted_trace = simulate_with_progress(sc, console, trace)
    measured_trace = run_on_hardware(sc, console)
    measured, hw_files = render_run(sc, measured_trace, include_raw)
    predicted, sim_files = render_run(sc, predicted_trace, include_raw)
    controlled = bool(measured_trace.meta.get("acceptance_controlled"))
    rows = compare(measured, predicted, sc.validate_, controlled)
    doc = comparison_doc(sc, rows, measured_trace.meta, costs)
    audit = audit_of(sc, measured_trace)
    doc["stage_audit"] = audit
    doc["traced"] = traced_doc(measured_trace, predicted_trace)
    doc["gaps"] = gap_causes(measured_trace)  # the measured loops' time between steps, why
    files = {f"hardware/{name}": text for name, text in hw_files.items()}
    files |= {f"sim/{name}": text for name, text in sim_files.items()}
    files["parity.html"] = parity_report(sc.name, rows, measured, predicted, measured_trace,
                                         predicted_trace, sc.model_dump(mode="json"), audit,
                                         doc["traced"])
    files["comparison.json"] = json.dumps(doc, indent=2)
    return Both(measured, predicted, rows, files, str(measured_trace.meta.get("device")), costs)
