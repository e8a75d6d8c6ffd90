"""The runner of hivemind's own tests (tests/upstream/run.py): what it cleans up after them."""

from __future__ import annotations

import os
import subprocess

from tests.upstream.run import remove_shared_memory


def test_the_runner_removes_only_the_shared_memory_files_of_its_own_processes_that_are_gone(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    other = subprocess.Popen(["true"])  # a process of someone else's, gone too
    other.wait()
    alive = os.getpid()
    names = {
        "ours, gone": f"torch_{gone.pid}_1234_0",
        "ours, gone, another": f"torch_{gone.pid}_1234_7",
        "ours, alive": f"torch_{alive}_99_0",
        "another program's": f"torch_{other.pid}_5_0",
        "not torch's": f"sem.{gone.pid}",
        "malformed": "torch_x_1",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"\0" * 8)
    assert remove_shared_memory({gone.pid, alive}, tmp_path) == 2
    left = {p.name for p in tmp_path.iterdir()}
    assert left == set(names.values()) - {names["ours, gone"], names["ours, gone, another"]}, left
