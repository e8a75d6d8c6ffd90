"""The packages form layers, and imports go one way, down (tests/import_graph.py reads them from the code)."""

from __future__ import annotations

from tests.import_graph import LAYERS, edges, imports, modules, package_of, rank


def test_every_module_belongs_to_a_layer():
    assert {package_of(m) for m in modules()} <= {p for layer in LAYERS for p in layer}


def test_imports_go_down_the_layers_only():
    upward = {
        (a, b): why for (a, b), why in edges().items() if rank(b) > rank(a) or (rank(a) == rank(b) and a != b)
    }
    assert not upward, upward


def test_the_reader_sees_real_imports():
    """The check above would pass on a reader that finds nothing: it finds the imports it must."""
    found = imports(modules()["swarm.averaging.strategy"], "swarm.averaging.strategy")
    assert {"swarm.patches", "swarm.averaging.diloco", "swarm.config"} <= found
    assert ("peer", "swarm.averaging") in edges() and ("swarm.net", "swarm.patches") in edges()
