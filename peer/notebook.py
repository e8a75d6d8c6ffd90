"""What notebooks/join_swarm.ipynb runs: check the pasted join line, then train with live progress.

A volunteer on Colab or Kaggle pastes the line another peer printed. :func:`join_command` turns it into the
command to run (with the invite, if the run has one) or raises ValueError with one line that says what is
wrong with it. :func:`train` runs that command and prints its lines as they come; interrupting the cell
(the stop button) makes the peer leave the swarm cleanly, as Ctrl-C does in a terminal.

The notebook needs no ``--client-mode``: a peer that nobody can dial (a notebook behind NAT) switches to
client mode by itself after joining (swarm/net/reach.py) and says so in its log.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from swarm.net.node import check_multiaddrs


def join_command(line: str, invite: str = "", extra: str = "") -> list[str]:
    """The command that joins the swarm named by ``line`` (a pasted ``swarm-peer join ...`` line)."""
    text = line.strip().lstrip("!$% ").strip()
    if not text:
        raise ValueError(
            "JOIN_LINE is empty: paste the line a running peer printed after 'To join this swarm, run:'"
        )
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"JOIN_LINE is not one command line ({exc}); paste it again, in one piece") from None
    settings = []  # SWARM_<FIELD>=value words: shared settings that the first peer changed (no flag exists)
    while words and re.fullmatch(r"SWARM_[A-Z0-9_]+=.*", words[0]):
        settings.append(words.pop(0))
    if words[:2] != ["swarm-peer", "join"]:
        raise ValueError(f"JOIN_LINE must start with 'swarm-peer join', not {' '.join(words[:2])!r}")
    if "--initial-peers" not in words or words.index("--initial-peers") + 1 >= len(words):
        raise ValueError("JOIN_LINE has no --initial-peers address; copy the whole line the peer printed")
    check_multiaddrs([words[words.index("--initial-peers") + 1]], "--initial-peers", need_peer_id=True)
    if "--invite" in words:  # an invite-only swarm's line ends "--invite <the invite file you were sent>"
        at = end = words.index("--invite") + 1
        if end < len(words) and words[end].startswith("<"):
            while end < len(words) and not words[end].endswith(">"):
                end += 1
        del words[at - 1 : end + 1]
        if not invite:
            raise ValueError(
                "this swarm is invite-only: upload the invite file you were sent, and set INVITE_FILE to "
                "its name"
            )
    if invite:
        if not Path(invite).is_file():
            raise ValueError(f"INVITE_FILE {invite!r} does not exist here; upload it to the notebook first")
        words += ["--invite", invite]
    return ["env", *settings, sys.executable, "-m", "peer", *words[1:], *shlex.split(extra)]


def status_command(line: str, invite: str = "") -> list[str]:
    """``swarm-peer status`` for the swarm of a join line: its initial peers, run id and invite."""
    command = join_command(line, invite)
    words = command[command.index("-m") + 2 :]
    keep = []
    for flag in ("--initial-peers", "--run-id", "--invite"):
        if flag in words:
            keep += [flag, words[words.index(flag) + 1]]
    return [sys.executable, "-m", "peer", "status", *keep]


def train(command: list[str], echo: Callable[[str], None] = print) -> int:
    """Run ``command`` and echo its output line by line; returns its exit code.

    KeyboardInterrupt (the notebook's stop button) sends SIGINT to the peer's process group, waits until it
    has left, and returns its exit code (0 after a clean leave).
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    assert proc.stdout is not None
    echo(f"Started the peer (pid {proc.pid})")
    try:
        try:
            for line in proc.stdout:
                echo(line.rstrip("\n"))
        except KeyboardInterrupt:
            echo("Leaving the swarm (the peer finishes its current step first) ...")
            os.killpg(proc.pid, signal.SIGINT)  # its own session: the group's id is its pid
            for line in proc.stdout:
                echo(line.rstrip("\n"))
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # a second interrupt, or a peer that would not leave
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
