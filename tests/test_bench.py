"""`swarm-peer bench` pieces that can be checked without a GPU: the FLOP count behind the step scenario's MFU,
the peak table, and the step scenario's clean skip on a machine without CUDA."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from peer.bench.step import measure_step, peak_flops
from peer.cli import main


def _vit_b32_macs(
    tokens: int = 50, dim: int = 768, depth: int = 12, mlp: int = 3072, classes: int = 10
) -> int:
    """Multiply-adds of one ViT-B/32 forward at 224x224 (``depth`` blocks), counted by hand."""
    patches = tokens - 1
    embed = patches * dim * 3 * 32 * 32
    block = tokens * dim * 3 * dim + 2 * tokens * tokens * dim + tokens * dim * dim + 2 * tokens * dim * mlp
    return embed + depth * block + dim * classes


def test_step_flops_match_a_count_by_hand():
    r = measure_step("vit_base_patch32_224", batch=1, steps=1, warmup=0, device="cpu", depth=2)
    # backward costs twice the forward, except the patch embedding's input gradient (images need none)
    expected = 3 * 2 * _vit_b32_macs(depth=2) - 2 * 49 * 768 * 3 * 32 * 32
    assert r["flops_per_sample"] == pytest.approx(expected, rel=0.01), (r["flops_per_sample"], expected)
    assert r["samples_per_second"] > 0 and r["seconds"] > 0


def test_peaks_by_device_name():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("Some Other GPU") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_step_scenario_skips_cleanly_without_a_gpu(tmp_path):
    out = tmp_path / "bench.jsonl"
    result = CliRunner().invoke(
        main, ["bench", "--scenario", "step", "--out", str(out), "--work-dir", str(tmp_path / "w")]
    )
    assert result.exit_code == 0, result.output
    assert "step: skipped, no CUDA GPU here" in result.output
    assert not out.exists() or not [json.loads(line) for line in out.read_text().splitlines()]


def test_every_scenario_is_a_module_with_run_and_table():
    from peer.bench import SCENARIOS, scenario

    for name in SCENARIOS:
        module = scenario(name)
        assert callable(module.run) and module.summary_table([]) == "", name
    with pytest.raises(ValueError, match="unknown bench scenario"):
        scenario("nope")
    result = CliRunner().invoke(main, ["bench", "--scenario", "nope"])
    assert result.exit_code == 2 and "'nope' is not one of" in result.output
