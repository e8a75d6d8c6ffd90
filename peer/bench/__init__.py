"""`swarm-peer bench`: what each way of training costs, measured on 127.0.0.1 with one thread per process.

Every scenario prints a table and appends one JSON object per measurement to ``--out`` (JSON lines), with
the date, the machine and the raw figures, so that a later run can be compared with this one. One module per
scenario; :data:`SCENARIOS` is the registry that the CLI's ``--scenario`` choices come from:

* ``scaling``: K swarm peers, K-rank DDP (gloo) and one process at global batch 2048; then DiLoCo.
* ``comm``: bytes and accuracy of each --compression mode and of DiLoCo, two peers each.
* ``parity``: a 2-peer swarm with target batch B against one process with batch B, over several seeds.
* ``step`` (CUDA only): samples/s and model FLOPs utilisation of the ViT-B/32 training step, 224x224, bf16.
* ``join``: a newcomer downloads ViT-B/32's state from a peer, against reading it from a checkpoint.
* ``wan`` (root only): peers in network namespaces behind 20 Mbit/s links; time to a fixed val acc with
  fp32 and int8 gradient averaging and DiLoCo + int8, against one process.
* ``attack``: a peer sends outsized, uphill gradients into a swarm; the honest peer's val acc with its screen
  off and on (swarm/averaging/screen.py).
* ``fence``: two peers open and invite-only in turn: what the fence costs (swarm/net/fence.py).
* ``dht``: the CPU that DHT stores and reads cost 9 and 17 nodes, with hivemind's reads and the swarm's.
* ``volunteers`` (root only): unequal peers, each in its own CPU budget behind its own slow, distant link,
  against each of them alone: utilisation and time to a fixed val acc.

Peers run as subprocesses of this command, in their own process groups, and are stopped when it ends.
"""

from __future__ import annotations

import importlib
import signal
import time
from pathlib import Path
from typing import Any

from peer.bench.harness import Bench, Options

SCENARIOS = (
    "scaling",
    "comm",
    "join",
    "parity",
    "step",
    "wan",
    "attack",
    "fence",
    "dht",
    "volunteers",
)  # each a module of this package: run() and table


def scenario(name: str) -> Any:
    """The module of scenario ``name`` (imported on demand: the step scenario loads timm)."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown bench scenario {name!r}; expected one of {', '.join(SCENARIOS)}")
    return importlib.import_module(f"peer.bench.{name}")


def run_bench(scenarios: list[str], out: Path, work: Path, opts: Options) -> Bench:
    """Run ``scenarios`` in order, then print each one's table."""
    from swarm.procs import remove_stale_sockets

    bench = Bench(out=out, work=work)
    work.mkdir(parents=True, exist_ok=True)
    began = time.time()

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # so that every scenario stops the peers it started (finally blocks)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        for name in scenarios:
            t0 = time.time()
            scenario(name).run(bench, opts)
            print(f"({name}: {time.time() - t0:.0f} s)", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        remove_stale_sockets(since=began, exclude_own=True, settle=3.0)
    print()
    for name in SCENARIOS:
        table = scenario(name).summary_table(bench.rows)
        if table:
            print(table + "\n")
    print(f"JSON lines appended to {out}")
    return bench
