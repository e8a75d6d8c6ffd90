"""hivemind's own tests of the averager, the all-reduce and the optimizer, run with swarm trainer's changes
installed (docs/hivemind-patches.md): ``make test-upstream``, also the last step of ``make test-slow``; not
part of ``make test``.

Run::

    python -m tests.upstream.run                      # everything below (about 6 to 10 minutes on 2 cores)
    python -m tests.upstream.run --files tests/test_averaging.py -- -k allreduce_once -x
    python -m tests.upstream.run --plain              # the same without swarm's changes, to compare

What it does (tests/upstream/run.py):

1. hivemind's repository is not vendored. Its sdist on PyPI (hivemind-1.1.12.tar.gz, sha256 in run.py) holds
   its tests; run.py downloads it into ``.cache/hivemind-1.1.12/`` (ignored by git) unless it is there,
   checks its sha256, and extracts only its ``tests/`` folder there, beside a pytest.ini of ours. The tests
   import the installed hivemind, whose version ``swarm.patches`` checks.
2. It runs pytest on test_allreduce.py, test_averaging.py, test_optimizer.py,
   test_allreduce_fault_tolerance.py and test_compression.py of that folder, with ``-p
   tests.upstream.plugin``, in a process group of its own, which it stops afterwards (nothing the tests
   started outlives the run), and prints one line: passed, failed, skipped (by hivemind's own marks),
   xfailed and xpassed (hivemind's "Flaky test" marks), excluded, and the wall time. It exits with pytest's
   code.

The plugin (tests/upstream/plugin.py) installs swarm's process-wide patches (``swarm.patches.install()``) at
``pytest_configure``, and puts the classes the swarm builds in hivemind's place where hivemind's tests look
them up: ``keeping_local_gradients(GradientAverager)`` (and of PowerSGD's), the state averager class of
swarm/patches/state_averager.py, ``SwarmDHT``. It prints what it replaced in the report's header, checks in
every test's own process that all of it is in place, and fails the run if a test that must average passed
without a byte through the ``traffic`` patch's all-reduce runner, which runs only in the averagers'
processes: a run in which the patches were not active in the averagers cannot pass. Not installed here: the
per-optimizer wiring (``swarm.patches.optimizer.wire``), which needs a swarm's ``Wiring`` (a round screen,
the update optimizer), and the progress tracker's changes, which ``wire`` applies. The robust reducer
(swarm/patches/robust.py) is installed with hivemind's weighted mean as its rule: hivemind's tests assert that
mean for unrelated random tensors and unequal weights, which the robust rule is meant not to give.

tests/upstream/exclusions.py lists the tests left out and why (13 tests of test_compression.py that need
bitsandbytes, and test_averaging.py::test_averaging_cancel[2], which hangs now and then with and without
swarm's patches; none because of them), and the 11 tests run although hivemind skips them.

A full run on this project's 2-core development machine: 126 tests run (1 of them skipped by hivemind, the 7
fault-tolerance cases xpassed), 14 excluded, in 5.6 to 10 minutes depending on other load.

What the tests need beyond the project's own dependencies (pyproject.toml, extra ``test``):

- pytest-forked: every one of these tests is ``@pytest.mark.forked``. With pytest 9.2 its reports fail to
  cross from the forked process (``marshal`` refuses pytest's new ``NodeId``; every test "EXITED with status
  3"); the plugin sends that field as text, as pytest's own report serialization does.
- pytest-asyncio: the async tests are each ``@pytest.mark.asyncio`` and use no async fixtures, so its strict
  mode (its default, also set in our pytest.ini) runs them. hivemind pins 0.26.0, which requires
  pytest<9; 1.x works with pytest 9.
- ``test_utils.dht_swarms.launch_dht_instances``: imported by hivemind's tests but not in its sdist;
  tests/upstream/shim/test_utils/ has this project's own version. hivemind's tests/conftest.py is not in the
  sdist either: the plugin ends, after each test, the processes that test started (pytest-forked ends a
  test's process with ``os._exit``, which leaves its DHTs, averagers and p2p daemons running, about 80 in
  test_optimizer.py alone, taking the CPU that later tests' timing assertions need).
"""
