"""`kestrel validate FOLDER --out OUT`: every scenario of a folder (scenarios/validation/)
run on both sides and compared, or only predicted (`--on sim`), then one summary.

    kestrel validate scenarios/validation --out runs/validation            # measure + predict
    kestrel validate scenarios/validation --out runs/validation --on sim   # predictions only
    kestrel validate scenarios/validation --out runs/validation --only a,b # a chunk
    kestrel validate scenarios/validation --out runs/again --measured runs/validation
                                          # predict again, against the kept measurements
                                          # (the folder, or its measured.json.gz)

Each scenario's files go to OUT/NAME/ (those of `kestrel run --on both`, or of `--on sim`);
a later run replaces a scenario's folder and keeps the others, and the summary
(OUT/summary.md, summary.json, summary.html; kestrel_cli.suite_summary, reports/suite.py)
is rebuilt from every folder
present, so a suite run in chunks adds up; on both sides OUT/measured.json.gz gathers every
measurement of OUT (kestrel_cli/kept.py: what to keep, and what --measured reads back). A
scenario that cannot run (validate.pending, a
refusal, a crash) is recorded and the others go on. Exit status 1 when a compared scenario
is past its tolerance or a run failed; 2 for a bad folder or scenario file.
"""

from __future__ import annotations

import fnmatch
import json
import os
import traceback
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kestrel_cli.kept import BUNDLE, Kept, load_kept, write_bundle
from kestrel_cli.outdir import output_folder
from kestrel_cli.simulate import BOTH_FILES, RUN_FILES, SET_HELP
from kestrel_cli.suite_summary import entry_of, markdown, summarize
from kestrel_sim.errors import ConfigError, KestrelError, OutputError
from kestrel_sim.scenario import Scenario, load_scenario

SUMMARY_FILES = ("summary.md", "summary.json", "summary.html", BUNDLE)


class SuiteOn(str, Enum):
    both = "both"
    sim = "sim"


def load_suite(folder: Path, overrides: list[str]) -> list[tuple[Path, Scenario]]:
    """Every *.yaml of `folder`, validated (all problems before anything runs), by name."""
    if not folder.is_dir():
        raise ConfigError(f"{folder}: not a folder of scenario YAML files")
    paths = sorted(folder.glob("*.yaml"))
    if not paths:
        raise ConfigError(f"{folder}: holds no *.yaml scenario")
    suite = [(p, load_scenario(p, overrides)) for p in paths]
    names = [sc.name for _, sc in suite]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"{folder}: scenario names must differ (OUT/NAME holds each "
                          f"scenario's files); used more than once: {', '.join(twice)}")
    return suite


def check_out(out: Path, names: set[str]) -> None:
    """OUT is new, or holds only this command's files (summaries, scenario folders)."""
    if out.exists() and not out.is_dir():
        raise OutputError(f"--out {out}: exists and is not a folder; give a folder path")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir()
                         if p.name not in names and p.name not in SUMMARY_FILES)
        if foreign:
            raise OutputError(
                f"--out {out} holds entries that are neither a scenario of the suite nor a "
                f"summary ({', '.join(foreign[:5])}): give a new --out")


def run_one(sc: Scenario, path: Path, out: Path, on: SuiteOn, console: Console,
            measured: tuple[Path, dict[str, Kept]] | None = None) -> None:
    """Run one scenario and write OUT/NAME (raises on a refusal or a crash); with
    `measured` (its source and what it keeps), predict it against its kept measurement."""
    from kestrel_cli.compare import kept_both, run_both
    from kestrel_cli.render import render_run, simulate_with_progress

    kept = None
    if measured is not None:  # (read before OUT/NAME is replaced: OUT may be the source)
        source, runs = measured
        kept = kept_both(sc, runs.get(sc.name), source, console).files
    with output_folder(out / sc.name, False, RUN_FILES | BOTH_FILES, inputs=(path,)) as f:
        if kept is not None:
            files = kept
        elif on is SuiteOn.both:
            files = run_both(sc, console).files
        else:
            _, files = render_run(sc, simulate_with_progress(sc, console))
        f.commit(files)


def earlier_problems(out: Path, rerun: set[str]) -> dict[str, str]:
    """Errors an earlier chunk recorded (summary.json) for scenarios not run again now and
    with no folder since."""
    try:
        doc = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return {e["name"]: e["note"] for e in doc.get("scenarios", [])
            if e.get("status") == "error" and e["name"] not in rerun
            and not (out / e["name"]).is_dir()}


def write_summary(out: Path, suite, problems: dict[str, str], title: str) -> dict:
    """OUT/summary.json, summary.md and summary.html (reports/suite.py: its figures), each
    replaced whole."""
    from reports.suite import suite_report

    entries = [entry_of(sc, out / sc.name, problems.get(sc.name)) for _, sc in suite]
    doc = summarize(entries)
    for name, text in (("summary.json", json.dumps(doc, indent=2)),
                       ("summary.md", markdown(doc, title)),
                       ("summary.html", suite_report(doc, title))):
        tmp = out / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)
    return doc


def chosen_names(only: str, names: set[str], folder: Path) -> set[str]:
    """The scenarios `--only` names: comma-separated names or shell patterns ('ladder-*');
    one that matches no scenario of the folder is an error naming what there is."""
    chosen, unknown = set(), []
    for pattern in (n.strip() for n in only.split(",") if n.strip()):
        hits = fnmatch.filter(names, pattern)
        chosen.update(hits)
        if not hits:
            unknown.append(pattern)
    if unknown:
        raise ConfigError(f"--only {only}: no scenario named {', '.join(unknown)} in {folder} "
                          f"(there are: {', '.join(sorted(names))})")
    return chosen


def validate(
    folder: Annotated[Path, typer.Argument(help="folder of scenario YAMLs",
                                           show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="output folder: OUT/NAME per "
                                      "scenario, OUT/summary.md, summary.json and summary.html")],
    on: Annotated[SuiteOn, typer.Option(
        "--on", help="both: measure on this machine and predict; sim: predict only")
    ] = SuiteOn.both,
    only: Annotated[str | None, typer.Option(
        "--only", help="comma-separated scenario names or patterns ('ladder-*') to run "
        "now (the summary still covers every folder in OUT)")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", "-s", help=SET_HELP)] = None,
    measured: Annotated[Path | None, typer.Option(
        "--measured", help="predict against the measurements kept in this earlier --on "
        "both output (a folder, or its measured.json.gz) instead of measuring again")] = None,
) -> None:
    """Run a folder of scenarios on both sides (or predict only) and sum up the errors."""
    console = Console(stderr=True)
    if measured is not None and on is not SuiteOn.both:
        raise ConfigError("--measured compares predictions with kept measurements: it "
                          "cannot go with --on sim")
    kept = None if measured is None else (measured, load_kept(measured))
    suite = load_suite(folder, list(set_ or ()))
    names = {sc.name for _, sc in suite}
    chosen = names if only is None else chosen_names(only, names, folder)
    check_out(out, names)
    out.mkdir(parents=True, exist_ok=True)
    problems = earlier_problems(out, chosen)
    what = ("measured and predicted" if on is SuiteOn.both and measured is None
            else "predicted against kept measurements" if measured is not None else "predicted")
    title = f"Validation suite: {folder.as_posix()} ({what})"
    for path, sc in suite:
        if sc.name not in chosen:
            continue
        if on is SuiteOn.both and measured is None and sc.validate_.pending:
            console.print(f"{sc.name}: pending, not run ({sc.validate_.pending.strip()})",
                          highlight=False)
            continue
        if kept is not None and only is None and sc.name not in kept[1]:
            console.print(f"{sc.name}: not measured in {measured}, not run", highlight=False)
            continue  # (one named with --only must have been: an error below)
        console.print(f"{sc.name}: running ({on.value})", highlight=False)
        try:
            run_one(sc, path, out, on, console, kept)
        except KestrelError as err:
            problems[sc.name] = str(err)
        except Exception as err:  # noqa: BLE001  (a crash, e.g. out of GPU memory: record it, run the others)
            problems[sc.name] = f"{type(err).__name__}: {err}"
            console.print(traceback.format_exc(), highlight=False, markup=False)
        if sc.name in problems:
            console.print(f"[red]{sc.name}: {problems[sc.name]}[/]", highlight=False)
        write_summary(out, suite, problems, title)  # after each: a stopped run keeps it
        if on is SuiteOn.both:
            write_bundle(out, sorted(names))
    doc = write_summary(out, suite, problems, title)
    print(markdown(doc, title))  # plain: a markdown table wraps badly in a rich console
    console.print(f"wrote {out / 'summary.md'}, summary.json and summary.html (its figures)",
                  highlight=False)
    failed = [e["name"] for e in doc["scenarios"] if e["status"] in ("fail", "error")]
    if failed:
        console.print(f"[bold red]FAIL[/]: {', '.join(failed)}", highlight=False)
        raise typer.Exit(1)
