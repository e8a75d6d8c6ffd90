"""`swarm-peer join`: train the shared LightningModule as one volunteer peer of a hivemind swarm.

This is the only place that builds a hivemind.Optimizer (through HivemindStrategy). The role receives
a resolved ExperimentConfig, starts the DHT, trains until the stop condition, and always shuts down
what it started, also on errors, Ctrl-C and SIGTERM (what a spot instance gets before reclaim).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from swarm import patches, suspects
from swarm.averaging import donors
from swarm.averaging.strategy import HivemindStrategy, lr_of
from swarm.config import ConfigError, ExperimentConfig, save_config
from swarm.layout import STARTING, volunteer_dir
from swarm.log import quiet_libraries
from swarm.net import metrics
from swarm.net.fingerprint import ConfigPublisher, check_against_swarm, join_line_for, wait_for_peers
from swarm.net.node import DHTProcessDied, check_addresses, start_node
from swarm.patches import robust, traffic
from swarm.procs import GracefulStop, own_children, remove_stale_sockets, stop_strays
from swarm.training.checkpoint import check_compatible, load_checkpoint, load_weights
from swarm.training.data import build_datasets, peer_seed, train_loader, val_loader
from swarm.training.model import (
    SwarmClassifier,
    autocast_dtype,
    cheap_cuda_checks,
    evaluate,
    param_checksum,
    resolve_device,
)
from swarm.training.sysmetrics import CpuMeter, GpuSampler
from swarm.training.tuning import largest_batch, step_fits

log = logging.getLogger(__name__)
READ_METRICS_EVERY = 1.0  # seconds between a peer's reads of the swarm's metrics records (progress line)


def linger_over(dht: Any, run_id: str, epoch: int, timeout: float) -> str | None:
    """Why a peer at its final global epoch ``epoch`` may stop sharing its state now, or None to keep sharing:
    a monitor holds ``epoch`` and has read every peer's metrics of it (swarm/net/metrics.py ``MonitorRecord``;
    those records live mostly on the peers' DHT nodes and vanish as they leave), and every peer's record is
    at it; with no monitor there, every peer's record is at it and says ``final`` (each ended its training,
    its last round landed)."""
    try:
        held = metrics.fetch_monitors(dht, run_id, timeout=timeout)
        if held and not any(m.holds(epoch) for m in held):
            return None
        records = metrics.fetch(dht, run_id, timeout=timeout).values()
        if not all(r.global_epoch >= epoch for r in records):
            return None
        if held:
            return f"The monitor holds global epoch {epoch} and every peer is done; leaving now"
        if records and all(r.final for r in records):
            return f"Every peer ended at global epoch {epoch} and no monitor is there; leaving now"
        return None
    except Exception as exc:  # a slow DHT: keep sharing until the deadline
        log.debug("Could not read the monitor's or the peers' records: %r", exc)
        return None


class SwarmReporter(L.Callback):
    """Per global epoch: publish a signed metrics record, evaluate periodically, log progress, stop."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        strategy: HivemindStrategy,
        public_key: bytes,
        peer_name: str,
        val_data: torch.utils.data.DataLoader,
        stop: GracefulStop,
        train_images: int = 0,
        out_dir: Path | None = None,
    ) -> None:
        self.cfg, self.strategy, self.public_key, self.peer_name = cfg, strategy, public_key, peer_name
        self.val_data, self.stop, self.train_images = val_data, stop, train_images
        self.out_dir = out_dir  # where summary.json is kept up to date at every global epoch
        self.gpu: GpuSampler | None = None
        self.cpu: CpuMeter | None = None
        self.history: list[dict[str, Any]] = []
        self.checksums: dict[int, list[float]] = {}
        # the sketches of this peer's state at its last epochs, published for newcomers' download checks
        self.sketches: collections.deque = collections.deque(maxlen=donors.SKETCHES_KEPT)
        self.peer_id = strategy.node.dht.peer_id.to_base58()
        self.swarm_sps: float | None = None
        self.rounds_shown = 0  # the strategy's rounds already counted in a progress line
        self.clipped_published = 0  # robust.clipped_parts() at the last record
        self.bans_logged: set[tuple[str, int]] = set()  # (peer, ban number) already told
        self.last_val: dict[str, Any] | None = None
        self.start_checksum: list[float] | None = None
        self._warned: set = set()
        # the DHT read of the swarm's metrics records in flight, the epoch it started at, and when
        self._reading: tuple[Any, int, float] | None = None
        self.last_record: metrics.LocalMetrics | None = None  # this peer's newest metrics record
        self.publisher: ConfigPublisher | None = None
        invite = strategy.node.invite  # read and verified once, by check_addresses
        self.invite_expires = invite.certificate.expires if invite is not None else None
        self._reset_window()

    def _reset_window(self) -> None:
        """Start a new per-epoch window: losses and wall-clock samples/s (averaging waits included)."""
        self.losses: list[float] = []
        self.window_samples, self.window_start = 0, time.time()

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.stop.install()  # Lightning wraps SIGTERM for its own use; this role decides how to stop
        if self.cfg.swarm.min_peers > 1 and self.publisher is not None:
            try:
                self._wait_for_min_peers()
            except KeyboardInterrupt:  # the stop cut a DHT read short: the group's signal ended the daemon
                if not self.stop.event.is_set():
                    raise
            if self.stop.event.is_set():  # told to leave while waiting: nothing trained, nothing to validate
                log.info("%s before training; leaving the swarm", self.stop.reason)
                trainer.should_stop = True
                return
        self.started = time.time()
        self.gpu = GpuSampler(next(module.parameters()).device).start()  # NVML; nothing on a CPU
        self.cpu = CpuMeter().start()  # this trainer and its helper processes, while it trains
        self.epoch = self.strategy.local_epoch
        self.start_checksum = param_checksum(module)
        self.checksums[self.epoch] = self.start_checksum
        self._note_sketch(self.epoch)
        self.initial_val = self.run_validation(module, self.epoch)
        reason = self._stop_reason()
        if reason:  # e.g. the swarm's state it loaded is already at max_epochs: no step alone beyond it
            log.info("%s before training; leaving the swarm", reason)
            trainer.should_stop = True
        self.next_log = time.time() + self.cfg.train.log_every
        self.line_samples, self.line_start = 0, time.time()
        self._reset_window()

    def _wait_for_min_peers(self) -> None:
        """The optimizer and its averagers are up (Lightning set the strategy up): say so, and wait for
        ``--min-peers`` training peers, or until this peer is told to leave."""
        self.publisher.mark_ready()
        seen = wait_for_peers(self.publisher, self.cfg.swarm.min_peers, self.stop.event)
        if self.stop.event.is_set():
            return
        within = 10.0
        met = self.strategy.meet_peers(self.cfg.swarm.min_peers, self.stop.event, within)
        if met < self.cfg.swarm.min_peers and not self.stop.event.is_set():
            log.warning(
                "%d training peers of the run are ready, but only %d showed their progress within %.0f s; "
                "starting anyway",
                seen,
                met,
                within,
            )
        else:
            log.info("%d %s", seen, STARTING)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.stop.disarm()  # teardown follows: an interrupt must not cut it short
        if self.gpu is not None:
            self.gpu.stop()
        if self.cpu is not None:
            self.cpu.stop()  # before the linger: training only
        self.strategy.leaving = self.stop.event.is_set()
        if self.cfg.swarm.linger > 0 and not self.stop.event.is_set():
            self._linger(self.cfg.swarm.linger, self.strategy.local_epoch)

    def _linger(self, seconds: float, epoch: int) -> None:
        """Share the final state (the averagers serve it until teardown) for ``seconds``, or less, until
        :func:`linger_over` says every peer is done. A groupmate still in its last rounds needs this peer's
        averagers: a DiLoCo peer whose partner left at once ended its last overlapped round alone (val acc
        0.59 against the partner's 0.90)."""
        dht, run_id = self.strategy.node.dht, self.cfg.swarm.run_id
        deadline = time.time() + seconds
        if self.last_record is not None:  # tell a monitor: this is the last epoch, evaluate it now
            from hivemind.utils import get_dht_time

            final = self.last_record.copy(update={"final": True, "time": get_dht_time()})
            with contextlib.suppress(Exception):
                metrics.publish(dht, run_id, self.public_key, final, self.cfg.swarm.metrics_expiration)
        log.info(
            "Sharing the final state for up to %.0f s (linger), until the monitor holds it and the other "
            "peers are done",
            seconds,
        )
        while not self.stop.event.wait(min(1.0, max(0.0, deadline - time.time()))):
            reason = linger_over(dht, run_id, epoch, timeout=max(0.1, min(5.0, deadline - time.time())))
            if reason is not None:
                log.info(reason)
                return
            if time.time() >= deadline:
                return

    def on_exception(self, trainer: L.Trainer, module: L.LightningModule, exception: BaseException) -> None:
        self.stop.disarm()
        self.strategy.leaving = self.stop.event.is_set()

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.window_samples += len(batch[1])
        self.line_samples += len(batch[1])
        if module.last_loss is not None:
            self.losses.append(module.last_loss)
        if self.publisher is not None:
            self.publisher.maybe_publish()
        if self.strategy.local_epoch != self.epoch:
            self._on_new_epoch(module)
        if time.time() >= self.next_log:
            self.next_log = time.time() + self.cfg.train.log_every
            self._progress_line(module)
        reason = self._stop_reason()
        if reason and not trainer.should_stop:
            log.info("%s; leaving the swarm", reason)
            trainer.should_stop = True

    def _stop_reason(self) -> str | None:
        train = self.cfg.train
        if self.stop.event.is_set():
            return self.stop.reason
        if train.max_epochs is not None and self.strategy.local_epoch >= train.max_epochs:
            return f"Reached global epoch {self.strategy.local_epoch} (max_epochs)"
        if train.max_data_epochs is not None and self.data_epoch() >= train.max_data_epochs:
            return f"Reached data epoch {self.data_epoch():.2f} (max_data_epochs)"
        if train.max_time is not None and time.time() - self.started >= train.max_time:
            return f"Trained for {time.time() - self.started:.0f} s (max_time)"
        watcher = self.strategy.node.revocations
        if watcher is not None and watcher.self_revoked.is_set():
            return "The run's owner revoked this peer's invite, and the swarm refuses it"
        if self.invite_expires is not None and time.time() >= self.invite_expires:
            return (
                "This peer's invite expired at "
                f"{time.strftime('%H:%M:%S UTC', time.gmtime(self.invite_expires))} "
                "and the swarm no longer accepts it: ask the run's owner for a new one (swarm-peer invite)"
            )
        return None

    def data_epoch(self, epoch: int | None = None) -> float:
        """Passes over the training set so far: the swarm's optimizer steps took ``target_batch_size``
        samples each (at least: the step that reaches the target may overshoot it a little)."""
        epoch = self.strategy.local_epoch if epoch is None else epoch
        return epoch * self.cfg.swarm.target_batch_size / max(self.train_images, 1)

    def _on_new_epoch(self, module: L.LightningModule) -> None:
        epoch, self.epoch = self.strategy.local_epoch, self.strategy.local_epoch
        # DiLoCo: the anchor every peer of the round holds (the parameters themselves, unless the round
        # ran in the background: then they also hold this peer's inner steps taken meanwhile)
        d = self.strategy.diloco
        self.checksums[epoch] = param_checksum(d.anchors if d is not None else module)
        self._note_sketch(epoch)
        sps = self.window_samples / max(time.time() - self.window_start, 1e-6)
        loss = sum(self.losses) / len(self.losses) if self.losses else float("nan")
        entry: dict[str, Any] = {
            "epoch": epoch,
            "loss": loss,
            "samples_per_second": sps,
            "samples": self.window_samples,
            "data_epoch": round(self.data_epoch(epoch), 4),
            "mini_steps": len(self.losses),
            "time": time.time(),
            "bytes_sent": self.strategy.bytes_sent,  # cumulative, in averaging rounds
        }
        mem, util = self.gpu.latest() if self.gpu is not None else (None, None)
        if mem is not None:
            entry.update(gpu_mem_gb=round(mem, 3), gpu_util=util)
        clock = self.strategy.clock
        if clock is not None and clock.rounds and clock.rounds[-1]["epoch"] == epoch:
            entry["round"] = clock.rounds[-1]
        val: dict[str, Any] = {}
        if self.stop.event.is_set():  # leaving on a signal: no evaluation, no DHT traffic, just go
            self.history.append(entry)
            return
        if epoch % self.cfg.train.eval_every == 0 or self._stop_reason():
            val = self.run_validation(module, epoch)
            entry.update({f"val_{k}": v for k, v in val.items() if k != "epoch"})
        self.history.append(entry)
        banned = self._banned()
        self._note_bans(banned)
        self._publish(entry, val, banned)
        if self.out_dir is not None:  # a peer whose machine is taken away (a Colab session ends) leaves this
            write_summary(self.out_dir, self.summary())
        self._reset_window()

    def _note_sketch(self, epoch: int) -> None:
        sketch = self.strategy.state_sketch()
        if sketch is not None and all(math.isfinite(x) for x in sketch):
            self.sketches.append(metrics.StateSketch(epoch=epoch, sketch=sketch))

    def _banned(self) -> list[Any]:
        table = robust.suspects()
        return [s for s in table.suspects() if s.banned_for > 0] if table is not None else []

    def _note_bans(self, banned: list[Any]) -> None:
        """One warning for each ban this peer's averagers imposed since the last epoch."""
        for found in banned:
            if (found.peer, found.bans) not in self.bans_logged:
                self.bans_logged.add((found.peer, found.bans))
                log.warning(
                    "Banned peer %s from this peer's groups for %.0f s: %s",
                    found.peer,
                    found.banned_for,
                    suspects.why_banned(found),
                )

    def _clipped_since_last_record(self) -> int:
        clipped = robust.clipped_parts()
        new, self.clipped_published = clipped - self.clipped_published, clipped
        return max(0, new)

    def run_validation(self, module: L.LightningModule, epoch: int) -> dict[str, Any]:
        started = time.perf_counter()
        device = next(module.parameters()).device
        result = evaluate(module, self.val_data, device, autocast_dtype(self.cfg.train.precision))
        self.last_val = {"epoch": epoch, **result}
        log.info(
            "Validation at global epoch %d: loss %.4f, acc %.4f, top-5 %.4f on %d samples (%.1f s)",
            epoch,
            result["loss"],
            result["acc"],
            result["acc_top5"],
            result["samples"],
            time.perf_counter() - started,
        )
        return self.last_val

    def _publish(self, entry: dict[str, Any], val: dict[str, Any], banned: list[Any]) -> None:
        """Store this epoch's record. It carries the latest validation until the next one: a record lives
        only until the peer's next epoch, and a monitor that polls less often than epochs end would
        otherwise miss most validations."""
        from hivemind.utils import get_dht_time

        val = val or self.last_val or {}
        record = metrics.LocalMetrics(
            peer_name=self.peer_name[:64],
            global_epoch=entry["epoch"],
            samples_per_second=float(entry["samples_per_second"]),
            loss=float(entry["loss"]) if entry["mini_steps"] else 0.0,
            samples_accumulated=int(entry["samples"]),
            mini_steps=int(entry["mini_steps"]),
            time=get_dht_time(),
            val_epoch=val.get("epoch"),
            val_loss=val.get("loss"),
            val_acc=val.get("acc"),
            val_samples=int(val.get("samples", 0)),
            target_batch_size=self.cfg.swarm.target_batch_size,
            rejected_rounds=self.strategy.screen.rejected,
            round_clipped=self._clipped_since_last_record(),
            banned=[found.peer for found in banned][:16],
            data_epoch=float(entry["data_epoch"]) if self.train_images else None,
            gpu_mem_gb=entry.get("gpu_mem_gb"),
            gpu_util=entry.get("gpu_util"),
            peer_id=self.peer_id,
            state_sketches=list(self.sketches),
            **_round_fields(entry.get("round")),
        )
        # the swarm's records are read in the background: the answer to a read started at an earlier
        # epoch is used once it is there (waiting for it held up training by about 50 ms per epoch). They
        # feed the swarm's speed on the progress line and the bans other peers publish, so they are read at
        # most every READ_METRICS_EVERY seconds, not at every epoch (2 reads a second with the scaling
        # bench's 0.45 s epochs)
        self.last_record = record
        reading, records = self._reading, None
        try:
            metrics.publish(
                self.strategy.node.dht,
                self.cfg.swarm.run_id,
                self.public_key,
                record,
                self.cfg.swarm.metrics_expiration,
            )
            if reading is None or (reading[0].done() and time.time() - reading[2] >= READ_METRICS_EVERY):
                future = metrics.request(self.strategy.node.dht, self.cfg.swarm.run_id)
                self._reading = (future, int(entry["epoch"]), time.time())
                if reading is not None:
                    records = metrics.parse_fetched(reading[0].result(), self._warned)
        except Exception as exc:  # metrics are best effort; training goes on
            log.warning("Could not exchange metrics with the DHT: %s", exc)
            return
        if records is None:
            return
        fresh = [r for r in records.values() if r.global_epoch >= reading[1] - 2]
        self.swarm_sps = sum(r.samples_per_second for r in fresh) if fresh else None
        table = robust.suspects()
        if table is not None:  # other peers' bans: half the evidence then bans here (swarm/suspects.py)
            suspects.note_published_bans(table, fresh, self.peer_id)

    def _progress_line(self, module: L.LightningModule) -> None:
        from hivemind.utils import get_dht_time

        opt = self.strategy.hivemind_opt
        if opt is None:
            return
        progress = opt.tracker.global_progress
        eta = progress.eta_next_epoch - get_dht_time()
        eta_text = f"~{max(0.0, eta):.1f} s" if eta < 1e6 else "n/a"
        sps = self.line_samples / max(time.time() - self.line_start, 1e-6)
        self.line_samples, self.line_start = 0, time.time()
        rounds = self._rounds_since_last_line()
        swarm = f" (swarm {self.swarm_sps:.1f})" if self.swarm_sps is not None else ""
        recent = self.losses or [h["loss"] for h in self.history[-1:] if h["mini_steps"]]
        loss = f"{sum(recent) / len(recent):.4f}" if recent else "n/a"
        val = f" | val acc {self.last_val['acc']:.3f}@{self.last_val['epoch']}" if self.last_val else ""
        mem, util = self.gpu.latest() if self.gpu is not None else (None, None)
        if mem is not None:
            val += f" | gpu {mem:.1f} GB, {util:.0f}% busy"
        log.info(
            "epoch %d | peers %d | data epoch %.2f | %.1f samples/s%s | round %d/%d samples, next in %s%s"
            " | loss %s | lr %.2e%s",
            self.strategy.local_epoch,
            max(1, progress.num_peers),
            self.data_epoch(),
            sps,
            swarm,
            progress.samples_accumulated,
            progress.target_batch_size,
            eta_text,
            rounds,
            loss,
            lr_of(opt),
            val,
        )

    def _rounds_since_last_line(self) -> str:
        """The line's ", averaged 3/4": of the rounds this peer ended since its last line, how many used the
        group's average (the others stepped on this peer's own gradient: alone, or a failed or rejected
        round); "" when it ended none. "peers 2" with "averaged 0/6": a swarm that does not train together."""
        clock = self.strategy.clock
        if clock is None:
            return ""
        # an epoch reached by a download is no round that this peer trained apart
        new = [r for r in clock.rounds[self.rounds_shown :] if r["outcome"] != "downloaded"]
        self.rounds_shown = len(clock.rounds)
        if not new:
            return ""
        averaged = sum(r["outcome"] == "averaged" and "gradient" not in r["rejected"] for r in new)
        return f", averaged {averaged}/{len(new)}"

    def _diloco_summary(self) -> dict[str, Any]:
        d = self.strategy.diloco
        if d is None:
            return {}
        return {
            "outer_steps": d.outer_steps,
            "seconds_waiting_for_the_swarm": round(d.waited, 2),
            "outer_rounds_begun_on_formed_group": d.rounds_on_formed_group,
            "overlap_rounds": d.overlap,
            # overlap: the outer rounds' time in the background, while this peer took inner steps
            "seconds_of_rounds_in_background": round(d.flight_seconds, 2),
            "diloco_loaded": d.loaded,
        }

    def summary(self) -> dict[str, Any]:
        done = [h for h in self.history if h["mini_steps"]]
        table, check = robust.suspects(), self.strategy.donor_check
        return {
            "peer_name": self.peer_name,
            "run_id": self.cfg.swarm.run_id,
            "loaded_epoch": self.strategy.loaded_epoch,
            "start_checksum": self.start_checksum,
            "final_epoch": self.strategy.local_epoch,
            "data_epochs": round(self.data_epoch(), 4),
            "batch_size": self.cfg.data.batch_size,
            "checksums": {str(k): v for k, v in self.checksums.items()},
            "history": self.history,
            "first_loss": done[0]["loss"] if done else None,
            "last_loss": done[-1]["loss"] if done else None,
            "initial_val": getattr(self, "initial_val", None),
            "final_val": self.last_val,
            "mean_samples_per_second": (sum(h["samples_per_second"] for h in done) / len(done))
            if done
            else None,
            "swarm_samples_per_second": self.swarm_sps,
            # NVML (swarm/training/sysmetrics.py); None on a CPU, never 0
            "peak_allocated_gb": self.gpu.peak_allocated_gb() if self.gpu is not None else None,
            "mean_gpu_util": self.gpu.mean_util() if self.gpu is not None else None,
            # CPU seconds from the first step to the last (swarm/training/sysmetrics.py): this trainer
            # ("self"), its DHT process, p2p daemon and averagers ("helpers"), the wall time ("wall"); None
            # without /proc
            "cpu_seconds": self.cpu.result() if self.cpu is not None else None,
            "skipped_nonfinite_steps": self.strategy.skipped_nonfinite_steps,
            "nonfinite_rollbacks": self.strategy.nonfinite_rollbacks,
            "resyncs": self.strategy.resyncs,
            "astray_resyncs": self.strategy.astray_resyncs,
            "bytes_sent": self.strategy.bytes_sent,
            "bytes_sent_gradients": traffic.bytes_sent("gradients"),
            "bytes_sent_state": traffic.bytes_sent("state"),
            # where the time went: windows exclude validation; round ends are the steps that closed an epoch
            "train_seconds": sum(
                h["samples"] / h["samples_per_second"] for h in done if h["samples_per_second"]
            ),
            "round_end_seconds": self.strategy.round_end_seconds,
            "local_fallback_steps": self.strategy.local_fallback_steps,
            "silent_rounds": self.strategy.silent_rounds,
            "rejected_gradient_rounds": self.strategy.screen.rejected_gradient_rounds,
            "rejected_state_rounds": self.strategy.screen.rejected_state_rounds,
            "rejected_downloads": self.strategy.screen.rejected_downloads,
            # state rounds the screen judged by the loss of this peer's latest batch: how far each raised it
            "state_probe": _probe_summary(self.strategy.screen.probed),
            # gradient rounds judged by a step on them: the rise over a step on this peer's own gradient
            # (of the two batches, the one that saw the smaller rise)
            "step_probe": _probe_summary(self.strategy.screen.stepped),
            # downloads refused for their donor's numbers (swarm/averaging/donors.py), and those checked
            "refused_downloads": self.strategy.refused_downloads,
            "checked_downloads": check.checked if check is not None else 0,
            # parts of groupmates' slices this peer's robust mean scaled down (swarm/patches/robust.py)
            "clipped_parts": robust.clipped_parts(),
            # groupmates whose gradients this peer judged far from the rest (swarm/suspects.py)
            "suspects": [dataclasses.asdict(found) for found in table.suspects()]
            if table is not None
            else [],
            "round_ends": self.strategy.clock.summary() if self.strategy.clock else None,
            "rounds": self.strategy.clock.rounds if self.strategy.clock else [],
            **self._diloco_summary(),
            "seconds": time.time() - self.started if hasattr(self, "started") else 0.0,
            "started_at": getattr(self, "started", None),  # when training began (after --min-peers)
            "complete": False,  # True only in the summary written as the peer left
        }


def _probe_summary(probed: list[tuple[float, float]]) -> dict[str, Any]:
    """The state rounds the screen probed (pairs of losses: this peer's parameters, the averaged ones): how
    many, the median rise, and the largest rise with the loss it rose from."""
    rises = sorted(((after - before, before) for before, after in probed), key=lambda r: r[0])
    return {
        "count": len(rises),
        "median_rise": rises[len(rises) // 2][0] if rises else None,
        "largest_rise": rises[-1][0] if rises else None,
        "largest_rise_from": rises[-1][1] if rises else None,
    }


def write_summary(out_dir: Path, result: dict[str, Any]) -> Path:
    """``<out_dir>/summary.json``, replaced whole (a reader, or a kill in the middle, never sees half)."""
    path = out_dir / "summary.json"
    part = path.with_name(f".{path.name}.part")
    part.write_text(json.dumps(result, indent=1))
    os.replace(part, path)
    return path


def _round_fields(record: dict[str, Any] | None) -> dict[str, Any]:
    """The metrics record's round_* fields from one swarm/averaging/rounds.py record (none without one)."""
    if record is None:
        return {}
    fields = {f"round_{part}": float(record[part]) for part in metrics.ROUND_PARTS}
    return {
        **fields,
        "round_local": record["outcome"] == "local",
        "round_rejected": bool(record.get("rejected")),
    }


def _load_resume(cfg: ExperimentConfig, module: SwarmClassifier) -> dict[str, Any]:
    """Load ``--resume-from`` into ``module`` (weights); returns the checkpoint ({} without one)."""
    url = cfg.checkpoint.resume_from
    if not url:
        return {}
    payload = load_checkpoint(url, cfg.checkpoint.s3_endpoint_url)
    check_compatible(payload, cfg.model, url)
    load_weights(module.net, payload, url)
    log.info(
        "Loaded %s: global epoch %d, val acc %s",
        url,
        payload["global_epoch"],
        payload.get("metrics", {}).get("val/acc", "n/a"),
    )
    return payload


def _fault_injector(cfg: ExperimentConfig) -> Any:
    """The test-only FaultInjector when ``train.inject_fault`` is set, else None."""
    if not cfg.train.inject_fault:
        return None
    from swarm.faults import FaultInjector, parse_faults

    log.warning("Fault injection is on (tests only): %s", cfg.train.inject_fault)
    return FaultInjector(parse_faults(cfg.train.inject_fault))


def default_peer_name() -> str:
    return f"{socket.gethostname()[:32]}-{os.getpid()}"


def _fit(
    cfg: ExperimentConfig,
    strategy: HivemindStrategy,
    reporter: SwarmReporter,
    module: SwarmClassifier,
    loader: torch.utils.data.DataLoader,
) -> None:
    """Run Lightning's fit loop under the hivemind strategy; a requested stop is not an error."""
    device = str(strategy.root_device)
    trainer = L.Trainer(
        accelerator="gpu" if device.startswith("cuda") else "cpu",
        strategy=strategy,
        precision=cfg.train.precision,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[reporter],
        use_distributed_sampler=False,
    )
    try:
        trainer.fit(module, train_dataloaders=loader)
    except SystemExit:  # Lightning exits after an interrupt it handled; fine if we asked to stop
        if not reporter.stop.event.is_set():
            raise
    if not reporter.stop.event.is_set() and (reporter.last_val or {}).get("epoch") != strategy.local_epoch:
        reporter.run_validation(module, strategy.local_epoch)


def _largest_batch(cfg: ExperimentConfig, module: SwarmClassifier, device: str) -> int:
    """``--batch-size auto``: the largest per-step batch whose training step fits this peer's GPU (the same
    search as local mode's), at most one target batch and ``--max-batch-size``. The search runs before the
    peer joins, so it never competes with training. On the CPU memory sets no limit worth finding, and a
    larger batch only makes a step longer: the configured batch stays."""
    if torch.device(device).type != "cuda":
        log.info(
            "--batch-size auto: no GPU memory to fill on the %s; the batch stays %d",
            device,
            cfg.data.batch_size,
        )
        return cfg.data.batch_size
    m = cfg.model
    fits = step_fits(
        module.net, m.num_classes, m.img_size, torch.device(device), autocast_dtype(cfg.train.precision)
    )
    found, _ = largest_batch(
        fits, cfg.data.batch_size, min(cfg.cluster.max_batch_size, cfg.swarm.target_batch_size)
    )
    if found < 1:
        raise ConfigError(f"not even a batch of 1 fits on {device}; use a smaller model")
    log.info("Largest batch per step on %s: %d (--batch-size auto)", device, found)
    return found


def run_volunteer(cfg: ExperimentConfig, config_name: str | None = None) -> dict[str, Any]:
    """Join (or start) the swarm of ``cfg.swarm.run_id`` and train until the stop condition.

    Returns the peer's summary (also written to runs/<run_id>/volunteer/<peer>/summary.json).
    SIGINT or SIGTERM make the peer leave after the current step (within a few seconds) and return normally.
    """
    started = time.time()
    quiet_libraries()
    patches.check_version()  # another hivemind release: one line, before any slow work
    invite = check_addresses(cfg.swarm)  # the invite, read and verified once, before any slow work
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    device = resolve_device(cfg.train.device)
    cheap_cuda_checks(device)
    peer_name = cfg.train.peer_name or default_peer_name()
    out_dir = volunteer_dir(cfg.train.log_dir, cfg.swarm.run_id, peer_name)
    save_config(cfg, out_dir / "config.yaml")

    seed = peer_seed(cfg.data)
    train_set, val_set = build_datasets(cfg.data, cfg.model.img_size)
    torch.manual_seed(seed)  # augmentation randomness differs per peer too
    module = SwarmClassifier(cfg.model, cfg.train)
    resume = _load_resume(cfg, module)
    if cfg.cluster.auto_batch_size:
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, batch_size=_largest_batch(cfg, module, device))
        )
        save_config(cfg, out_dir / "config.yaml")  # the batch it trains with
    log.info(
        "Peer %s: %s (%.2f M parameters), %d training images, shuffling seed %d, device %s",
        peer_name,
        cfg.model.model_name,
        sum(p.numel() for p in module.parameters()) / 1e6,
        len(train_set),
        seed,
        device,
    )

    stop, node, strategy, reporter = GracefulStop(), None, None, None
    children = own_children()
    stop.install()
    died: list[str] = []  # why the DHT process exited under this peer (SwarmNode.watch)
    try:
        validators, public_key = metrics.make_validators(cfg.swarm.run_id)
        node = start_node(cfg.swarm, validators, invite=invite, check_reach=True)
        died = node.watch(stop)
        check_against_swarm(node.dht, cfg)  # before any averager exists: a mismatch never touches the swarm
        node.fence_averagers(public_key)  # invite-only: our PeerID's proof, our averagers fenced
        publisher = ConfigPublisher(node.dht, cfg, public_key, peer_name)
        publisher.maybe_publish()
        strategy = HivemindStrategy.from_swarm_config(
            cfg.swarm,
            node=node,
            batch_size=cfg.data.batch_size,
            device=device,
            resume_epoch=resume.get("global_epoch"),
            resume_optimizer_state=resume.get("optimizer"),
            faults=_fault_injector(cfg),
            verbose=logging.getLogger().isEnabledFor(logging.DEBUG),  # --verbose: hivemind's own events too
        )
        reporter = SwarmReporter(
            cfg, strategy, public_key, peer_name, val_loader(val_set, cfg.data), stop, len(train_set), out_dir
        )
        reporter.publisher = publisher
        print(f"To join this swarm, run:\n  {join_line_for(node, cfg, config_name)}", flush=True)
        _fit(cfg, strategy, reporter, module, train_loader(train_set, cfg.data, seed))
    except KeyboardInterrupt:
        if not stop.event.is_set():
            raise
        log.info("Interrupted while %s; leaving now", "starting" if reporter is None else "averaging")
    finally:
        stop.restore()
        if strategy is not None:
            strategy.shutdown()  # stops the node too
        elif node is not None:
            node.stop()
        stop_strays(children)
        remove_stale_sockets(since=started, exclude_own=True, settle=3.0)
    result = reporter.summary() if reporter is not None else {"peer_name": peer_name, "final_epoch": 0}
    result["complete"] = True
    write_summary(out_dir, result)
    log.info(
        "Left the swarm at global epoch %d; summary in %s", result["final_epoch"], out_dir / "summary.json"
    )
    if died:
        raise DHTProcessDied(died[0])
    return result
