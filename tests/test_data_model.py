"""Data loading (the real CIFAR-10 code on CIFAR-format files written here, and the digits set), the model
builder, the LR schedule and the metrics record schema."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from swarm.config import DataConfig, ModelConfig, build_config
from swarm.training.data import CIFAR_FOLDER, DatasetError, build_datasets, load_cifar10, train_loader
from swarm.training.model import ModelError, create_model, lr_lambda


def write_cifar(root, n_per_batch: int = 20, seed: int = 0):
    """Write a tiny data set in the cifar-10-batches-py pickle layout; returns the labels per file."""
    rng = np.random.default_rng(seed)
    folder = root / CIFAR_FOLDER
    folder.mkdir(parents=True)
    labels = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(n_per_batch, 3072), dtype=np.uint8)
        batch_labels = rng.integers(0, 10, size=n_per_batch).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({"batch_label": name, "labels": batch_labels, "data": data, "filenames": []}, f)
        labels[name] = (data, batch_labels)
    return labels


def test_cifar_loader_reads_the_pickle_layout(tmp_path):
    written = write_cifar(tmp_path)
    train_x, train_y, test_x, test_y = load_cifar10(str(tmp_path), download=False)
    assert train_x.shape == (100, 3, 32, 32) and train_x.dtype == torch.uint8
    assert test_x.shape == (20, 3, 32, 32)
    data, labels = written["data_batch_1"]
    assert torch.equal(train_x[0], torch.from_numpy(data[0]).reshape(3, 32, 32))  # channel-major layout
    assert train_y[:20].tolist() == labels
    assert test_y.tolist() == written["test_batch"][1]


def test_cifar_batches_reach_the_model_at_32_px_and_the_model_resizes_them(tmp_path):
    """A 224 px model on CIFAR: the loader sends 32 px images (normalised, cropped and flipped at 32 px),
    and the model resizes each batch itself, bilinearly, on the batch's device: the loader's CPU workers
    never build 224 px images (per image in the workers, they held a GPU at 23 % busy)."""
    write_cifar(tmp_path)
    cfg = DataConfig(dataset="cifar10", data_dir=str(tmp_path), download=False, batch_size=4)
    train, val = build_datasets(cfg, img_size=224)
    image, label = train[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and 0 <= label <= 9
    assert val[0][0].shape == (3, 32, 32)
    images, labels = next(iter(train_loader(train, cfg, seed=1)))
    assert images.shape == (4, 3, 32, 32) and labels.shape == (4,)

    model_cfg = ModelConfig("vit_tiny_patch16_224", img_size=224, depth=1, embed_dim=32, num_heads=2)
    net = create_model(model_cfg).eval()
    seen = []
    net.patch_embed.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    with torch.no_grad():
        logits = net(images)
        resized = F.interpolate(images, size=(224, 224), mode="bilinear", align_corners=False)
        assert torch.equal(net(resized), logits)  # the same as resizing first: the hook changes nothing else
    assert logits.shape == (4, 10) and seen == [(4, 3, 224, 224)] * 2


def test_missing_cifar_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(DatasetError) as err:
        load_cifar10(str(tmp_path / "nowhere"), download=False)
    message = str(err.value)
    assert "nowhere" in message and "--data-dir" in message and "\n" not in message


def test_corrupt_cifar_is_reported(tmp_path):
    write_cifar(tmp_path)
    target = tmp_path / CIFAR_FOLDER / "data_batch_3"
    target.write_bytes(target.read_bytes()[:100])  # truncated
    with pytest.raises(DatasetError, match="data_batch_3 is corrupt"):
        load_cifar10(str(tmp_path), download=False)


def test_cli_reports_missing_dataset_in_one_line(tmp_path):
    from click.testing import CliRunner

    from peer.cli import main

    result = CliRunner().invoke(
        main,
        [
            "join",
            "--config",
            "demo",
            "--dataset",
            "cifar10",
            "--data-dir",
            str(tmp_path / "empty"),
            "--no-download",
            "--log-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 1
    assert "CIFAR-10 not found" in result.output and "Traceback" not in result.output


def test_digits_set_is_embedded_and_split():
    cfg = build_config("demo", environ={})
    train, val = build_datasets(cfg.data, cfg.model.img_size)
    assert len(train) + len(val) == 1797 and len(val) == 359
    image, label = train[0]
    assert image.shape == (3, 32, 32) and 0 <= label <= 9


def test_each_peer_shuffles_with_its_own_seed():
    cfg = build_config("demo", environ={})
    train, _ = build_datasets(cfg.data, cfg.model.img_size)

    def first(seed):
        return next(iter(train_loader(train, cfg.data, seed)))[1].tolist()

    assert first(1) == first(1)
    assert first(1) != first(2)


def test_model_init_is_shared_through_the_seed():
    cfg = build_config("demo", environ={}).model
    a, b = create_model(cfg), create_model(cfg)
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)
    other = create_model(ModelConfig(**{**cfg.__dict__, "init_seed": 1}))
    assert not torch.equal(next(iter(a.parameters())), next(iter(other.parameters())))
    out = a(torch.zeros(2, 3, 32, 32))
    assert out.shape == (2, 10)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ModelError, match="no model named"):
        create_model(ModelConfig(model_name="vit_does_not_exist"))


def test_flagship_model_has_vit_b32_shape():
    model = create_model(ModelConfig())
    assert 87e6 < sum(p.numel() for p in model.parameters()) < 89e6


def test_lr_schedule_warms_up_then_decays():
    f = lr_lambda(warmup_epochs=4, schedule_epochs=10)
    values = [f(s) for s in range(20)]
    assert values[0] < values[3] < values[4] == pytest.approx(1.0)
    assert values[14] == pytest.approx(0.05) and values[19] == pytest.approx(0.05)
    assert all(a >= b for a, b in zip(values[4:], values[5:], strict=False))


def test_adamw_takes_the_fused_kernel_where_every_parameter_allows_it():
    """DiLoCo steps after every batch: fused AdamW (0.39 ms against 1.09 ms for the demo model on one thread)
    where parameters are floating point on the CPU or CUDA, torch's default otherwise; the same update."""
    from swarm.training.model import SwarmClassifier, optimizer_kernel

    cfg = build_config("demo", environ={})
    module = SwarmClassifier(cfg.model, cfg.train)
    assert module.configure_optimizers()["optimizer"].defaults["fused"] is True
    assert optimizer_kernel([torch.zeros(2, device="meta")]) == {}
    assert optimizer_kernel([torch.zeros(2, dtype=torch.int64)]) == {}
    torch.manual_seed(0)
    start, grads = torch.randn(50), [torch.randn(50) for _ in range(3)]
    ends = []
    for kernel in ({"fused": True}, {}):
        p = torch.nn.Parameter(start.clone())
        opt = torch.optim.AdamW([p], lr=1e-2, **kernel)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        ends.append(p.detach())
    torch.testing.assert_close(ends[0], ends[1], rtol=1e-5, atol=1e-6)


def test_metrics_record_schema_rejects_wrong_types():
    from pydantic.v1 import ValidationError

    from swarm.net.metrics import LocalMetrics

    good = dict(
        peer_name="p",
        global_epoch=3,
        samples_per_second=10.0,
        loss=2.3,
        samples_accumulated=64,
        mini_steps=2,
        time=1.0,
    )
    assert LocalMetrics.parse_obj(good).global_epoch == 3
    for bad in ({"global_epoch": "3"}, {"loss": "high"}, {"samples_per_second": -1.0}, {"val_acc": 1.5}):
        with pytest.raises(ValidationError):
            LocalMetrics.parse_obj({**good, **bad})


def test_a_loader_epoch_can_hold_several_passes_over_a_small_set():
    """Cluster mode at a target batch larger than the data set (the scaling bench: 2048 of 1438 digits)."""
    from torch.utils.data import TensorDataset

    from swarm.training.data import shard_loaders

    train = TensorDataset(torch.arange(50).float(), torch.arange(50))
    cfg = DataConfig(num_workers=0)
    seen = []
    for rank in range(2):
        loader, _ = shard_loaders(train, train, cfg, batch_size=5, rank=rank, world=2, seed=0, passes=3)
        seen += [int(i) for _, labels in loader for i in labels]
    assert len(seen) == 150 and sorted(seen) == sorted(list(range(50)) * 3)  # every item 3 times, no more


SMALL = dict(
    model_name="vit_tiny_patch16_224", img_size=32, patch_size=16, embed_dim=64, depth=1, num_heads=4
)


def _saved_weights(path, seed: int, num_classes: int = 1000):
    """A small timm ViT with its own random weights, saved as a file; returns its state dict."""
    import timm

    torch.manual_seed(seed)
    kwargs = {k: v for k, v in SMALL.items() if k != "model_name"}
    net = timm.create_model(SMALL["model_name"], num_classes=num_classes, **kwargs)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        torch.save(state, path)
    return state


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_pretrained_file_gives_its_weights_and_a_head_seeded_by_init_seed(tmp_path, suffix):
    path = tmp_path / f"weights{suffix}"
    saved = _saved_weights(path, seed=7)
    cfg = ModelConfig(**SMALL, num_classes=10, pretrained_file=str(path))
    a, b = create_model(cfg), create_model(cfg)
    random = create_model(ModelConfig(**SMALL, num_classes=10))
    for name, tensor in a.state_dict().items():
        if name.startswith("head."):  # replaced for 10 classes: the same on every peer, by init_seed
            assert tensor.shape[0] == 10 and torch.equal(tensor, b.state_dict()[name])
            assert torch.equal(tensor, random.state_dict()[name])
        else:
            assert torch.equal(tensor, saved[name]), name
    other_seed = create_model(ModelConfig(**SMALL, num_classes=10, pretrained_file=str(path), init_seed=3))
    assert not torch.equal(other_seed.head.weight, a.head.weight)
    assert torch.equal(other_seed.blocks[0].attn.qkv.weight, saved["blocks.0.attn.qkv.weight"])
    # the checkpoint's own classes: its head too
    full = create_model(ModelConfig(**SMALL, num_classes=1000, pretrained_file=str(path)))
    assert all(torch.equal(t, saved[n]) for n, t in full.state_dict().items())
    # the monitor and `evaluate` need the architecture only: no weights loaded
    assert torch.equal(create_model(cfg, weights=False).pos_embed, random.pos_embed)


def test_starting_weights_are_part_of_the_config_fingerprint(tmp_path):
    from swarm.net.fingerprint import differences, shared_settings

    first, second = tmp_path / "a.pth", tmp_path / "b.pth"
    _saved_weights(first, seed=1)
    _saved_weights(second, seed=2)
    base = build_config("demo", {**SMALL, "num_classes": 10}, environ={})
    with_file = [
        shared_settings(build_config("demo", {**SMALL, "pretrained_file": str(p)}, environ={}))
        for p in (first, first, second)
    ]
    assert with_file[0] == with_file[1] and with_file[0]["model.weights"].startswith("pretrained sha256:")
    assert differences(with_file[0], with_file[2]) == [
        f"model.weights: swarm {with_file[2]['model.weights']}, here {with_file[0]['model.weights']}"
    ]
    assert "model.weights" not in shared_settings(base)  # random weights: as peers before this field
    assert "model.weights" in differences(with_file[0], shared_settings(base))[0]


@pytest.mark.parametrize(
    "problem, message",
    [
        ("missing", "does not exist"),
        ("damaged", "could not read"),
        ("another width", "does not hold"),
        ("other keys", "does not hold"),
    ],
)
def test_a_bad_pretrained_file_is_one_clear_line(tmp_path, problem, message):
    """timm's own loader takes a file of another model with a warning (strict=False once the head is left
    out) and the run would train from random weights: here each is one line, before any training."""
    path = tmp_path / "weights.safetensors"
    cfg = ModelConfig(**SMALL, pretrained_file=str(path))
    if problem == "damaged":
        _saved_weights(path, seed=0)
        path.write_bytes(path.read_bytes()[:1000])
    elif problem == "another width":
        _saved_weights(path, seed=0)
        cfg = ModelConfig(**{**SMALL, "embed_dim": 128}, pretrained_file=str(path))
    elif problem == "other keys":
        from safetensors.torch import save_file

        save_file({"x": torch.ones(2)}, str(path))
    with pytest.raises(ModelError, match=message) as err:
        create_model(cfg)
    assert "\n" not in str(err.value) and "--no-pretrained" in str(err.value)
