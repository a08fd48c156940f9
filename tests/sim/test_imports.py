"""kestrel_sim and kestrel_cli: no import cycles (counting imports inside functions too),
and no module imports another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kestrel_sim", "kestrel_cli")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, str]]:
    """(module, name) for every `from M import name` / `import M` of a known module, at any
    depth of the file (lazy imports inside functions count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in known:
                    found.append((submodule, ""))
                elif node.module in known:
                    found.append((node.module, alias.name))
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name in known]
    return found


def graph() -> dict[str, set[str]]:
    """module -> modules it imports; importing a.b.c also runs a/__init__ and a/b/__init__
    (except a module's own packages, which are loaded before it)."""
    known = modules()
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for target, _ in imports(path, known):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                step = ".".join(parts[:i])
                if step in known and step != name and not name.startswith(step + "."):
                    edges[name].add(step)
    return edges


def cycle_from(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    """A path start -> ... -> start, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(edges[node]):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_cycles():
    edges = graph()
    assert len(edges) > 20  # the walk found the packages
    cycles = [c for name in sorted(edges) if (c := cycle_from(name, edges))]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_private_names_imported_from_other_modules():
    known = modules()
    private = [f"{name} imports {target}.{what}" for name, path in known.items()
               for target, what in imports(path, known)
               if what.startswith("_") and target != name]
    assert not private, "\n".join(private)


def test_the_graph_sees_lazy_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from kestrel_sim.yamlio import load_model\n")
    assert imports(path, modules()) == [("kestrel_sim.yamlio", "load_model")]
