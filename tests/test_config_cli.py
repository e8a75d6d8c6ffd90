"""Config resolution and the CLI's handling of bad input (click's CliRunner, in-process)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from peer.cli import done_line, main
from swarm.config import ConfigError, build_config, replace


def test_precedence_flags_over_env_over_yaml_over_defaults(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("data:\n  batch_size: 16\nswarm:\n  target_batch_size: 512\n  run_id: from-yaml\n")
    cfg = build_config(str(path), {"run_id": "from-flag"}, environ={"SWARM_TARGET_BATCH_SIZE": "256"})
    assert cfg.data.batch_size == 16  # yaml over default
    assert cfg.swarm.target_batch_size == 256  # env over yaml
    assert cfg.swarm.run_id == "from-flag"  # flag over yaml
    assert cfg.model.model_name == "vit_base_patch32_224"  # default flagship


def test_bundled_configs_resolve():
    demo = build_config("demo", environ={})
    assert demo.data.dataset == "digits" and demo.model.img_size == 32
    flagship = build_config("flagship", environ={})
    assert flagship.model.model_name == "vit_base_patch32_224" and flagship.model.img_size == 224
    internet = build_config("internet", environ={})
    assert internet.model == flagship.model and internet.swarm.averaging == "diloco"
    assert internet.swarm.round_seconds > 0 and internet.swarm.compression == "int8"


def test_round_seconds_needs_diloco():
    with pytest.raises(ConfigError, match="round_seconds"):
        build_config("demo", {"round_seconds": 10.0}, environ={})
    paced = build_config("demo", {"round_seconds": 10.0, "averaging": "diloco"}, environ={})
    assert paced.swarm.round_seconds == 10


def test_overlap_rounds_needs_diloco_and_comes_from_flag_or_environment():
    with pytest.raises(ConfigError, match="overlap_rounds"):
        build_config("demo", {"overlap_rounds": True}, environ={})
    flagged = build_config("demo", {"overlap_rounds": True, "averaging": "diloco"}, environ={})
    assert flagged.swarm.overlap_rounds
    from_env = build_config("demo", {"averaging": "diloco"}, environ={"SWARM_OVERLAP_ROUNDS": "true"})
    assert from_env.swarm.overlap_rounds
    assert not build_config("demo", {"averaging": "diloco"}, environ={}).swarm.overlap_rounds


def test_match_early_needs_rounds_paced_by_time():
    for fields in ({"match_early": True}, {"match_early": True, "averaging": "diloco"}):
        with pytest.raises(ConfigError, match="match_early"):
            build_config("demo", fields, environ={})
    paced = {"match_early": True, "averaging": "diloco", "round_seconds": 5.0}
    assert build_config("demo", paced, environ={}).swarm.match_early
    assert build_config("internet", environ={}).swarm.match_early


@pytest.mark.parametrize(
    "text, message",
    [
        ("data:\n  batch_sise: 3\n", "unknown key data.batch_sise"),
        ("dataa:\n  batch_size: 3\n", "unknown section"),
        ("data:\n  batch_size: [1\n", "not valid YAML"),
        ("data:\n  batch_size: 3.5\n", "not a valid int"),
    ],
)
def test_bad_yaml_is_rejected(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        build_config(str(path), environ={})


def test_unknown_env_var_is_an_error():
    with pytest.raises(ConfigError, match="SWARM_BATCHSIZE"):
        build_config(None, environ={"SWARM_BATCHSIZE": "4"})


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"batch_size": 64, "target_batch_size": 32}, "smaller than batch_size"),
        ({"averaging_timeout": -1.0}, "averaging_timeout=-1.0"),
        ({"matchmaking_time": 2.0, "request_timeout": 3.0}, "matchmaking_time"),
        ({"precision": "16-mixed", "device": "cpu"}, "precision"),
        ({"run_id": "bad id!"}, "run_id"),
        ({"patch_size": 5, "img_size": 32}, "patch_size"),
    ],
)
def test_invalid_values_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config(None, overrides, environ={})


def test_replace_revalidates():
    cfg = build_config("demo", environ={})
    assert replace(cfg, batch_size=8).data.batch_size == 8
    with pytest.raises(ConfigError):
        replace(cfg, batch_size=0)


def test_resolved_config_roundtrips_through_yaml(tmp_path):
    from swarm.config import save_config

    cfg = build_config("demo", {"initial_peers": ("/ip4/127.0.0.1/tcp/1/p2p/QmX",)}, environ={})
    save_config(cfg, tmp_path / "config.yaml")
    again = build_config(str(tmp_path / "config.yaml"), environ={})
    assert again == cfg


@pytest.mark.parametrize(
    "args, message",
    [
        (["join", "--batch-size", "0"], "0 is below 1; give a batch size >= 1 or 'auto'"),
        (["join", "--precision", "fp8"], "Invalid value for '--precision'"),
        (["join", "--config", "no-such-config"], "not found"),
        (["join", "--target-batch-size", "8", "--batch-size", "16"], "smaller than batch_size"),
        (["join", "--averaging-timeout", "-5"], "averaging_timeout"),
        (["join", "--no-such-flag"], "No such option"),
        (["demo", "--peers", "0"], "Invalid value for '--peers'"),
    ],
)
def test_bad_flags_give_a_usage_error_not_a_traceback(args, message):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_malformed_multiaddr_is_one_line_error(tmp_path):
    result = CliRunner().invoke(
        main, ["join", "--config", "demo", "--initial-peers", "not-an-address", "--log-dir", str(tmp_path)]
    )
    assert result.exit_code == 1, result.output
    assert "not a multiaddr" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("command", ["join", "monitor"])
def test_another_hivemind_release_is_one_line_before_any_slow_work(tmp_path, monkeypatch, command):
    """swarm/patches was written for one hivemind release: another gets one line that names the supported
    release and how to install it, before the data set or the DHT (no p2p daemon was started)."""
    import hivemind

    from swarm import patches

    monkeypatch.setattr(hivemind, "__version__", "1.2.0")
    result = CliRunner().invoke(main, [command, "--config", "demo", "--log-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert result.output.strip().splitlines() == [
        f"Error: swarm trainer supports hivemind {patches.SUPPORTED} only (its changes to hivemind's "
        "averagers were written against that release), and hivemind 1.2.0 is installed: run "
        f"`pip install hivemind=={patches.SUPPORTED}` in this environment"
    ]
    assert not list(tmp_path.rglob("*.yaml"))  # nothing was set up: not even the resolved config


def test_help_lists_the_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in ("join", "bootstrap", "demo"):
        assert command in result.output


def test_the_join_line_repeats_the_shared_settings_that_flags_changed():
    from swarm.layout import JOIN_FLAGS, join_words
    from swarm.net.fingerprint import shared_overrides

    cfg = build_config("demo", {"target_batch_size": 1024, "warmup_epochs": 3, "batch_size": 8}, environ={})
    overrides = shared_overrides(cfg, "demo")
    assert overrides == {"target_batch_size": "1024", "warmup_epochs": "3"}  # batch_size is per peer
    assert join_words(overrides) == (["--target-batch-size", "1024"], ["SWARM_WARMUP_EPOCHS=3"])
    assert shared_overrides(build_config("demo", environ={}), "demo") == {}
    # the flags named in join lines exist on `join`, for the fields they stand for
    options = {p.name: p.opts for p in main.commands["join"].params}
    for field, flag in JOIN_FLAGS.items():
        assert flag in options[field], (field, flag, options.get(field))


def test_the_done_line_names_the_epoch_of_a_validation_older_than_the_peers_last_epoch():
    # a peer that validated as it started (epoch 0) and left on a signal at epoch 18: not "val acc 0.0836"
    left = {"final_epoch": 18, "final_val": {"epoch": 0, "acc": 0.0836}, "mean_samples_per_second": 1201.8}
    assert done_line(left) == "Done: global epoch 18, val acc 0.0836 (at global epoch 0), 1201.8 samples/s"
    ended = {"final_epoch": 160, "final_val": {"epoch": 160, "acc": 0.94}, "mean_samples_per_second": 400.0}
    assert done_line(ended) == "Done: global epoch 160, val acc 0.9400, 400.0 samples/s"
    unevaluated = {"final_epoch": 3, "final_val": None, "mean_samples_per_second": None}
    assert done_line(unevaluated) == "Done: global epoch 3, val acc n/a (not evaluated), 0.0 samples/s"
