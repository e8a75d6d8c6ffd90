"""`swarm-peer`: click commands only. Each parses flags, validates them into a config and hands it to a role.

Heavy imports (torch, hivemind, lightning) happen inside the commands, so `swarm-peer --help` is instant.
A mistake of the user's own (a bad flag, a missing data set, an unreachable peer) ends in one line that
says what to fix, never in a traceback.
"""

from __future__ import annotations

import faulthandler
import functools
import math
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from peer.bench import SCENARIOS as BENCH_SCENARIOS
from peer.options import (
    BatchSize,
    auto_batch,
    averaging_options,
    checkpoint_options_for,
    data_options,
    swarm_options,
    training_options,
)
from swarm.config import AVERAGING, DEVICES, PRECISIONS, STRATEGIES, ConfigError, build_config


def _fail_cleanly(func: Callable) -> Callable:
    """Turn our own error types into one-line click errors."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
        except click.ClickException:
            raise
        except KeyboardInterrupt:
            click.echo("Interrupted.", err=True)
            sys.exit(130)
        except Exception as exc:
            if type(exc).__name__ == "DHTProcessDied":  # the role has left; threads that still wait on the
                click.echo(f"Error: {exc}", err=True)  # dead process would hold up the interpreter's teardown
                _exit_quietly(1)
            known = (
                "DatasetError",
                "SwarmConnectionError",
                "ModelError",
                "MisconfigurationException",
                "CheckpointError",
                "ConfigMismatchError",
                "SwarmWedgedError",
                "InviteError",
                "HivemindVersionError",
            )
            if type(exc).__name__ in known or isinstance(
                exc, (ValueError, FileNotFoundError, PermissionError)
            ):
                raise click.ClickException(
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                ) from None
            raise

    return wrapper


def _exit_quietly(code: int = 0) -> None:
    """Leave without running interpreter teardown: everything is shut down and saved by now, and hivemind's
    futures would otherwise print 'Event loop is closed' noise while Python garbage-collects them."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    if "pytest" in sys.modules:
        # a command run in-process by a test (click's CliRunner): os._exit would end the whole test session
        # with this code, 0 included, and a truncated run would read as a pass (it did once)
        raise SystemExit(code)
    from swarm.procs import remove_own_temp_dir

    remove_own_temp_dir()
    os._exit(code)


checkpoint_options = checkpoint_options_for("<log-dir>/<run-id>/checkpoints")


def _config_from(params: dict[str, Any]):
    params = dict(params)
    config = params.pop("config", None)
    params.pop("verbose", None)
    for key in ("initial_peers", "host_maddrs", "announce_maddrs"):
        params[key] = tuple(params.get(key) or ()) or None
    if params.get("invite") and not params.get("run_id"):
        from swarm.net.invite import invite_run_id

        params["run_id"] = invite_run_id(params["invite"])  # the invite names the run
    return build_config(config, params)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """Train a vision transformer on volunteer machines with hivemind, or on a cluster with DDP/FSDP."""
    # `kill -USR1 <pid>` prints every thread's stack (also in forked averager processes) for a stuck peer
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, OSError, ValueError):  # no SIGUSR1 (Windows), or a stderr without a file
        pass


@main.command()
@swarm_options
@training_options("join")
@averaging_options
@click.option(
    "--resume-from",
    default=None,
    help="Checkpoint (path or s3:// URL) whose weights and global epoch seed the swarm; "
    "newer swarm state wins.",
)
@click.option("--s3-endpoint-url", default=None, help="S3-compatible endpoint for an s3:// --resume-from.")
@_fail_cleanly
def join(**params: Any) -> None:
    """Join a swarm (or start one) and train until the stop condition.

    Without --initial-peers this peer starts a new swarm and prints the line that others paste.
    """
    cfg = _config_from(auto_batch(params))
    from swarm.log import setup_logging

    setup_logging(params["verbose"])
    from peer.volunteer import run_volunteer  # heavy: torch, timm, lightning, hivemind

    summary = run_volunteer(cfg, config_name=params.get("config"))
    click.echo(done_line(summary))
    _exit_quietly()


def done_line(summary: dict[str, Any]) -> str:
    """A volunteer's last line: its global epoch, its last val acc, and that validation's epoch where it is
    an earlier one (a peer that leaves on a signal does not evaluate again; without the epoch, a peer that
    validated only as it started read as if it had trained to chance)."""
    val = summary.get("final_val") or {}
    acc = val.get("acc")  # none for a peer stopped as it started
    if acc is None or math.isnan(acc):
        shown = "n/a (not evaluated)"
    elif val.get("epoch") not in (None, summary["final_epoch"]):
        shown = f"{acc:.4f} (at global epoch {val['epoch']})"
    else:
        shown = f"{acc:.4f}"
    return (
        f"Done: global epoch {summary['final_epoch']}, val acc {shown}, "
        f"{summary.get('mean_samples_per_second') or 0:.1f} samples/s"
    )


@main.command()
@swarm_options
@_fail_cleanly
def bootstrap(**params: Any) -> None:
    """Run a DHT-only peer that others join through; it never trains. Stop it with Ctrl-C."""
    cfg = _config_from(params)
    from swarm.log import setup_logging

    setup_logging(params["verbose"])
    from peer.demo import run_bootstrap

    run_bootstrap(cfg, config_name=params.get("config"))
    _exit_quietly()


@main.command()
@swarm_options
@data_options("Validation data: cifar10 or digits (offline).")
@click.option("--model", "model_name", default=None, help="timm model name; must match the swarm's.")
@click.option(
    "--device", type=click.Choice(DEVICES), default=None, help="Where to evaluate: auto, cpu or cuda."
)
@click.option("--precision", type=click.Choice(PRECISIONS), default=None, help="Evaluation precision.")
@click.option("--threads", type=int, default=None, help="torch threads.")
@click.option(
    "--evaluate-every", type=int, default=None, help="Evaluate the swarm's model every N global epochs."
)
@click.option("--poll-every", type=float, default=None, help="Seconds between reads of the peers' metrics.")
@click.option(
    "--averaging",
    type=click.Choice(AVERAGING),
    default=None,
    help="The swarm's averaging (its state differs under diloco) [gradients].",
)
@checkpoint_options
@_fail_cleanly
def monitor(**params: Any) -> None:
    """Watch a swarm: metrics into TensorBoard, the swarm's model evaluated, best/last checkpoints kept.

    It never trains. Without --initial-peers it starts the swarm and prints the line that peers paste.
    Stop it with Ctrl-C; a restarted monitor appends to the same TensorBoard run.
    """
    cfg = _config_from(params)
    from swarm.log import setup_logging

    setup_logging(params["verbose"])
    from monitor.role import run_monitor  # heavy: torch, timm, hivemind, tensorboard

    summary = run_monitor(cfg, config_name=params.get("config"))
    click.echo(
        f"Monitor done: last global epoch {summary['last_step']}, best val acc "
        f"{format(summary['best_acc'], '.4f') if summary['best_acc'] is not None else 'n/a'}; "
        f"tensorboard --logdir {summary['logdir']}"
    )
    _exit_quietly()


@main.command()
@swarm_options
@click.option("--target-batch-size", type=int, default=None, help="Used only if the peers do not report it.")
@click.option(
    "--timeout", type=click.FloatRange(1.0), default=15.0, show_default=True, help="Seconds to wait."
)
@_fail_cleanly
def status(timeout: float, **params: Any) -> None:
    """Print a one-screen summary of a running swarm (peers, epoch, speed, progress, accuracy)."""
    cfg = _config_from({**params, "bootstrap_timeout": timeout})
    from swarm.log import setup_logging

    setup_logging(params["verbose"])
    from monitor.status import collect, render

    click.echo(render(collect(cfg, timeout=timeout)))
    _exit_quietly()


@main.command()
@click.argument("checkpoint")
@click.option("--config", default=None, help="Experiment of the checkpoint [the config saved in it].")
@click.option(
    "--split",
    type=click.Choice(["test", "train"]),
    default="test",
    help="test: the held-out images (CIFAR-10's test batch; the digits' held-out fifth).",
)
@click.option("--data-dir", default=None, help="Folder holding cifar-10-batches-py.")
@click.option("--download/--no-download", default=None, help="Download CIFAR-10 if missing.")
@click.option("--batch-size", type=click.IntRange(1), default=None, help="Images per forward pass.")
@click.option("--device", type=click.Choice(DEVICES), default=None, help="auto, cpu or cuda.")
@click.option("--threads", type=int, default=None, help="torch threads.")
@click.option("--log-dir", default=None, help="Root of runs/ [the checkpoint's].")
@click.option(
    "--out", default=None, help="Folder for the results [<log-dir>/<the checkpoint's run>/<split>]."
)
@click.option("--s3-endpoint-url", default=None, help="S3-compatible endpoint for an s3:// checkpoint.")
@click.option("--verbose", is_flag=True, help="Show library messages.")
@_fail_cleanly
def evaluate(checkpoint: str, split: str, out: str | None, verbose: bool, **params: Any) -> None:
    """Final metrics of a checkpoint: accuracy, loss, per-class accuracy and the confusion matrix.

    \b
    swarm-peer evaluate runs/vit-b32-cifar10/checkpoints/best.ckpt      (the monitor's best)
    swarm-peer evaluate runs/demo/ddp/checkpoints/best.ckpt --split test
    swarm-peer evaluate s3://bucket/prefix/best.ckpt --s3-endpoint-url http://127.0.0.1:9000
    """
    from swarm.log import setup_logging

    setup_logging(verbose)
    from peer.evaluate import describe, run_evaluate

    endpoint = params.pop("s3_endpoint_url")
    config = params.pop("config")
    result = run_evaluate(checkpoint, config, params, split=split, out=out, endpoint_url=endpoint)
    for line in describe(result):
        click.echo(line)


@main.command()
@click.option(
    "--config", "config", default=None, help="YAML experiment: a path, or demo, flagship, ddp, fsdp, ..."
)
@click.option("--strategy", type=click.Choice(STRATEGIES), default=None, help="How to distribute [ddp].")
@click.option(
    "--devices",
    type=click.IntRange(1),
    default=None,
    help="Devices per node [torchrun's, else all GPUs, else 1].",
)
@click.option("--num-nodes", type=click.IntRange(1), default=None, help="Machines in the run [1].")
@click.option(
    "--batch-size",
    type=BatchSize(),
    default=None,
    help="Per-device batch, or 'auto' for the largest that fits.",
)
@click.option("--max-batch-size", type=click.IntRange(1), default=None, help="Upper end of the auto search.")
@click.option(
    "--snapshot-every",
    type=click.IntRange(0),
    default=None,
    help="Snapshot the training state every N global epochs; torchrun restarts resume from it [0: off].",
)
@click.option(
    "--resume-from",
    "resume_snapshot",
    default=None,
    help="Resume from this snapshot (or a run folder with snapshots/).",
)
@training_options("local")
@click.option("--run-id", default=None, help="Runs land in <log-dir>/<run-id>/<strategy>.")
@click.option("--log-dir", default=None, help="Root of runs/<run_id>/... [runs].")
@checkpoint_options_for("<log-dir>/<run-id>/<strategy>/checkpoints")
@click.option("--verbose", is_flag=True, help="Show Lightning's and torch's own messages.")
@_fail_cleanly
def local(**params: Any) -> None:
    """Train the same model and data with standard distributed training (DDP, FSDP, ...) through Lightning.

    \b
    One machine:   swarm-peer local --strategy ddp --devices 2
    torchrun:      torchrun --nproc_per_node=2 -m peer local --strategy ddp
    CPU rehearsal: swarm-peer local --config ddp_cpu (gloo, 2 processes)
    """
    cfg = _config_from(auto_batch(params))
    from peer.cluster import dist_env, run_local  # heavy: torch, timm, lightning
    from swarm.log import setup_logging

    setup_logging(params["verbose"], quiet=dist_env().rank != 0)

    summary = run_local(cfg)
    if summary:
        best = summary["best_val_acc"]
        click.echo(
            f"Done: {summary['strategy']} x{summary['world_size']}, global epoch {summary['global_epochs']}, "
            f"best val acc {best if best is None else round(best, 4)}, "
            f"{summary['samples_per_second']:.1f} samples/s"
        )
    _exit_quietly()  # everything is written; interpreter teardown (threads, atexit) cannot hang a rank now


@main.command()
@click.argument("log_dir", type=click.Path(file_okay=False), default="runs")
@click.option("--out", default=None, help="Folder for report.md and report.png [LOG_DIR].")
@_fail_cleanly
def report(log_dir: str, out: str | None) -> None:
    """Write a Markdown table of every run under LOG_DIR (swarm and local) and a PNG of val/acc over time."""
    from swarm.log import setup_logging

    setup_logging()
    from monitor.report import write_report

    table, md, png = write_report(log_dir, out)
    click.echo(table)
    click.echo(f"\nWrote {md} and {png}")


@main.command()
@click.option(
    "--owner-key",
    required=True,
    type=click.Path(dir_okay=False),
    help="The run owner's private key (PEM), created if it does not exist. Keep it secret.",
)
@click.option("--run-id", required=True, help="The run the invite admits to.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Invite file to write.")
@click.option("--expires", default="7d", show_default=True, help="Lifetime: e.g. 7d, 12h, 30m, 90s.")
@click.option("--name", default=None, help="Whom the invite is for (shown in logs) [invite-<random>].")
@_fail_cleanly
def invite(owner_key: str, run_id: str, out: str, expires: str, name: str | None) -> None:
    """Write an invite to an invite-only run, signed with the owner's key (created on first use).

    Send the invite file to a volunteer like a password: anyone who holds it may join until it expires.
    """
    import secrets

    from swarm.config import SwarmConfig
    from swarm.net.invite import describe, load_or_create_owner_key, make_invite, parse_duration

    SwarmConfig(run_id=run_id)  # the same rules as --run-id everywhere else
    name = name or f"invite-{secrets.token_hex(3)}"
    if len(name) > 64 or not name.isprintable():
        raise click.BadParameter("at most 64 printable characters", param_hint="--name")
    key, created = load_or_create_owner_key(owner_key)
    if created:
        click.echo(
            f"Created the owner key {owner_key} (keep it secret; every invite of the run is signed with it)"
        )
    made = make_invite(key, run_id, name, parse_duration(expires))
    made.save(out)
    click.echo(f"Wrote {out}: {describe(made)}")
    click.echo(f"The volunteer runs: swarm-peer join --invite {out} --initial-peers <the swarm's address>")


@main.command()
@click.option(
    "--owner-key", required=True, type=click.Path(dir_okay=False), help="The run owner's private key (PEM)."
)
@click.option("--run-id", required=True, help="The run whose invites to revoke.")
@click.option(
    "--name", "names", multiple=True, required=True, help="Name of an invite to revoke (repeatable)."
)
@click.option("--initial-peers", multiple=True, required=True, help="Multiaddr of a running peer of the run.")
@click.option("--verbose", is_flag=True, help="Show hivemind's internal events.")
@_fail_cleanly
def revoke(
    owner_key: str, run_id: str, names: tuple[str, ...], initial_peers: tuple[str, ...], verbose: bool
) -> None:
    """Revoke invites by name: the owner signs the list and stores it in the run's DHT, and every peer then
    refuses their holders (within about 10 s). Needs a running peer of the run."""
    from swarm.net.invite import InviteError, load_or_create_owner_key, make_invite

    if not Path(owner_key).is_file():
        raise InviteError(
            f"owner key {owner_key} does not exist; revoking needs the key that signed the invites"
        )
    cfg = _config_from({"run_id": run_id, "initial_peers": initial_peers, "client_mode": True})
    from swarm.log import setup_logging

    setup_logging(verbose)
    from swarm.net import authorizer, metrics
    from swarm.net.node import start_node

    key, _ = load_or_create_owner_key(owner_key)
    validators, public_key = metrics.make_validators(run_id)
    with start_node(cfg.swarm, validators, invite=make_invite(key, run_id, "owner", 600.0)) as node:
        every = authorizer.revoke(node.dht, key, run_id, list(names), public_key)
    click.echo(
        f"Revoked {', '.join(repr(n) for n in names)} in run {run_id!r}; peers refuse them within about "
        f"10 s. Revoked so far: {', '.join(every)}"
    )
    _exit_quietly()


@main.command()
@click.option("--peers", type=click.IntRange(1, 16), default=3, show_default=True, help="Training peers.")
@click.option("--config", "config", default="demo", show_default=True, help="Experiment for every peer.")
@click.option("--max-epochs", type=click.IntRange(1), default=None, help="Global epochs [config's].")
@click.option("--run-id", default=None, help="Run name [demo-<time>].")
@click.option("--log-dir", default=None, help="Root of runs/ [runs].")
@click.option(
    "--invite",
    default=None,
    help="Invite every process uses [a new owner key and one invite per process under the run's folder].",
)
@click.option("--open", "open_swarm", is_flag=True, help="Run an open swarm (anyone may join) instead.")
@_fail_cleanly
def demo(
    peers: int,
    config: str,
    max_epochs: int | None,
    run_id: str | None,
    log_dir: str | None,
    invite: str | None,
    open_swarm: bool,
) -> None:
    """Start a monitor and N training peers on 127.0.0.1 and show them training together (invite-only)."""
    import time

    if invite and open_swarm:
        raise click.UsageError("--invite and --open exclude each other")
    if invite and not run_id:
        from swarm.net.invite import invite_run_id

        run_id = invite_run_id(invite)
    overrides = {
        "max_epochs": max_epochs,
        "run_id": run_id or f"demo-{time.strftime('%Y%m%d-%H%M%S')}",
        "log_dir": log_dir,
        "invite": invite,
    }
    cfg = build_config(config, overrides)
    from swarm.log import setup_logging

    setup_logging()
    from peer.demo import run_demo

    sys.exit(run_demo(cfg, config, peers, invite_only=not open_swarm))


if __name__ == "__main__":
    main()


@main.command()
@click.option(
    "--scenario",
    "scenarios",
    type=click.Choice(["all", *BENCH_SCENARIOS]),
    multiple=True,
    default=("all",),
    show_default=True,
    help="What to measure (repeat the option for several).",
)
@click.option("--out", default="runs/bench.jsonl", show_default=True, help="JSON lines are appended here.")
@click.option("--work-dir", default="runs/bench", show_default=True, help="Peers' logs and runs.")
@click.option(
    "--samples",
    type=click.IntRange(256),
    default=None,
    help="comm: samples per mode (DiLoCo: at least 2 outer steps) [default: 4096]; parity: samples per run "
    "[default: 16384].",
)
@click.option(
    "--local-steps", type=click.IntRange(1), default=50, show_default=True, help="scaling, comm: DiLoCo's H."
)
@click.option("--peers", type=click.IntRange(2), default=2, show_default=True, help="scaling: K workers.")
@click.option("--step-batch", type=click.IntRange(1), default=256, show_default=True, help="step: batch.")
@click.option("--seeds", type=click.IntRange(1), default=3, show_default=True, help="parity: seeds.")
@click.option(
    "--repeats",
    type=click.IntRange(1),
    default=3,
    show_default=True,
    help="scaling: run the whole comparison this many times; the table gives the medians.",
)
@click.option(
    "--wan-mbit",
    type=click.FloatRange(0.1, 10000),
    default=20.0,
    show_default=True,
    help="wan: each peer's link, Mbit/s each way.",
)
@click.option(
    "--volunteers",
    type=click.IntRange(2, 32),
    default=8,
    show_default=True,
    help="volunteers: peers in the lab.",
)
@click.option(
    "--quotas",
    default="0.1-0.3",
    show_default=True,
    callback=lambda ctx, param, value: _quota_range(value),
    help="volunteers: the slowest and the fastest peer's CPU budget, in cores (LO-HI).",
)
@click.option(
    "--link-mbit",
    type=click.FloatRange(0.05, 10000),
    default=2.0,
    show_default=True,
    help="volunteers: each peer's upload, Mbit/s (download: 4x).",
)
@click.option(
    "--attack",
    "attacks",
    multiple=True,
    help="attack: only the rows whose attacker column contains this text (repeat for several; "
    "'none' for the runs without an attacker, which run first in any case, as the rows' baselines) "
    "[default: every row].",
)
@click.option(
    "--peak-tflops", type=float, default=None, help="step: the GPU's dense bf16 peak, if not known."
)
@_fail_cleanly
def bench(
    scenarios: tuple[str, ...],
    out: str,
    work_dir: str,
    samples: int,
    local_steps: int,
    peers: int,
    step_batch: int,
    peak_tflops: float | None,
    seeds: int,
    wan_mbit: float,
    repeats: int,
    volunteers: int,
    quotas: tuple[float, float],
    link_mbit: float,
    attacks: tuple[str, ...],
) -> None:
    """Measure on 127.0.0.1: swarm vs DDP scaling, bytes and accuracy per compression mode, a newcomer's join
    time, swarm vs one process at equal batch, and the GPU training step.

    Prints a table and appends JSON lines to --out; see the README's "Performance" section.
    """
    from peer.bench import Options, run_bench

    chosen = list(BENCH_SCENARIOS) if "all" in scenarios else list(dict.fromkeys(scenarios))
    opts = Options(
        samples,
        local_steps,
        peers,
        step_batch,
        peak_tflops,
        seeds,
        wan_mbit,
        repeats,
        volunteers,
        quotas,
        link_mbit,
        attacks,
    )
    run_bench(chosen, Path(out), Path(work_dir), opts)


def _quota_range(value: str) -> tuple[float, float]:
    """``LO-HI`` (cores) as a pair, or a usage error that says what is expected."""
    try:
        lo, hi = (float(part) for part in value.split("-"))
    except ValueError:
        raise click.BadParameter(f"expected LO-HI in cores, for example 0.1-0.3, not {value!r}") from None
    if not 0 < lo <= hi <= 64:
        raise click.BadParameter(f"expected 0 < LO <= HI <= 64 cores, not {value!r}")
    return lo, hi


@main.command("bench-donor", hidden=True)
@click.option("--model", "model_name", required=True)
@click.option("--prefix", required=True)
def bench_donor(model_name: str, prefix: str) -> None:
    """The peer that serves its state in `bench --scenario join` (started by the bench itself)."""
    from peer.bench.join import serve_state

    serve_state(model_name, prefix)
