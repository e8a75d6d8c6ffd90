"""The import graph of the project's packages, read from the source with ``ast`` (imports inside functions
included). ``python -m tests.import_graph`` prints it as a Mermaid drawing (docs/ARCHITECTURE.md holds one);
tests/test_layers.py checks that every import goes down the layers."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# lowest first: a module may import its own layer and the layers before it, never one after it
LAYERS = (
    ("swarm",),  # settings, logging, processes, file layout, specs: config, log, procs, layout, ...
    ("swarm.patches",),  # what this project changes in hivemind
    ("swarm.training",),  # the model, the data, checkpoints, system metrics
    ("swarm.net",),  # networking and trust: the node, invites, the fence, records in the DHT
    ("swarm.averaging",),  # the Lightning strategy around hivemind.Optimizer, DiLoCo, the round screen
    ("monitor",),  # the monitor role
    ("peer",),  # the training roles, the benchmarks and the command line (which starts every role)
)


def package_of(module: str) -> str:
    """The layer package a module belongs to (``swarm.net.node`` -> ``swarm.net``; ``swarm.config`` ->
    ``swarm``; ``peer.bench.scaling`` -> ``peer``)."""
    parts = module.split(".")
    if parts[0] == "swarm" and len(parts) > 2:
        return ".".join(parts[:2])
    if parts[0] == "swarm" and len(parts) == 2 and (ROOT / "swarm" / parts[1]).is_dir():
        return module
    return parts[0]


def rank(package: str) -> int:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    raise KeyError(package)


def modules() -> dict[str, Path]:
    out = {}
    for top in ("swarm", "peer", "monitor"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(path: Path, module: str) -> set[str]:
    """The project modules that ``path`` imports, anywhere in it (``TYPE_CHECKING`` blocks left out)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: from . import x
                base = ".".join(module.split(".")[: -node.level] + [node.module])
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    known = modules()
    return {name for name in found if name in known and name != module}


def edges() -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the imports behind the edge (``peer.cli -> swarm.config``)."""
    out: dict[tuple[str, str], list[str]] = defaultdict(list)
    for module, path in modules().items():
        for target in sorted(imports(path, module)):
            a, b = package_of(module), package_of(target)
            if a != b:
                out[(a, b)].append(f"{module} -> {target}")
    return dict(out)


def mermaid() -> str:
    lines = ["graph BT"]
    for a, b in sorted(edges()):
        lines.append(f"  {a.replace('.', '_')}[{a}] --> {b.replace('.', '_')}[{b}]")
    return "\n".join(lines)


if __name__ == "__main__":
    print(mermaid())
