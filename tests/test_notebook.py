"""notebooks/join_swarm.ipynb, run top to bottom by a real Jupyter kernel (nbclient) against a real peer on
127.0.0.1. The install cell needs internet and is left out: the kernel runs in this environment, where the
package is installed already."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from tests.helpers import PeerProcess, read_summary

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "join_swarm.ipynb"
RUN_ID = "pytest-notebook"


def _notebook(join_line: str, extra: str) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells = [c for c in nb.cells if "install" not in c.metadata.get("tags", [])]
    (params,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    params.source = "\n".join(
        [
            'REPO_URL = "left out: the install cell needs internet"',
            f"JOIN_LINE = {join_line!r}",
            'INVITE_FILE = ""',
            f"EXTRA_FLAGS = {extra!r}",
        ]
    )
    return nb


def _text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", "") or "".join(out.get("data", {}).get("text/plain", "")))
        parts.append("\n".join(out.get("traceback", [])))
    return "\n".join(parts)


def _run(nb: nbformat.NotebookNode, cwd: Path) -> None:
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}
    ).execute()


def _stop_leftover_peer(nb: nbformat.NotebookNode) -> None:
    """The peer the training cell started runs in its own session: stop it if a failure left it running."""
    for cell in nb.cells:
        for pid in re.findall(r"Started the peer \(pid (\d+)\)", _text(cell)):
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_notebook_joins_a_swarm_trains_and_shows_its_status(peers, tmp_path, monkeypatch):
    common = ["--config", "demo", "--run-id", RUN_ID, "--log-dir", str(tmp_path), "--threads", "1"]
    # 32 steps of 32 per global epoch
    common += ["--host-maddr", "/ip4/127.0.0.1/tcp/0", "--target-batch-size", "1024"]
    # the first peer must outlive the notebook's status cell: with the demo's 120 global epochs it once left
    # before that cell ran (both peers at epoch 120 after 39 s), and the status could not reach it
    first_only = ["--peer-name", "first", "--seed", "1", "--max-epochs", "100000"]
    first = PeerProcess("first", ["join", *common, *first_only], peers)
    address = first.join_address(timeout=120)
    (line,) = [s.strip() for s in first.lines if s.strip().startswith("swarm-peer join --initial-peers")][:1]
    assert line.endswith(f"--config demo --run-id {RUN_ID} --target-batch-size 1024"), line

    extra = f"--host-maddr /ip4/127.0.0.1/tcp/0 --threads 1 --log-dir {tmp_path} --peer-name notebook "
    extra += "--seed 2 --log-every 0.5"  # no --target-batch-size: the first peer's join line carries it
    # a time limit, not an epoch: the first peer trains on, and a slow kernel start must not let it win (10 s
    # of training: 23 rounds with the first peer, 76 in 30 s)
    nb = _notebook(line, extra + " --max-time 10")
    # the kernel's peer leaves at --max-time without sharing its final state for the demo's linger (10 s,
    # all of it, since the first peer trains on): nothing here reads that state, and the first peer is
    # started already, with the config's linger
    monkeypatch.setenv("SWARM_LINGER", "0")
    try:
        _run(nb, tmp_path)
    finally:
        _stop_leftover_peer(nb)
    gpu, check, training, status = [_text(c) for c in nb.cells if c.cell_type == "code"][1:]
    assert "No GPU" in gpu or "GPU:" in gpu, gpu
    assert f"Will run: swarm-peer join --initial-peers {address}" in check, check
    assert re.search(r"\| epoch \d+ \| peers 2", training), training[-3000:]
    assert "The peer exited with code 0" in training, training[-3000:]
    assert f"Swarm {RUN_ID!r}" in status and "global epoch" in status, status

    summary = read_summary(tmp_path, RUN_ID, "notebook")
    assert summary["final_epoch"] > summary["loaded_epoch"], summary["final_epoch"]
    assert summary["round_ends"]["averaged"] >= 3, summary["round_ends"]  # it trained with the first peer

    # a wrong join line stops at the check, with one line that says what is wrong, before anything runs
    bad = _notebook("pip install swarm-trainer", extra)
    with pytest.raises(CellExecutionError) as failed:
        _run(bad, tmp_path)
    assert "JOIN_LINE must start with 'swarm-peer join', not 'pip install'" in str(failed.value)
    assert "Started the peer" not in _text([c for c in bad.cells if c.cell_type == "code"][-2])


ADDRESS = "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooWJXm34jsMXXj1xRRjuhiorYY6HTTNXCoq5EN1QLAChu4J"


def test_a_pasted_join_line_is_checked_and_completed(tmp_path):
    from peer.notebook import join_command, status_command

    line = f"SWARM_WARMUP_EPOCHS=3 swarm-peer join --initial-peers {ADDRESS} --config flagship --run-id r1"
    command = join_command("!" + line + " --invite <the invite file you were sent>", invite=__file__)
    assert command[:2] == ["env", "SWARM_WARMUP_EPOCHS=3"] and command[3:5] == ["-m", "peer"], command
    assert command[5:] == ["join", "--initial-peers", ADDRESS, "--config", "flagship", "--run-id", "r1"] + [
        "--invite",
        __file__,
    ]
    assert status_command(line)[2:] == ["peer", "status", "--initial-peers", ADDRESS, "--run-id", "r1"]
    for bad, says in [
        ("", "JOIN_LINE is empty"),
        ("pip install swarm-trainer", "must start with 'swarm-peer join', not 'pip install'"),
        ("swarm-peer join --config demo", "has no --initial-peers address"),
        ("swarm-peer join --initial-peers /ip4/1.2.3.4/tcp/5", "lacks the /p2p/<peer id> part"),
        (f'swarm-peer join --initial-peers "{ADDRESS}', "not one command line"),
        (f"{line} --invite <the invite file you were sent>", "invite-only: upload the invite file"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            join_command(bad)
    with pytest.raises(ValueError, match="does not exist here"):
        join_command(line, invite=str(tmp_path / "missing.tok"))
