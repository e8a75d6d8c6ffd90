"""The hivemind tests that tests/upstream/run.py leaves out, each with its reason (:data:`EXCLUDED`, pytest
node ids relative to the extracted sdist), and those it runs although hivemind skips them
(:data:`RUN_DESPITE_SKIP`). The plugin deselects the first, unskips the second, prints both, and fails the
run if one of them is no longer there (or no longer skipped) in a file it runs.

None is left out because of swarm's patches. Left out: one case of test_averaging.py that hangs now and
then with and without them (a race in the test itself), and the tests of test_compression.py that need
``bitsandbytes``, which neither hivemind nor this project installs (hivemind imports it only for its blockwise
8-bit codec, which the swarm does not offer).

Not exclusions, and counted apart by the run:

- skipped by hivemind itself (``@pytest.mark.skip``): test_averaging.py::test_overcrowded ("The current
  implementation of elasticity ... is incorrect"; it passed here once, in 38 s). The other tests that
  hivemind skips ("due to freezes in CI") run here: :data:`RUN_DESPITE_SKIP`.
- marked ``xfail(reason="Flaky test", strict=False)`` by hivemind: the 7 cases of
  test_allreduce_fault_tolerance.py::test_fault_tolerance. They run; a failure is reported as xfailed and does
  not fail the run, as in hivemind's own CI. They passed (xpassed) in every full run here but one. Run alone
  on this 2-core machine, the case FAIL_REDUCING-FAIL_REDUCING failed in 4 of 38 runs with swarm's patches
  (3 of them while other work kept the load average at 5 to 7) and in none of 26 without them; 10 runs of
  each, interleaved at a load of 2 to 4, all passed. A failing run traced with logging went through hivemind's
  own timeouts only: the client-mode peer's 1 s read timeout (``reducer_timeout``, twice
  ``next_chunk_timeout`` 0.5 s) on a healthy reducer, which then dropped that client as a sender and averaged
  the rest of its part without it; another failed in matchmaking ("could not find a group" within the
  step's 5 s).

hivemind test files not run at all: they test the DHT, the p2p daemon, mixture-of-experts, the CLI and other
utilities, none of which ``swarm.patches`` changes (test_dht*.py, test_p2p*.py, test_moe.py, test_routing.py,
test_relays.py, test_auth.py, test_connection_handler.py, test_custom_experts.py, test_expert_backend.py,
test_start_server.py, test_training.py, test_cli_scripts.py, test_multiaddr*.py, test_util_modules.py).
"""

from __future__ import annotations

_BITSANDBYTES = (
    "needs bitsandbytes: hivemind's blockwise 8-bit codec (CompressionType.BLOCKWISE_8BIT) imports it, and "
    "neither hivemind nor swarm trainer installs it; swarm never uses that codec"
)

# hivemind skips these "due to freezes in CI"; they test what swarm's patches change, and passed in every run
# here (9 of 9 with the patches, 2 of 2 without; 30 to 60 s for the 11 together on 2 busy cores)
RUN_DESPITE_SKIP: dict[str, str] = {
    "tests/test_allreduce.py::test_allreduce_protocol": (
        "AllReduceRunner among 4 peers in every mode (node, client, aux), weights and part sizes: the runner "
        "that the allreduce patch (items 8, 11) and the traffic patch change"
    ),
    "tests/test_averaging.py::test_allgather": (
        "8 averagers in groups of 4, each gathering its groupmates' data: matchmaking (items 1, 20)"
    ),
}

EXCLUDED: dict[str, str] = {
    # 4 averagers look for groups of 2 with triggers; the test cancels 2 of them right away and then waits,
    # without a timeout, for the other 2 to average. A peer whose cancel comes after it has become a leader
    # (or a follower) takes one of the live peers into its group, which then never runs, and the other live
    # peer looks for a partner for ever (hivemind's test_averaging_cancel was made "more robust" for such
    # races once already, hivemind PR 650).
    "tests/test_averaging.py::test_averaging_cancel[2]": (
        "flaky on 2 cores: it hangs until the test timeout in about 1 run in 10, with swarm's patches "
        "(3 of 33 runs) and without them (1 of 12): a race between the test's cancels and matchmaking"
    ),
    # serializes a tensor with every codec, BLOCKWISE_8BIT among them
    "tests/test_compression.py::test_tensor_compression": _BITSANDBYTES,
    # every floating-point dtype with every codec, BLOCKWISE_8BIT among them
    **{
        f"tests/test_compression.py::test_serialize_tensor_properties[{grad}-dtype{i}]": _BITSANDBYTES
        for grad in ("False", "True")
        for i in range(4)
    },
    # a bfloat16 tensor through NONE and BLOCKWISE_8BIT
    **{
        f"tests/test_compression.py::test_serialize_bfloat16[tensor_size{i}-{legacy}]": _BITSANDBYTES
        for i in range(2)
        for legacy in ("True", "False")
    },
}
