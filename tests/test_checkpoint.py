"""Checkpoints through fsspec: local files and a real S3-speaking server (moto) on 127.0.0.1.

Read back with the public readers: plain ``torch.load``, ``timm.create_model`` + ``load_state_dict``, boto3.
"""

from __future__ import annotations

import io
import socket
import urllib.request

import pytest
import torch

from monitor.state import BEST, LAST, CheckpointKeeper
from swarm.config import build_config, replace
from swarm.training.checkpoint import (
    CheckpointError,
    check_compatible,
    load_checkpoint,
    make_checkpoint,
    save_checkpoint,
)
from swarm.training.model import create_model
from tests.helpers import plain_timm_model


@pytest.fixture(scope="module")
def cfg():
    return build_config("demo", {"run_id": "pytest-ckpt"})


def _timm_model(cfg):
    return plain_timm_model(cfg.model)


def test_checkpoint_loads_with_plain_torch_and_timm(tmp_path, cfg):
    net = create_model(cfg.model)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()
    url = str(tmp_path / "ck" / "best.ckpt")
    save_checkpoint(url, make_checkpoint(net, cfg, 7, {"val/acc": 0.5}, opt))

    payload = torch.load(url)  # default weights_only=True: only plain types inside
    assert payload["global_epoch"] == 7 and payload["metrics"] == {"val/acc": 0.5}
    assert payload["config"]["model"]["model_name"] == cfg.model.model_name
    assert payload["optimizer"]["state"], "AdamW moments are kept for --resume-from"
    fresh = _timm_model(cfg)
    fresh.load_state_dict(payload["state_dict"])
    x = torch.randn(3, 3, 32, 32)
    net.eval(), fresh.eval()
    assert torch.equal(fresh(x), net(x))
    assert load_checkpoint("file://" + url)["global_epoch"] == 7  # file:// URLs too


def test_a_crash_during_save_leaves_the_old_checkpoint_intact(tmp_path, cfg):
    url = str(tmp_path / BEST)
    net = create_model(cfg.model)
    save_checkpoint(url, make_checkpoint(net, cfg, 3, {"val/acc": 0.9}))
    before = (tmp_path / BEST).read_bytes()

    payload = make_checkpoint(net, cfg, 4, {"val/acc": 0.95})
    payload["zz_unpicklable"] = lambda: None  # serialisation fails after the tensors were written
    with pytest.raises(CheckpointError):
        save_checkpoint(url, payload)
    assert (tmp_path / BEST).read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == [BEST], "no temporary file is left behind"
    assert load_checkpoint(url)["global_epoch"] == 3


def test_corrupt_and_truncated_checkpoints_give_one_line(tmp_path, cfg):
    url = str(tmp_path / LAST)
    save_checkpoint(url, make_checkpoint(create_model(cfg.model), cfg, 1, {}))
    data = (tmp_path / LAST).read_bytes()
    (tmp_path / LAST).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(url)
    assert "corrupt or truncated" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(str(tmp_path / "missing.ckpt"))
    other = build_config("demo", {"num_classes": 7, "model_name": "vit_small_patch16_224"})
    with pytest.raises(CheckpointError, match="another model"):
        check_compatible(_valid(cfg), other.model, url)


def _valid(cfg):
    return make_checkpoint(create_model(cfg.model), cfg, 1, {})


def test_keeper_never_replaces_a_better_best_also_after_a_restart(tmp_path, cfg):
    cfg = replace(cfg, checkpoint_uri=str(tmp_path / "ckpts"))
    net, opt = create_model(cfg.model), None
    keeper = CheckpointKeeper(cfg)
    assert keeper.save(net, opt, 5, {"acc": 0.4, "acc_top5": 0.8, "loss": 1.0, "samples": 10})
    assert not keeper.save(net, opt, 10, {"acc": 0.3, "acc_top5": 0.7, "loss": 1.2, "samples": 10})
    restarted = CheckpointKeeper(cfg)  # a new monitor process reads the best so far back
    assert restarted.best_acc == pytest.approx(0.4) and restarted.best_epoch == 5
    assert not restarted.save(net, opt, 15, {"acc": 0.35, "acc_top5": 0.7, "loss": 1.1, "samples": 10})
    assert load_checkpoint(keeper.url(BEST))["global_epoch"] == 5
    assert load_checkpoint(keeper.url(LAST))["global_epoch"] == 15
    assert restarted.save(net, opt, 20, {"acc": 0.5, "acc_top5": 0.9, "loss": 0.9, "samples": 10})
    assert load_checkpoint(keeper.url(BEST))["global_epoch"] == 20


@pytest.fixture
def s3_server(monkeypatch):
    """moto's S3 server on 127.0.0.1 (real HTTP, real S3 protocol), with throw-away credentials."""
    from moto.server import ThreadedMotoServer

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # moto keeps its buckets in the process, not in the server: a test before this one in the same worker
    # left its objects there (a listing found another test's checkpoint), so each test starts empty
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST"))
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def test_s3_checkpoints_through_a_real_s3_server(s3_server, cfg):
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server)
    client.create_bucket(Bucket="swarm-ckpts")
    cfg = replace(cfg, checkpoint_uri="s3://swarm-ckpts/runs/demo", s3_endpoint_url=s3_server)
    net = create_model(cfg.model)
    keeper = CheckpointKeeper(cfg)
    assert keeper.save(net, None, 6, {"acc": 0.25, "acc_top5": 0.6, "loss": 2.0, "samples": 359})
    assert not keeper.save(net, None, 9, {"acc": 0.2, "acc_top5": 0.6, "loss": 2.1, "samples": 359})

    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="swarm-ckpts")["Contents"])
    assert keys == ["runs/demo/best.ckpt", "runs/demo/last.ckpt"]  # nothing temporary left
    body = client.get_object(Bucket="swarm-ckpts", Key="runs/demo/best.ckpt")["Body"].read()
    payload = torch.load(io.BytesIO(body))
    assert payload["global_epoch"] == 6 and payload["metrics"]["val/acc"] == pytest.approx(0.25)
    _timm_model(cfg).load_state_dict(payload["state_dict"])
    assert CheckpointKeeper(cfg).best_acc == pytest.approx(0.25)  # a restarted monitor reads it back

    missing = replace(cfg, checkpoint_uri="s3://no-such-bucket/x")
    with pytest.raises(CheckpointError) as err:
        save_checkpoint("s3://no-such-bucket/x/best.ckpt", _valid(cfg), s3_server)
    assert "bucket does not exist" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="bucket does not exist"):
        CheckpointKeeper(missing)  # the monitor refuses to start rather than fail at its first save

    with socket.socket() as probe:  # a port on which nothing listens
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(CheckpointError) as err:
        CheckpointKeeper(replace(cfg, s3_endpoint_url=closed))
    assert "bucket does not exist" not in str(err.value) and "--s3-endpoint-url" in str(err.value)


def test_s3_bad_credentials_give_one_line_and_leave_the_checkpoint_alone(s3_server, cfg, monkeypatch):
    import boto3
    from moto.core.authorization import enable_iam_authentication

    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="creds")
    url = "s3://creds/run/best.ckpt"
    save_checkpoint(url, _valid(cfg), s3_server)
    before = load_checkpoint(url, s3_server)["state_dict"]
    # the server now checks signatures against its IAM users; "testing" is not one of them
    with enable_iam_authentication():
        with pytest.raises(CheckpointError) as err:
            save_checkpoint(
                url, make_checkpoint(create_model(replace(cfg, init_seed=5).model), cfg, 2, {}), s3_server
            )
        assert "S3 refused access" in str(err.value) and "AWS_ACCESS_KEY_ID" in str(err.value)
        assert "\n" not in str(err.value)
        with pytest.raises(CheckpointError, match="S3 refused access"):
            CheckpointKeeper(replace(cfg, checkpoint_uri="s3://creds/run", s3_endpoint_url=s3_server))
    after = load_checkpoint(url, s3_server)
    assert after["global_epoch"] == 1  # the refused upload did not touch what was there
    assert all(torch.equal(before[k], after["state_dict"][k]) for k in before)


def test_a_corrupt_resume_checkpoint_stops_join_in_one_line_and_stays_as_it_was(tmp_path, cfg):
    from click.testing import CliRunner

    from peer.cli import main

    path = tmp_path / "broken.ckpt"
    save_checkpoint(str(path), _valid(cfg))
    path.write_bytes(path.read_bytes()[:5000])
    data = path.read_bytes()
    result = CliRunner().invoke(
        main, ["join", "--config", "demo", "--resume-from", str(path), "--log-dir", str(tmp_path / "runs")]
    )
    assert result.exit_code == 1, result.output
    assert "corrupt or truncated" in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("Error")]) == 1
    assert path.read_bytes() == data


def _briefly_trained(cfg, steps: int = 40):
    """The demo's model after a few AdamW steps on the digits: its predictions spread over the classes."""
    from swarm.training.data import build_datasets, train_loader

    torch.manual_seed(0)
    net = create_model(cfg.model)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    train, _ = build_datasets(cfg.data, cfg.model.img_size)
    for _, (images, target) in zip(range(steps), train_loader(train, cfg.data, seed=0), strict=False):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(images), target).backward()
        opt.step()
    return net, opt


def test_evaluate_reports_a_checkpoints_test_metrics_from_s3(tmp_path, cfg, s3_server):
    """`swarm-peer evaluate s3://...`: its accuracy, per-class accuracy and confusion matrix equal those of
    timm's own model with the checkpoint's weights on the held-out images; the results land as JSON, PNG and
    TensorBoard scalars (read back with TensorBoard's reader) in the run that saved the checkpoint."""
    import json

    import boto3
    from click.testing import CliRunner
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from monitor.report import test_accuracy
    from peer.cli import main
    from swarm.training.data import build_datasets
    from swarm.training.logbook import read_run

    net, opt = _briefly_trained(cfg)
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="swarm-ckpts")
    url = "s3://swarm-ckpts/runs/pytest-ckpt/best.ckpt"
    payload = make_checkpoint(net, cfg, 12, {"val/acc": 0.5}, opt, run="pytest-ckpt/monitor")
    save_checkpoint(url, payload, s3_server)

    args = ["evaluate", url, "--s3-endpoint-url", s3_server, "--log-dir", str(tmp_path), "--threads", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    folder = tmp_path / "pytest-ckpt" / "monitor" / "test"
    got = json.loads((folder / "evaluation.json").read_text())

    reference = _timm_model(cfg)
    reference.load_state_dict(payload["state_dict"])
    reference.eval()
    _, held_out = build_datasets(replace(cfg, augment=False).data, cfg.model.img_size)
    expected = [[0] * 10 for _ in range(10)]
    with torch.no_grad():
        for i in range(len(held_out)):
            image, label = held_out[i]
            expected[label][int(reference(image.unsqueeze(0)).argmax())] += 1
    assert got["confusion"] == expected
    assert got["samples"] == len(held_out) == 359 and got["global_epoch"] == 12
    correct = sum(expected[c][c] for c in range(10))
    assert got["acc"] == pytest.approx(correct / 359)
    for c in range(10):
        assert got["per_class_acc"][c] == pytest.approx(expected[c][c] / sum(expected[c]))
    assert got["acc"] > 0.3 and sum(any(row[c] for row in expected) for c in range(10)) > 3  # not one class
    assert f"acc {got['acc']:.4f}" in result.output and "per class: 0 " in result.output

    scalars, _ = read_run(folder)
    assert scalars["test/acc"] == [(12, pytest.approx(got["acc"]))]
    assert scalars["test/class_acc/3"] == [(12, pytest.approx(got["per_class_acc"][3]))]
    images = EventAccumulator(str(folder), size_guidance={"images": 0})
    images.Reload()
    assert images.Tags()["images"] == ["test/confusion"]
    assert (folder / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert test_accuracy(folder.parent) == pytest.approx(got["acc"])  # the logbook's `test acc` column


def test_evaluate_refuses_another_model_and_a_damaged_checkpoint_in_one_line(tmp_path, cfg):
    from click.testing import CliRunner

    from peer.cli import main

    five = replace(cfg, num_classes=5)
    url = str(tmp_path / "five.ckpt")
    save_checkpoint(url, make_checkpoint(create_model(five.model), five, 3, {}))
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(b"not a checkpoint at all")
    for args, message in [
        ([url, "--config", "demo"], "holds another model than this run (num_classes 5 != 10)"),
        ([url], "classifies 5 classes, but digits has 10"),
        ([str(damaged)], "is corrupt or truncated"),
        ([str(tmp_path / "missing.ckpt")], "does not exist"),
    ]:
        result = CliRunner().invoke(main, ["evaluate", *args, "--log-dir", str(tmp_path)])
        assert result.exit_code == 1, result.output
        assert message in result.output and "Traceback" not in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
