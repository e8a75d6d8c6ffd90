"""`swarm-peer monitor`: the one place where a person watches the run and where the trained model is kept.

Every ``poll_every`` seconds it reads the peers' signed metrics records and writes one TensorBoard point
per global epoch to ``runs/<run_id>/monitor``. Every ``evaluate_every`` global epochs it downloads the
swarm's parameters, evaluates them on the full validation split (``monitor/val/*``) and keeps
``last.ckpt`` and ``best.ckpt``. It never trains. Without --initial-peers it starts the swarm and prints
the join line, which is how a public machine (AWS) usually bootstraps a run.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from monitor.aggregate import EpochAggregator, EpochPoint
from monitor.board import Board
from monitor.state import CheckpointKeeper, SwarmModel
from swarm import patches
from swarm.config import ExperimentConfig, save_config
from swarm.log import quiet_libraries
from swarm.net import metrics
from swarm.net.fence import invite_name
from swarm.net.fingerprint import MONITOR_FIELDS, check_against_swarm, join_line_for
from swarm.net.invite import Invite
from swarm.net.node import DHTProcessDied, check_addresses, start_node, visible_maddrs
from swarm.procs import GracefulStop, own_children, remove_stale_sockets, stop_strays
from swarm.training.checkpoint import CheckpointError
from swarm.training.data import build_datasets, val_loader
from swarm.training.model import autocast_dtype, evaluate, resolve_device

log = logging.getLogger(__name__)
RETRY_AFTER_S = 15.0


class Presence:
    """This monitor's record in the DHT (swarm/net/metrics.py, ``MonitorRecord``): stored at once when the
    global epoch whose state it holds or the epoch to which it read every peer's metrics changes, else
    renewed every ``RENEW_S``; it expires ``EXPIRE_S`` after the monitor stops. Peers that reached max_epochs
    read it to know how long to share their final state."""

    RENEW_S, EXPIRE_S = 10.0, 30.0

    def __init__(self, dht: Any, run_id: str, public_key: bytes) -> None:
        self.dht, self.run_id, self.public_key = dht, run_id, public_key
        self.epochs: tuple[int, int] | None = None
        self.renew_at = 0.0

    def maybe_publish(self, saved_epoch: int, filed_epoch: int) -> None:
        if (saved_epoch, filed_epoch) == self.epochs and time.time() < self.renew_at:
            return
        self.epochs, self.renew_at = (saved_epoch, filed_epoch), time.time() + self.RENEW_S
        metrics.publish_monitor(
            self.dht, self.run_id, self.public_key, saved_epoch, filed_epoch, self.EXPIRE_S
        )


class Evaluator:
    """Runs download + evaluation + checkpointing in a background thread, one at a time, so that polling
    the DHT (and writing TensorBoard) goes on while a large model is evaluated."""

    def __init__(
        self, cfg: ExperimentConfig, model: SwarmModel, board: Board, keeper: CheckpointKeeper, loader: Any
    ) -> None:
        self.cfg, self.model, self.board, self.keeper, self.loader = cfg, model, board, keeper, loader
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.done = 0
        self.retry_after = 0.0
        self.finals: set[int] = set()  # final epochs that peers announced and that were evaluated for them

    def due(self, swarm_epoch: int, final_epochs: set[int] = frozenset()) -> bool:
        """At every ``evaluate_every``-th global epoch, and at once for a final epoch not evaluated yet (a
        peer at max_epochs says so in its record, and shares its state until the monitor holds it)."""
        every = self.cfg.monitor.evaluate_every
        next_epoch = (max(self.board.last_eval_step, 0) // every + 1) * every
        busy = self.thread is not None and self.thread.is_alive()
        # once per final epoch: a record that claims a final epoch the swarm never reaches must not make the
        # monitor download the state at every poll
        final = {e for e in final_epochs if e > self.board.last_eval_step} - self.finals
        if busy or not (swarm_epoch >= next_epoch or final) or time.time() < self.retry_after:
            return False
        self.finals |= final
        return True

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="monitor-eval", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.evaluate_once()
        except CheckpointError as exc:
            log.error("Could not save a checkpoint: %s", exc)
        except Exception:
            log.exception("Evaluation failed; the monitor keeps logging and tries again later")

    def evaluate_once(self) -> dict[str, Any] | None:
        started = time.perf_counter()
        epoch = self.model.refresh()
        if epoch is None:
            self.retry_after = time.time() + RETRY_AFTER_S  # every peer may have left: do not hammer them
            log.info("No peer sent the swarm's state; trying again in %.0f s", RETRY_AFTER_S)
            return None
        if epoch <= self.board.last_eval_step:
            log.info("The swarm's state is still at global epoch %d; evaluated already", epoch)
            return None
        net = self.model.module
        device = next(net.parameters()).device
        result = evaluate(net, self.loader, device, autocast_dtype(self.cfg.train.precision))
        with self.lock:
            self.board.write_eval(epoch, result)
            improved = self.keeper.save(net.net, self.model.adamw, epoch, result)
        self.done += 1
        log.info(
            "Swarm model at global epoch %d: val acc %.4f, top-5 %.4f, loss %.4f on %d images (%.1f s)%s",
            epoch,
            result["acc"],
            result["acc_top5"],
            result["loss"],
            result["samples"],
            time.perf_counter() - started,
            " | new best"
            if improved
            else f" | best stays {self.keeper.best_acc:.4f}@{self.keeper.best_epoch}",
        )
        return {"epoch": epoch, **result}

    def wait(self, timeout: float) -> None:
        if self.thread is not None:
            self.thread.join(timeout)


def _log_point(point: EpochPoint) -> None:
    val = f" | val acc {point.val_acc:.4f} ({point.val_samples} images)" if point.val_acc is not None else ""
    loss = f"{point.loss:.4f}" if point.loss is not None else "n/a"
    rejected = f" | {point.rejected} peers rejected the round" if point.rejected else ""
    data = f" | data epoch {point.data_epoch:.2f}" if point.data_epoch is not None else ""
    gpus = ", ".join(f"{peer} {mem:.1f} GB {util:.0f}%" for peer, (mem, util) in sorted(point.gpus.items()))
    rejected += f" | GPUs: {gpus}" if gpus else ""
    log.info(
        "global epoch %d | peers %d%s | %.1f samples/s | loss %s%s%s",
        point.epoch,
        point.peers,
        data,
        point.samples_per_second,
        loss,
        val,
        rejected,
    )


def _name_suspects(
    cfg: ExperimentConfig, dht: Any, point: EpochPoint, named: set, invite: Invite | None
) -> None:
    """One warning per groupmate that peers ban (swarm/suspects.py), with what the owner can do."""
    for peer, banning in sorted(point.suspects.items()):
        if ("suspect", peer) in named:
            continue
        named.add(("suspect", peer))
        if invite is None:
            advice = (
                "this swarm is open to anyone who has its address: run an invite-only swarm (README, "
                '"Invite-only swarms") to keep such a peer out for good'
            )
        else:
            name = invite_name(dht, invite, peer) or "<its invite's name>"
            address = (visible_maddrs(dht) or ["<any peer's address>"])[0]
            advice = (
                f"it joined with invite {name!r}; the owner revokes it with: swarm-peer revoke --owner-key "
                f"owner.pem --run-id {cfg.swarm.run_id} --name {name} --initial-peers {address}"
            )
        log.warning(
            "Peer %s is banned by %d of %d peers at global epoch %d: its gradients or parameters were far "
            "from, against or unrelated to its groupmates' round after round (a peer that sends wrong "
            "numbers); %s",
            peer,
            banning,
            point.peers,
            point.epoch,
            advice,
        )


def _poll(
    cfg: ExperimentConfig,
    dht: Any,
    aggregator: EpochAggregator,
    board: Board,
    evaluator: Evaluator,
    warned: set,
    final: bool = False,
    invite: Invite | None = None,
) -> None:
    """One poll: read the records, write finished epochs, start an evaluation when one is due.
    The ``final`` poll, when the monitor stops, only files the records; the caller writes what is complete."""
    try:
        timeout = 2.0 if final else max(5.0, cfg.monitor.poll_every)
        records = metrics.fetch(dht, cfg.swarm.run_id, warned, timeout=timeout)
    except Exception as exc:  # a slow DHT read is not fatal: try again at the next poll
        level = logging.DEBUG if final else logging.WARNING  # at exit, the peers may be gone already
        log.log(level, "Could not read the metrics records: %s", str(exc) or type(exc).__name__)
        return
    aggregator.add(records, time.time())
    if final:
        return
    last = {r.global_epoch for r in records.values() if r.final}  # peers at max_epochs
    for point in aggregator.ready(time.time()):
        with evaluator.lock:
            written = board.write_point(point)
        if written:
            _log_point(point)
            _name_suspects(cfg, dht, point, warned, invite)
    if aggregator.newest_epoch >= 0 and evaluator.due(aggregator.newest_epoch, last):
        evaluator.start()


def _prepare(cfg: ExperimentConfig) -> tuple[Invite | None, str, CheckpointKeeper, Any, Board]:
    """Everything that can fail on the user's input, before joining the swarm: addresses and the invite,
    device, checkpoint location, validation data (the whole split) and the TensorBoard run."""
    quiet_libraries()
    patches.check_version()  # another hivemind release: one line, before any slow work
    invite = check_addresses(cfg.swarm)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.train.device)
    keeper = CheckpointKeeper(cfg)  # a missing bucket or an unwritable folder fails here, in one line
    full_val = dataclasses.replace(cfg.data, limit_val_samples=None, limit_train_samples=1)
    _, val_set = build_datasets(full_val, cfg.model.img_size)
    out_dir = Path(cfg.train.log_dir) / cfg.swarm.run_id / "monitor"
    save_config(cfg, out_dir / "config.yaml")
    return invite, device, keeper, val_set, Board(out_dir)


def run_monitor(cfg: ExperimentConfig, config_name: str | None = None) -> dict[str, Any]:
    """Watch the swarm of ``cfg.swarm.run_id`` until SIGINT/SIGTERM; returns a summary of what was written."""
    started = time.time()
    invite, device, keeper, val_set, board = _prepare(cfg)
    out_dir = board.logdir
    aggregator = EpochAggregator(cfg.monitor.settle_time, after_epoch=board.last_step)
    stop, node, model, evaluator = GracefulStop(), None, None, None
    warned: set = set()
    children = own_children()
    stop.install()
    died: list[str] = []  # why the DHT process exited under the monitor (SwarmNode.watch)
    try:
        validators, public_key = metrics.make_validators(cfg.swarm.run_id)
        node = start_node(cfg.swarm, validators, invite=invite, check_reach=True)
        died = node.watch(stop)
        check_against_swarm(node.dht, cfg, only=MONITOR_FIELDS)  # its evaluation needs the swarm's model
        node.fence_averagers(public_key)  # invite-only: its state downloads need a member record
        print(
            f"Monitor of run {cfg.swarm.run_id!r} is up. To join this swarm, run:\n"
            f"  {join_line_for(node, cfg, config_name)}",
            flush=True,
        )
        board.write_hparams(cfg)
        model = SwarmModel(cfg, node.dht, device)
        evaluator = Evaluator(cfg, model, board, keeper, val_loader(val_set, cfg.data))
        log.info(
            "Writing TensorBoard to %s and checkpoints to %s; evaluating %d images every %d global epochs",
            out_dir,
            cfg.checkpoint_dir,
            len(val_set),
            cfg.monitor.evaluate_every,
        )
        presence = Presence(node.dht, cfg.swarm.run_id, public_key)
        while not stop.event.is_set():
            _poll(cfg, node.dht, aggregator, board, evaluator, warned, invite=invite)
            presence.maybe_publish(board.last_eval_step, aggregator.filed_epoch)
            stop.event.wait(cfg.monitor.poll_every)
    except KeyboardInterrupt:
        if not stop.event.is_set():
            raise
    finally:
        stop.disarm()
        if evaluator is not None:
            evaluator.wait(timeout=60)  # let a checkpoint that is being written finish
        if node is not None and evaluator is not None:
            _poll(
                cfg, node.dht, aggregator, board, evaluator, warned, final=True
            )  # records that came meanwhile
        for point in aggregator.ready(time.time(), closing=True):
            if board.write_point(point):
                _log_point(point)
        board.close()
        stop.restore()
        if model is not None and not died:
            model.shutdown()
        if died:  # hivemind's goodbye would wait on the dead DHT, and an averager whose start the death
            # interrupted (no model yet) has no other owner: stop every child process directly
            stop_strays(children)
        if node is not None:
            node.stop()
        stop_strays(children)
        remove_stale_sockets(since=started, exclude_own=True, settle=3.0)
    best = "n/a" if keeper.best_acc is None else f"{keeper.best_acc:.4f}"
    log.info("Monitor stopped at global epoch %d; best val acc %s", board.last_step, best)
    if died:
        raise DHTProcessDied(died[0])
    return {
        "last_step": board.last_step,
        "last_eval_step": board.last_eval_step,
        "evaluations": evaluator.done if evaluator else 0,
        "best_acc": keeper.best_acc,
        "best_epoch": keeper.best_epoch,
        "best_ckpt": keeper.url("best.ckpt"),
        "logdir": str(board.logdir),
    }
