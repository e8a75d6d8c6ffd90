"""A peer's life off the happy path: SIGTERM/SIGINT (spot reclaim, Ctrl-C) and unreachable initial peers."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from swarm.procs import group_members
from swarm.waiting import wait_until
from tests.helpers import PeerProcess, read_summary, states_kept

VALID_PEER_ID = "12D3KooWJXm34jsMXXj1xRRjuhiorYY6HTTNXCoq5EN1QLAChu4J"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _signal_group_and_time_exit(peer: PeerProcess, sig: int, limit: float) -> tuple[int, float]:
    sent = time.time()
    os.killpg(peer.pgid, sig)  # a reclaimed spot instance or Ctrl-C signals every process of the peer
    code = peer.wait(timeout=limit + 20)
    while group_members(peer.pgid) and time.time() - sent < limit + 20:
        time.sleep(0.1)
    return code, time.time() - sent


SIGNALLED_TWICE = """
import logging, os, signal, time
logging.basicConfig(level=logging.INFO)
from swarm.procs import GracefulStop
stop = GracefulStop()
stop.install()
os.kill(os.getpid(), signal.SIGTERM)  # leave after the current step
time.sleep(0.2)
assert stop.event.is_set()
stop.disarm()  # the orderly shutdown begins
os.kill(os.getpid(), signal.SIGTERM)  # a supervisor that signals again, or an impatient user
time.sleep(0.2)
print("shutdown went on")
"""


def test_a_second_signal_does_not_cut_an_orderly_shutdown_short():
    """Once a peer has begun to leave in order (its averagers saying goodbye through the p2p daemon), a
    second SIGTERM must not interrupt it: an interrupted shutdown stopped the daemon under the averagers,
    and each printed a traceback. Real signals, in a child process (the handler's force-exit deadline
    would end the test's own process)."""
    done = subprocess.run(
        [sys.executable, "-c", SIGNALLED_TWICE], capture_output=True, text=True, timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert done.returncode == 0 and "shutdown went on" in done.stdout, done.stdout + done.stderr
    assert "Received SIGTERM again: already leaving" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_sigterm_and_sigint_leave_cleanly(peers, tmp_path):
    common = [
        "--config",
        "demo",
        "--run-id",
        "pytest-signals",
        "--log-dir",
        str(tmp_path),
        "--host-maddr",
        "/ip4/127.0.0.1/tcp/0",
        "--log-every",
        "1",
        "--threads",
        "1",
        "--max-epochs",
        "100000",
    ]
    first = PeerProcess("first", ["join", *common, "--peer-name", "first", "--seed", "1"], peers)
    address = first.join_address(timeout=120)
    second = PeerProcess(
        "second", ["join", *common, "--peer-name", "second", "--seed", "2", "--initial-peers", address], peers
    )
    # signalled once the two train together: the newcomer's lines show two rounds on the group's average
    # ("peers 2" alone is not enough: right after a join, each can step alone for a second or two). Two, not
    # one: the survivor may end the epoch of the newcomer's last round a moment after the newcomer logged it,
    # after the signal, and the check below looks for the newcomer's last two rounds before the signal
    averaged_line = re.compile(r"\| epoch \d+ \| peers 2 \| .*, averaged (\d+)/")

    def averaged_rounds() -> int:
        return sum(int(m.group(1)) for line in list(second.lines) if (m := averaged_line.search(line)))

    wait_until(lambda: averaged_rounds() >= 2, timeout=180, interval=0.2)
    assert averaged_rounds() >= 2, second.output()[-3000:]

    signalled_at = time.time()
    code, seconds = _signal_group_and_time_exit(second, signal.SIGTERM, limit=10)
    assert code == 0, second.output()[-3000:]
    assert seconds < 10, f"SIGTERM took {seconds:.1f}s\n" + second.output()[-5000:]
    assert not group_members(second.pgid), "the p2p daemon or an averager outlived the peer"
    assert "Received SIGTERM" in second.output()
    assert read_summary(tmp_path, "pytest-signals", "second")["complete"] is True  # written as it left

    # the survivor keeps training alone, and counts itself alone: the leaver's progress record was not
    # withdrawn (the group's SIGTERM ended its p2p daemon at once) and would count for its 60 s, but the
    # survivor's round that nobody came to ends after twice matchmaking_time, and the leaver is left out of
    # its count from then on (docs/hivemind-patches.md item 30). Then Ctrl-C stops it just as cleanly
    seen = len(first.lines)
    alone = re.compile(r"\| epoch \d+ \| peers 1 \|")
    wait_until(lambda: any(alone.search(line) for line in first.lines[seen:]), timeout=30, interval=0.5)
    assert any(alone.search(line) for line in first.lines[seen:]), (
        first.output()[-3000:] + "\n--- stacks (SIGUSR1) ---\n" + first.stacks()
    )
    code, seconds = _signal_group_and_time_exit(first, signal.SIGINT, limit=10)
    assert code == 0, first.output()[-3000:]
    assert seconds < 10, f"SIGINT took {seconds:.1f}s\n" + first.output()[-5000:]
    both = first.output() + "\n" + second.output()
    where = both.find("Traceback")
    assert where < 0, both[max(0, where - 500) : where + 3000]

    # the preempted peer's recent state was not lost with it: the survivor held the parameters that one of
    # the leaver's last two averaged rounds before the signal left it with (a round that the signal
    # interrupted may differ), under the same global epoch or, right after the join, a smaller one
    # (see states_kept)
    gone, kept = (read_summary(tmp_path, "pytest-signals", n) for n in ("second", "first"))
    epochs, same = states_kept(gone, kept, 2e-4, before=signalled_at)
    averaged = [r["epoch"] for r in gone["rounds"] if r["outcome"] == "averaged" and r["epoch"] in epochs]
    assert averaged and set(averaged[-2:]) & set(same), (averaged, epochs, same, gone["checksums"], kept)


def test_a_killed_peer_leaves_its_summary_up_to_its_last_global_epoch(peers, tmp_path):
    """A volunteer's machine can vanish (a Colab session ends: SIGKILL to everything, no goodbye). The
    summary is rewritten at every global epoch, whole, so what the peer did until then is still there."""
    args = ["join", "--config", "demo", "--run-id", "pytest-killed", "--log-dir", str(tmp_path)]
    args += ["--host-maddr", "/ip4/127.0.0.1/tcp/0", "--peer-name", "killed", "--max-epochs", "100000"]
    args += ["--threads", "1"]
    peer = PeerProcess("killed", [*args, "--log-every", "1", "--eval-every", "1000"], peers)
    wait_until(lambda: peer.epoch() >= 3, timeout=120, interval=0.2)
    assert peer.epoch() >= 3, peer.output()[-3000:]
    seen = peer.epoch()
    os.killpg(peer.pgid, signal.SIGKILL)
    assert peer.wait_gone() == -signal.SIGKILL
    summary = read_summary(tmp_path, "pytest-killed", "killed")
    assert summary["complete"] is False
    assert summary["final_epoch"] >= seen and summary["history"][-1]["epoch"] == summary["final_epoch"]
    assert sum(h["samples"] for h in summary["history"]) >= seen * 256 * 0.9  # the demo's target per epoch


def test_min_peers_holds_the_first_step_until_the_others_are_there(peers, tmp_path, monkeypatch):
    """--min-peers 2 on both: the first peer prints its join line, then takes no step until a second
    training peer is ready too; from then on the two train together. A third, told to leave (SIGTERM) while
    it waits for more peers than will come, exits 0 at once without having trained."""
    monkeypatch.setenv("SWARM_LINGER", "0")
    run = "pytest-min-peers"
    common = ["join", "--config", "demo", "--run-id", run, "--log-dir", str(tmp_path), "--threads", "1"]
    common += ["--host-maddr", "/ip4/127.0.0.1/tcp/0", "--max-epochs", "20", "--log-every", "1"]
    first = PeerProcess("first", [*common, "--peer-name", "first", "--min-peers", "2"], peers)
    address = first.join_address(timeout=120)
    first.wait_for(r"Waiting for 1 training peer\(s\) of run 'pytest-min-peers' before the first step", 60)
    second_started = time.time()
    second = PeerProcess(
        "second", [*common, "--peer-name", "second", "--initial-peers", address, "--min-peers", "2"], peers
    )
    for p in (first, second):
        assert p.wait(timeout=180) == 0, f"{p.name}:\n{p.output()[-4000:]}"
    assert "2 training peers of the run are ready; starting" in first.output()
    leader = read_summary(tmp_path, run, "first")
    # every training window of the first peer (its samples at its rate, up to the epoch's end) began after
    # the second was launched, and they averaged
    windows = [h for h in leader["history"] if h["mini_steps"] and h["samples_per_second"]]
    assert windows and all(
        h["time"] - h["samples"] / h["samples_per_second"] > second_started for h in windows
    ), (second_started, leader["history"])
    assert leader["round_ends"]["averaged"] >= 1, leader["round_ends"]

    third = PeerProcess("third", [*common, "--peer-name", "third", "--min-peers", "5"], peers)
    third.wait_for(r"Waiting for 4 training peer\(s\)", 120)
    code, seconds = _signal_group_and_time_exit(third, signal.SIGTERM, limit=10)
    assert code == 0 and seconds < 10, (code, seconds, third.output()[-3000:])
    assert "Received SIGTERM before training; leaving the swarm" in third.output()
    assert "| epoch" not in third.output()


def test_unreachable_initial_peer_is_a_clear_error(peers, tmp_path):
    address = f"/ip4/127.0.0.1/tcp/{_free_port()}/p2p/{VALID_PEER_ID}"
    os.environ["SWARM_BOOTSTRAP_TIMEOUT"] = "5"
    try:
        peer = PeerProcess(
            "lonely",
            [
                "join",
                "--config",
                "demo",
                "--initial-peers",
                address,
                "--log-dir",
                str(tmp_path),
                "--host-maddr",
                "/ip4/127.0.0.1/tcp/0",
            ],
            peers,
        )
    finally:
        del os.environ["SWARM_BOOTSTRAP_TIMEOUT"]
    started = time.time()
    code = peer.wait(timeout=90)
    assert code == 1
    assert time.time() - started < 60
    out = peer.output()
    assert "could not reach the initial peers" in out and "firewall" in out and "--client-mode" in out
    assert "Traceback" not in out
    # its output ends with it: once its group has gone, no other process (torch's shared-memory manager, in
    # a session of its own, kept it open about 2 s more) holds the pipe the test reads it through
    assert wait_until(lambda: not group_members(peer.pgid), timeout=30)
    assert not _pipe_holders(peer.proc.stdout.fileno()), _pipe_holders(peer.proc.stdout.fileno())


def _pipe_holders(fd: int) -> dict[int, str]:
    """The processes other than this one with the pipe of ``fd`` open: {pid: command line}."""
    pipe = f"pipe:[{os.fstat(fd).st_ino}]"
    found = {}
    for link in glob.glob("/proc/[0-9]*/fd/*"):
        pid = int(link.split("/")[2])
        with contextlib.suppress(OSError):
            if pid != os.getpid() and os.readlink(link) == pipe:
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    return found


def _lone_peer(peers, tmp_path, monkeypatch, name: str, *extra: str) -> tuple[dict, PeerProcess]:
    """One peer that starts a swarm of its own on the demo and trains until a stop condition."""
    monkeypatch.setenv("SWARM_LINGER", "0")  # no monitor to hand the final state to
    args = ["join", "--config", "demo", "--run-id", f"pytest-{name}", "--log-dir", str(tmp_path)]
    args += ["--host-maddr", "/ip4/127.0.0.1/tcp/0", "--peer-name", name, "--threads", "1", *extra]
    peer = PeerProcess(name, args, peers)
    assert peer.wait(timeout=240) == 0, peer.output()[-4000:]
    return read_summary(tmp_path, f"pytest-{name}", name), peer


def test_max_data_epochs_stops_a_peer_after_passes_over_its_data(peers, tmp_path, monkeypatch):
    """0.5 passes over the 1438 training images is 719 samples: the peer stops at global epoch 3 (768 in
    optimizer steps of 256). Its progress lines count both; a CPU peer reports no GPU figures."""
    summary, peer = _lone_peer(
        peers,
        tmp_path,
        monkeypatch,
        "passes",
        "--max-data-epochs",
        "0.5",
        "--log-every",
        "0.01",
        "--batch-size",
        "auto",
    )
    # on the CPU, --batch-size auto keeps the config's batch (no GPU memory to fill)
    assert "--batch-size auto: no GPU memory to fill on the cpu; the batch stays 32" in peer.output()
    assert (
        summary["batch_size"] == 32
        and summary["final_epoch"] == 3
        and summary["data_epochs"] == round(3 * 256 / 1438, 4)
    ), summary
    assert "Reached data epoch 0.53 (max_data_epochs)" in peer.output()
    assert peer.wait_for(r"\| epoch \d+ \| peers 1 \| data epoch \d\.\d\d \|", timeout=1)
    assert summary["mean_gpu_util"] is None and summary["peak_allocated_gb"] is None
    assert not any("gpu_mem_gb" in h for h in summary["history"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_peer_on_a_gpu_reports_its_memory_and_utilisation(peers, tmp_path, monkeypatch):
    # a progress line at every global epoch: on an H100 the demo's 6 global epochs take under a second
    args = ["--device", "cuda", "--max-epochs", "6", "--log-every", "0.01", "--batch-size", "auto"]
    summary, peer = _lone_peer(peers, tmp_path, monkeypatch, "gpu", *args)
    # --batch-size auto on a GPU: the largest step that fits, capped at the target batch (256); the demo's
    # step at 256 takes well under 1 GB
    assert summary["batch_size"] == 256 and "Largest batch per step on cuda: 256" in peer.output(), summary
    assert summary["peak_allocated_gb"] > 0 and summary["mean_gpu_util"] is not None, summary
    assert any(h.get("gpu_mem_gb", 0) > 0 for h in summary["history"]), summary["history"]
    assert peer.wait_for(r"\| gpu [\d.]+ GB, \d+% busy", timeout=1)


def _wait_ignoring_sigterm(ready) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.set()
    time.sleep(120)


def test_helpers_that_an_interrupted_start_left_are_stopped_and_older_children_are_not():
    """A signal to a peer's group while hivemind forks an averager misses the new child, and the interrupted
    Optimizer never hands it to the strategy: it ran on after the peer had left (1 of 6 peers signalled just
    after their start, until stop_strays). A role notes its children as it starts and stops the new ones that
    its orderly shutdown left, with SIGKILL for one that ignores SIGTERM; children it had before stay."""
    import multiprocessing

    from swarm.procs import own_children, stop_strays

    ctx = multiprocessing.get_context("fork")
    older = ctx.Process(target=time.sleep, args=(120,), daemon=True)
    older.start()
    try:
        before = own_children()
        assert older in before
        ready = ctx.Event()
        strays = [ctx.Process(target=time.sleep, args=(120,), daemon=True)]
        strays.append(ctx.Process(target=_wait_ignoring_sigterm, args=(ready,), daemon=True))
        for child in strays:
            child.start()
        assert ready.wait(30)  # the second ignores SIGTERM from now on
        began = time.time()
        assert stop_strays(before, grace=1.0) == 2
        assert not any(child.is_alive() for child in strays) and older.is_alive()
        assert strays[0].exitcode == -signal.SIGTERM and strays[1].exitcode == -signal.SIGKILL
        assert time.time() - began < 5
        assert stop_strays(before, grace=1.0) == 0
    finally:
        older.kill()
        older.join()


def test_stopping_a_group_also_stops_descendants_that_left_it():
    """torchrun starts its workers in sessions of their own; a hung worker must not outlive its agent (it did:
    after a hung restart test, two `peer local` workers of 900 MB each were left)."""
    import subprocess
    import sys

    from swarm.procs import descendants, stop_group

    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time; subprocess.Popen(['sleep', '1000'], start_new_session=True); "
            "time.sleep(1000)",
        ],
        start_new_session=True,
    )

    def sleeping() -> list[int]:
        """The worker once it runs ``sleep``: Popen's child calls setsid before exec, so from then on it is in
        its own session (seen from here right after the fork, it was still in the agent's group)."""
        found = descendants(agent.pid)
        try:
            return found if len(found) == 1 and _cmdline(found[0]).startswith("sleep") else []
        except OSError:
            return []

    try:
        wait_until(lambda: bool(sleeping()), timeout=30)
        (worker,) = sleeping()
        assert worker not in group_members(agent.pid)  # its own session, out of reach of killpg
        stop_group(agent, grace=2.0)
        wait_until(lambda: not os.path.exists(f"/proc/{worker}") or _zombie(worker), timeout=10)
        assert not os.path.exists(f"/proc/{worker}") or _zombie(worker)
    finally:
        if agent.poll() is None:
            agent.kill()


def _shared_memory_files(pids: set[int]) -> list[str]:
    """torch's shared-memory files (``file_system`` strategy: /dev/shm/torch_<creator pid>_<n>_<n>) that one
    of ``pids`` created."""
    return [f for f in glob.glob("/dev/shm/torch_*") if int(Path(f).name.split("_")[1]) in pids]


def test_a_stopped_peer_leaves_no_shared_memory_behind(peers, tmp_path):
    """A peer's processes share tensors through files in /dev/shm, which torch's ``torch_shm_manager`` (a
    descendant of the peer, in a session of its own) unlinks once their last user has gone. Stopping a
    group also stopped the descendants that left it, and so SIGKILLed the manager before it had cleaned up:
    a peer stopped that way left its 180 files in /dev/shm (the demo's monitor, and every peer of a demo
    stopped with Ctrl-C, too). Now the manager is left to clean up and exit by itself."""
    args = ["join", "--config", "demo", "--run-id", "pytest-shm", "--log-dir", str(tmp_path)]
    args += ["--host-maddr", "/ip4/127.0.0.1/tcp/0", "--peer-name", "shm", "--max-epochs", "100000"]
    args += ["--threads", "1"]
    peer = PeerProcess("shm", args, peers)
    wait_until(lambda: peer.epoch() >= 3, timeout=120, interval=0.2)
    assert peer.epoch() >= 3, peer.output()[-3000:]
    from swarm.procs import _shared_memory_manager, descendants

    pids = set(group_members(peer.pgid)) | {peer.pgid}
    managers = [pid for pid in descendants(peer.pgid) if _shared_memory_manager(pid)]
    assert managers and _shared_memory_files(pids), (managers, sorted(pids))
    assert peer.stop(grace=30.0) == 0, peer.output()[-3000:]
    running = lambda: [m for m in managers if not _zombie(m)]  # noqa: E731
    cleaned = lambda: not _shared_memory_files(pids) and not running()  # noqa: E731
    assert wait_until(cleaned, timeout=20), (len(_shared_memory_files(pids)), running())


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return cmdline.read().replace(b"\0", b" ").decode(errors="replace")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return True
    return text[text.rfind(")") + 2] == "Z"


LEAVES_BY_OS_EXIT = """
import multiprocessing, os, sys
from multiprocessing import util
from multiprocessing.reduction import ForkingPickler
from peer.cli import _exit_quietly

# a pipe pickled for another process, as every hivemind request to a DHT or averager process carries one
# (hivemind/utils/mpfuture.py, MPFuture.__getstate__): handed over through this process's resource sharer
ForkingPickler.dumps(multiprocessing.Pipe()[0])
made = util.get_temp_dir()  # multiprocessing's folder for it: pymp-*, with the sharer's listening socket
child = os.fork()
if child == 0:  # a process forked after the folder was made (as the launcher forks peers) shares it
    _exit_quietly(0) if sys.argv[1] == "theirs" else os._exit(0)
os.waitpid(child, 0)
print(made, os.path.isdir(made), flush=True)
_exit_quietly(0) if sys.argv[1] == "theirs" else os._exit(0)
"""


def test_a_role_that_leaves_by_os_exit_removes_its_multiprocessing_folder():
    """A role leaves through ``os._exit`` (peer/cli.py ``_exit_quietly``), which skips multiprocessing's own
    clean-up: the folder it made in the temporary directory for its resource sharer's socket stayed behind,
    one per run of every command (`make demo` left 4, the suite about 70). Here ``os._exit`` alone leaves the
    folder; ``_exit_quietly`` removes it, though not from a forked child that inherited it (the parent still
    uses it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTEST_CURRENT_TEST", None)
    for way, kept in (("plain", True), ("theirs", False)):
        out = subprocess.run(
            [sys.executable, "-c", LEAVES_BY_OS_EXIT, way],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        made, there_after_child = out.stdout.split()
        assert made.startswith(os.path.join(tempfile.gettempdir(), "pymp-")), made
        assert there_after_child == "True", way  # the forked child left its parent's folder alone
        assert os.path.isdir(made) == kept, (way, made)
        shutil.rmtree(made, ignore_errors=True)


def test_a_process_whose_main_thread_ended_first_is_alive_until_its_last_thread_ends(tmp_path):
    """Killed, a process with many threads often shows its main thread as a zombie while the others still
    exit, holding its sockets: a group "gone" at that moment still held a p2p client socket file, which the
    clean-up after a SIGKILL then left (a fresh-clone suite). Here the main thread ends on purpose
    (pthread_exit) while another lives on with a bound socket: the process counts as running, in its group
    and as holding the socket file, until it is killed."""
    from swarm.procs import _bound_unix_paths, running, stale_sockets

    path = f"/tmp/hivemind-p2pclient-pytest-{os.getpid()}.sock"
    code = (
        "import ctypes, socket, sys, threading, time\n"
        f"s = socket.socket(socket.AF_UNIX); s.bind({path!r}); s.listen()\n"
        "threading.Thread(target=time.sleep, args=(120,)).start()\n"
        "print('bound', flush=True)\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == b"bound"

        def main_thread_ended() -> bool:
            stat = Path(f"/proc/{proc.pid}/stat").read_text()
            return stat[stat.rfind(")") + 2] == "Z"

        assert wait_until(main_thread_ended, timeout=30, interval=0.05)
        assert running(proc.pid) and group_members(proc.pid) == [proc.pid]
        assert path in _bound_unix_paths()[0] and path not in stale_sockets()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert not running(proc.pid) and not group_members(proc.pid)
        # unbound now (its file stale; a test beside this one may remove it already)
        assert wait_until(lambda: path not in _bound_unix_paths()[0], timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def test_removing_stale_sockets_spares_live_ones_that_a_busy_socket_table_skips():
    """/proc/net/unix is read a page at a time, and while other sockets come and go a read skips live
    entries. 200 sockets named like hivemind's listen while a thread binds and closes 100 others again and
    again; 5 s of ``remove_stale_sockets`` removes the closed ones' files and never a listening one's.
    (Before, a file missing from the table counted as stale: a fresh-clone suite saw an averager's socket
    deleted, and every download from that peer failed with "Connection lost".)"""
    from swarm.procs import remove_stale_sockets

    started = time.time()
    tag = f"/tmp/hivemind-p2ptest-{os.getpid()}"
    live = []
    done = threading.Event()

    def churn() -> None:
        while not done.is_set():
            closed = []
            for j in range(100):
                path = f"{tag}-churn-{j}.sock"
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                sock = socket.socket(socket.AF_UNIX)
                sock.bind(path)
                closed.append(sock)
            for sock in closed:
                sock.close()

    churner = threading.Thread(target=churn)
    try:
        for i in range(200):
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(f"{tag}-{i}.sock")
            sock.listen()
            live.append(sock)
        churner.start()
        removed = 0
        while time.time() - started < 5.0:
            removed += remove_stale_sockets(since=started)
        assert removed > 0, "the closed sockets' files were removed"
        gone = [i for i in range(200) if not os.path.exists(f"{tag}-{i}.sock")]
        assert not gone, f"{len(gone)} listening sockets' files were deleted"
    finally:
        done.set()
        if churner.is_alive():
            churner.join()
        for sock in live:
            sock.close()
        for path in glob.glob(f"{tag}-*.sock"):
            # Another test process's own sweep may remove a closed socket's file first: it is stale.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_a_leaving_process_waits_for_its_own_childrens_sockets_not_for_other_peers():
    """A peer that leaves cleans up the socket files it made, waiting (``settle``) for the sockets of its own
    children, which a p2p daemon being stopped releases a moment later. A newer socket of another process (a
    peer beside it on the machine) is no reason to wait: before, every leaving peer of a demo or a test
    waited the whole 3 s for its neighbours' sockets. Here the clean-up may look for 6 s: it must stop well
    before, once its child's socket is released. The leaving process runs in a session of its own: in the
    test worker's process group, whose other processes (other tests' nodes) bind new sockets, it waited the
    whole settle in two fresh-clone suites."""
    started = time.time()
    tag = f"/tmp/hivemind-p2ptest-leave-{os.getpid()}"
    stranger = subprocess.Popen(  # not a child of the leaving process below
        [sys.executable, "-c", _HOLD.format(path=f"{tag}-stranger.sock", seconds=60)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    stranger.stdout.readline()
    child = _HOLD.format(path=f"{tag}-child.sock", seconds=2)
    leaver = subprocess.Popen(
        [sys.executable, "-c", _LEAVE.format(since=started, child=child, settle=LEAVE_SETTLE)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its process group is its own, as a peer's: not this test worker's
    )
    try:
        waited, removed = (float(x) for x in leaver.communicate(timeout=60)[0].split())
        # it waited for its child's socket (held 2 s after the clean-up began) until the file was gone
        # (removed by this clean-up, or by that of another test beside it: the file is stale then) ...
        assert 1.0 <= waited < LEAVE_SETTLE - 1.0 and not os.path.exists(f"{tag}-child.sock"), (
            waited,
            removed,
        )
        # ... and neither waited for the stranger's nor touched it
        assert os.path.exists(f"{tag}-stranger.sock") and stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()
        for path in glob.glob(f"{tag}-*.sock"):  # stale once killed: a leaving peer beside it may remove it
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_a_socket_released_while_the_clean_up_looks_is_removed_by_it():
    """The clean-up decides whether to go on waiting before it removes what is stale, so that its last pass
    sees the sockets its children released meanwhile. Here the child is killed right after a pass looked (its
    socket still bound then): the file is removed all the same. When the clean-up removed first and decided
    afterwards, a release between the two left the file behind (a fresh-clone suite failed the test above so,
    the file there removed by nobody). The clean-up here looks at files of its own name only: the clean-up
    of a peer leaving beside it (another test's) removed this stale file first once, and this one found
    nothing."""
    started = time.time()
    path = f"/tmp/swarm-racetest-{os.getpid()}.sock"
    leaver = subprocess.Popen(
        [sys.executable, "-c", _LEAVE_RACE.format(since=started, child=_HOLD.format(path=path, seconds=60),
                                                  path=path)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        removed, exists = leaver.communicate(timeout=60)[0].split()
        assert (removed, exists) == ("1", "False")
    finally:
        leaver.kill()
        leaver.wait()
        if os.path.exists(path):
            os.unlink(path)


# a process that binds a socket file, listens, says so, and holds it for some seconds
_HOLD = (
    "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind({path!r}); s.listen(); "
    "print('bound', flush=True); time.sleep({seconds})"
)
# a process that starts a child holding a socket, then cleans up as a leaving peer does; its settle is longer
# than a leaving peer's 3 s, so that the end of its wait for the child (2 s) lies well clear of it
LEAVE_SETTLE = 6.0
_LEAVE = """
import subprocess, sys, time
from swarm.procs import remove_stale_sockets
child = subprocess.Popen([sys.executable, "-c", {child!r}], stdout=subprocess.PIPE, text=True)
child.stdout.readline()
began = time.time()
removed = remove_stale_sockets(since={since!r}, exclude_own=True, settle={settle!r})
print(time.time() - began, removed)
child.wait()
"""
# the same, its child killed right after the clean-up's first pass over the stale sockets
_LEAVE_RACE = """
import os, subprocess, sys
from swarm import procs
child = subprocess.Popen([sys.executable, "-c", {child!r}], stdout=subprocess.PIPE, text=True)
child.stdout.readline()
look = procs.stale_sockets

def look_then_release(*args, **kwargs):
    found = look(*args, **kwargs)
    if child.poll() is None:
        child.kill()
        child.wait()
    return found

procs.stale_sockets = look_then_release
procs.SOCKET_GLOB = {path!r}  # this test's file only: no other clean-up on the machine looks at it
removed = procs.remove_stale_sockets(since={since!r}, exclude_own=True, settle=3.0)
print(removed, os.path.exists({path!r}))
"""


def test_a_p2p_daemon_that_removed_its_control_socket_counts_as_gone(tmp_path):
    """Ctrl-C reaches the whole group: p2pd removes its control socket, then exits a moment later. A peer that
    checked in that moment took the daemon for alive and ran hivemind's graceful shutdown, whose averager
    printed a FileNotFoundError traceback (seen once in a fresh clone's run of the test above). A stand-in
    process named p2pd, below a parent of its own, with a control socket path in its arguments."""
    import subprocess
    import sys

    from swarm.procs import p2p_daemon_alive

    sock = tmp_path / "p2pd-test.sock"
    sock.touch()
    daemon = tmp_path / "p2pd"  # the kernel names a process after the path it was started by
    daemon.symlink_to(os.path.realpath(sys.executable))
    child = [str(daemon), "-c", "import time; time.sleep(120)", f"-listen=/unix{sock}"]
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, time; subprocess.Popen({child!r}); time.sleep(120)"],
        start_new_session=True,
    )
    try:

        def named_p2pd() -> bool:
            return any(
                Path(f"/proc/{pid}/comm").read_text().strip() == "p2pd" for pid in group_members(parent.pid)
            )

        wait_until(named_p2pd, timeout=30, interval=0.05)
        assert p2p_daemon_alive(parent.pid)
        sock.unlink()
        assert not p2p_daemon_alive(parent.pid)
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_a_demo_stopped_by_sigterm_stops_its_peers_first(peers, tmp_path):
    """`kill`, `timeout` or a service manager signals the demo's own process only: its monitor and peers run
    in process groups of their own, and must not be left behind, training on with nobody reading their
    output."""
    args = ["demo", "--peers", "1", "--max-epochs", "100000", "--log-dir", str(tmp_path)]
    demo = PeerProcess("demo", [*args, "--run-id", "pytest-term"], peers)
    demo.wait_for(r"\[\s*peer1\] .*\| epoch \d+ \|", timeout=180)
    (launcher,) = _children(demo.proc.pid)  # peer/launcher.py, which forked the monitor and peer1
    children = [launcher, *_children(launcher)]
    assert len(children) == 3, children
    try:
        os.kill(demo.proc.pid, signal.SIGTERM)
        assert demo.wait(timeout=120) == 130, demo.output()[-3000:]
        assert wait_until(lambda: not any(group_members(c) for c in children), timeout=30), [
            group_members(c) for c in children
        ]
    finally:
        for child in children:  # if the demo left them: its own processes, by their process groups
            if group_members(child):
                os.killpg(child, signal.SIGKILL)
    assert "Interrupted: stopping every peer of the demo" in demo.output()


def test_the_demo_starts_a_fresh_interpreter_when_its_launcher_is_gone(caplog):
    """The demo forks its monitor and peers from peer/launcher.py; a launcher that has died (killed, out of
    memory) forks nothing, and the demo then starts the process as a fresh interpreter, with one line."""
    from peer.demo import _start
    from peer.launcher import Launcher

    launcher = Launcher()
    try:
        os.killpg(launcher.server.pid, signal.SIGKILL)
        launcher.server.wait(timeout=10)
        with caplog.at_level("WARNING", logger="peer.demo"):
            child = _start("helper", [sys.executable, "-m", "peer", "--help"], launcher)
        assert child.proc.wait(timeout=60) == 0
        assert type(child.proc).__name__ == "Popen"
        child._reader.join(timeout=10)
        assert any("Usage" in line for line in child.lines), child.lines
        (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert line.startswith("Starting helper as a fresh interpreter: the launcher has exited (code -9)")
    finally:
        launcher.close()


def test_the_demo_stops_waiting_for_its_peers_when_one_fails_while_the_others_run():
    """The demo's peers wait for each other before their first step (--min-peers): a peer that fails at start
    would keep the others waiting forever, so the demo stops waiting at the first failure while others run
    (and then stops them); peers that end cleanly are waited for."""
    from peer.demo import _wait_for_peers
    from swarm.procs import Child

    python = [sys.executable, "-c"]
    clean = {"a": Child("a", [*python, "pass"]), "b": Child("b", [*python, "import time; time.sleep(1)"])}
    assert _wait_for_peers(clean, poll=0.05) == {"a": 0, "b": 0}
    waiting = Child("waiting", [*python, "import time; time.sleep(60)"])
    failed = Child("failed", [*python, "raise SystemExit(3)"])
    try:
        started = time.monotonic()
        assert _wait_for_peers({"waiting": waiting, "failed": failed}, poll=0.05) == {"failed": 3}
        assert time.monotonic() - started < 30 and waiting.proc.poll() is None
    finally:
        waiting.stop(grace=5.0)
