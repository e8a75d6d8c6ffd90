"""Run hivemind's own tests of the averager, the all-reduce and the optimizer with swarm trainer's changes:
``python -m tests.upstream.run`` (``make test-upstream``; ``make test-slow`` runs it too).

1. Downloads hivemind's sdist from PyPI into ``.cache/hivemind-<version>/`` (ignored by git) unless it is
   there, and checks its sha256.
2. Extracts its ``tests/`` folder there (nothing else: the tests import the installed hivemind, whose version
   ``swarm.patches`` checks), with a pytest.ini of ours beside it.
3. Runs pytest on :data:`FILES` in its own process group, with ``-p tests.upstream.plugin`` (which installs
   the patches and deselects tests/upstream/exclusions.py), and ends whatever the tests left running.

Options: ``--plain`` runs plain hivemind instead (to tell whether a failure is ours), ``--files`` other test
files of the sdist; anything after ``--`` goes to pytest (``-- -k test_grad_averager -x``). Exits with
pytest's code; prints one closing line of counts and the wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from swarm.patches import SUPPORTED
from swarm.procs import _bound_unix_paths, group_members, remove_stale_sockets, start_group, stop_group
from tests.upstream.plugin import PIDS_ENV

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SDIST = f"hivemind-{SUPPORTED}.tar.gz"
URL = (
    "https://files.pythonhosted.org/packages/60/41/1aac9b64f9aa174dd8ff03a997df52c9652e9326b376f1f4eaa066e6a358/"
    + SDIST
)
SHA256 = "11750accdc82421f3b37a920b8fb745d3e5add0187a774f7f217b46fa74fa984"
CACHE = ROOT / ".cache" / f"hivemind-{SUPPORTED}"
FILES = (
    "tests/test_allreduce.py",  # the all-reduce runner, partitioning, 8-bit codecs (compression patch)
    "tests/test_averaging.py",  # DecentralizedAverager: matchmaking, all-reduce, state downloads
    "tests/test_optimizer.py",  # gradient and state averagers, progress tracker, hivemind.Optimizer
    "tests/test_allreduce_fault_tolerance.py",  # faulty senders and reducers (allreduce patch, item 8)
    "tests/test_compression.py",  # codecs, in averaging rounds too (compression patch)
)
TIMEOUT_S = 300  # per test (pytest-timeout); the slowest passing test took 40 s on 2 busy cores
TOTAL_TIMEOUT_S = 45 * 60  # the whole run (about 6 to 10 minutes on 2 busy cores)
# our own pytest.ini (hivemind's settings live in its pyproject.toml, which is not extracted)
INI = f"""\
[pytest]
# hivemind marks each async test with @pytest.mark.asyncio and has no async fixtures: strict mode runs them
asyncio_mode = strict
asyncio_default_fixture_loop_scope = function
timeout = {TIMEOUT_S}
# the timer runs in the test's forked process, which then fails that test; in pytest's own process it would
# end the whole session (an INTERNALERROR) and leave the forked process running
timeout_func_only = true
addopts = -p no:cacheprovider -rfEsx
"""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(cache: Path = CACHE) -> Path:
    """The sdist in ``cache``, downloaded if it is not there (or not the right file); checked either way."""
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / SDIST
    if sdist.exists() and _sha256(sdist) != SHA256:
        print(f"{sdist} has the wrong sha256: downloading it again", flush=True)
        sdist.unlink()
    if not sdist.exists():
        print(f"downloading {URL}", flush=True)
        part = sdist.with_suffix(".part")
        with urllib.request.urlopen(URL, timeout=120) as response, part.open("wb") as f:
            while block := response.read(1 << 20):
                f.write(block)
        if (got := _sha256(part)) != SHA256:
            part.unlink()
            raise SystemExit(f"{URL}: sha256 {got}, expected {SHA256}")
        part.rename(sdist)
    return sdist


def extract(sdist: Path, cache: Path = CACHE) -> Path:
    """Extract the sdist's ``tests/`` folder into ``cache`` (afresh), beside our pytest.ini; returns
    ``cache`` (pytest's rootdir)."""
    top = f"hivemind-{SUPPORTED}/"
    tests = cache / "tests"
    if tests.exists():
        for path in sorted(tests.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        tests.rmdir()
    with tarfile.open(sdist) as tar:
        members = []
        for member in tar.getmembers():
            if member.name.startswith(f"{top}tests/"):
                member.name = member.name[len(top) :]  # .cache/hivemind-<version>/tests/...
                members.append(member)
        tar.extractall(cache, members=members, filter="data")
    (cache / "pytest.ini").write_text(INI)
    return cache


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def remove_shared_memory(pids: set[int], shm: Path = Path("/dev/shm")) -> int:
    """Remove the shared-memory files in ``shm`` that torch created for processes of ``pids`` that are gone
    (torch names them ``torch_<pid>_...``): hivemind's tests fork processes that share tensors and end some
    of them abruptly, and their files outlive them (about 400 files a run). Returns how many were removed."""
    removed = 0
    for path in shm.glob("torch_*_*"):
        try:
            pid = int(path.name.split("_")[1])
        except ValueError:
            continue
        if pid in pids and not Path(f"/proc/{pid}").exists():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
    return removed


def temp_dirs(tmp: Path | None = None) -> set[str]:
    """The names of multiprocessing's folders (``pymp-*``) in the temporary directory."""
    return {path.name for path in Path(tmp or tempfile.gettempdir()).glob("pymp-*")}


def remove_temp_dirs(before: set[str], tmp: Path | None = None) -> int:
    """Remove the folders that multiprocessing made (``pymp-*``) in the temporary directory since ``before``
    was taken and that no process uses any more (no socket in them is bound): each process makes one for its
    resource sharer's socket and removes it at a normal exit, and hivemind's tests end many of theirs
    abruptly (about 50 folders a run). Returns how many were removed."""
    bound, _ = _bound_unix_paths()
    removed = 0
    for path in Path(tmp or tempfile.gettempdir()).glob("pymp-*"):
        if path.name in before or not path.is_dir():
            continue
        with contextlib.suppress(OSError):
            if any(str(entry) in bound for entry in path.iterdir()):
                continue
            shutil.rmtree(path)
            removed += 1
    return removed


def counts(record: dict) -> Counter:
    """Tests by outcome (passed, failed, skipped, xfailed, xpassed), as the plugin recorded them."""
    return Counter(record.get("outcomes", {}).values())


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m tests.upstream.run", description=__doc__)
    parser.add_argument("--plain", action="store_true", help="plain hivemind: no swarm patches (to compare)")
    parser.add_argument("--files", nargs="+", default=list(FILES), help="test files of the sdist to run")
    args = parser.parse_args(argv)

    started = time.monotonic()
    root = extract(fetch())
    junit, record, pids = CACHE / "report.xml", CACHE / "record.json", CACHE / "pids"
    for path in (junit, record, pids):
        path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(root / "pytest.ini"),
        "--rootdir",
        str(root),
        "-p",
        "tests.upstream.plugin",
        f"--swarm-patches={'none' if args.plain else 'all'}",
        f"--swarm-record={record}",
        f"--junitxml={junit}",
        *[str(root / f) for f in args.files],
        *extra,
    ]
    env = dict(os.environ)
    # this project (for -p tests.upstream.plugin and swarm) and our stand-in for hivemind's test_utils
    path = [str(ROOT), str(HERE / "shim")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["OMP_NUM_THREADS"] = "1"
    env[PIDS_ENV] = str(pids)
    print(" ".join(cmd), flush=True)
    since, folders_before = time.time(), temp_dirs()
    proc = start_group(cmd, env=env, cwd=ROOT)
    try:
        code = proc.wait(timeout=TOTAL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        print(f"the run took more than {TOTAL_TIMEOUT_S} s: stopped", flush=True)
        code = 1
    except KeyboardInterrupt:
        code = 130
    finally:
        leftovers = Counter(_name(pid) for pid in group_members(proc.pid))
        stop_group(proc, grace=5.0)  # whatever the tests left running (p2p daemons orphaned by a fork)
        remove_stale_sockets(since=since, settle=2.0)  # also torch's shared-memory managers' 2 s to clean up
        ran = {int(x) for x in pids.read_text().split()} if pids.exists() else set()
        shared = remove_shared_memory(ran)
        folders = remove_temp_dirs(folders_before)
    wall = time.monotonic() - started
    if leftovers:
        total = sum(leftovers.values())
        print(f"stopped {total} processes that hivemind's tests left running: {dict(leftovers)}", flush=True)
    if shared:
        print(f"removed {shared} shared-memory files that hivemind's tests left in /dev/shm", flush=True)
    if folders:
        print(
            f"removed {folders} of multiprocessing's pymp-* folders that hivemind's tests left behind",
            flush=True,
        )
    if not junit.exists() or not record.exists():
        print("pytest stopped before its summary: no report", flush=True)
        return code or 1
    rec = json.loads(record.read_text())
    n = counts(rec)
    mode = "plain hivemind" if args.plain else "swarm patches"
    print(
        f"hivemind {SUPPORTED} tests with {mode}: {n['passed']} passed, {n['failed']} failed, "
        f"{n['skipped']} skipped, {n['xfailed']} xfailed, {n['xpassed']} xpassed, "
        f"{len(rec.get('excluded', {}))} excluded in {wall:.0f} s",
        flush=True,
    )
    if "error" in rec:
        print(f"FAILED: {rec['error']}", flush=True)
    if code not in (0, 1):  # 2: interrupted, 3: pytest's internal error, 4: usage error, 5: no test
        print(f"FAILED: pytest exited with code {code} (not every test ran)", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
