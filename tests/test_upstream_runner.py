"""The runner of hivemind's own tests (tests/upstream/run.py): what it cleans up after them."""

from __future__ import annotations

import os
import socket
import subprocess

from tests.upstream.run import remove_shared_memory, remove_temp_dirs, temp_dirs


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


def test_the_runner_removes_the_multiprocessing_folders_that_appeared_and_that_nobody_uses(tmp_path):
    (tmp_path / "pymp-before").mkdir()  # there before the run: not the run's
    before = temp_dirs(tmp_path)
    for name in ("pymp-gone", "pymp-empty", "pymp-alive", "other"):
        (tmp_path / name).mkdir()
    with socket.socket(socket.AF_UNIX) as gone:  # a socket file whose process ended: no longer bound
        gone.bind(str(tmp_path / "pymp-gone" / "l"))
    with socket.socket(socket.AF_UNIX) as alive:  # a resource sharer still listening
        alive.bind(str(tmp_path / "pymp-alive" / "l"))
        alive.listen(1)
        assert remove_temp_dirs(before, tmp_path) == 2
        assert {p.name for p in tmp_path.iterdir()} == {"pymp-before", "pymp-alive", "other"}
