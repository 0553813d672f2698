"""Prometheus metrics of a training process (served by each node's local rank 0), GPU
utilisation and memory when NVIDIA GPUs are present, and the cost so far from the node's price."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from training import records

log = logging.getLogger("gts.metrics")


class Metrics:
    def __init__(self, port: int, node_hourly_usd: float, labels: dict[str, str]):
        self.registry = CollectorRegistry()
        self.labels = labels
        names = list(labels)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=self.registry).labels(**labels)

        self.step = gauge("gts_train_step", "Optimizer steps done.")
        self.samples_per_second = gauge("gts_train_samples_per_second", "Training throughput, all ranks.")
        self.step_seconds = gauge("gts_train_step_seconds", "Wall time of the last step.")
        self.loss = gauge("gts_train_loss", "Mean loss over ranks of the last step.")
        self.checkpoint_seconds = gauge("gts_checkpoint_seconds", "Time the loop was blocked by the last checkpoint.")
        self.peer_blocked = gauge("gts_peer_copy_blocked_seconds", "Time the loop was blocked by the last peer copy.")
        self.checkpoint_wall_seconds = gauge(
            "gts_checkpoint_wall_seconds", "Wall time the last finished checkpoint cost the loop: its blocked time plus "
            "the extra time of the steps that ran while it was written (training/wallcost.py).")
        self.checkpoint_time = gauge("gts_checkpoint_last_commit_timestamp_seconds", "When the last checkpoint was committed.")
        self.checkpoint_interval = gauge("gts_checkpoint_interval_steps",
                                         "Steps between checkpoints (fixed, or chosen by checkpointEvery: auto).")
        self.upload_pending = gauge("gts_checkpoint_uploads_pending", "Committed checkpoints not yet in the bucket.")
        self.upload_time = gauge("gts_checkpoint_last_upload_timestamp_seconds", "When the last upload finished.")
        self.cost = gauge("gts_node_cost_usd", "This node's cost since the process started, at its hourly price.")
        self.hourly_price = gauge("gts_node_hourly_usd", "This node's price per hour (USD), for budget alerts.")
        self.hourly_price.set(node_hourly_usd)
        self.straggler = Gauge("gts_train_straggler_ratio", "Each rank's compute time over the last straggler window "
                               "against the median rank's (training/trainer/progress.py); above STRAGGLER_FACTOR: "
                               "flagged.", names + ["rank"], registry=self.registry)
        run = {**labels, "run": records.run_id()}
        self.productive = Gauge("gts_run_productive_seconds", "Training time the run keeps: its newest committed step "
                                "times the median step time.", [*run], registry=self.registry).labels(**run)
        self.run_started = Gauge("gts_run_started_timestamp_seconds", "When the run first asked for capacity (its "
                                 "records), else when this process started.", [*run], registry=self.registry).labels(**run)
        self.run_started.set(time.time())
        self.gpu_util = Gauge("gts_gpu_utilization_percent", "GPU utilisation.", names + ["gpu"], registry=self.registry)
        self.gpu_mem = Gauge("gts_gpu_memory_used_bytes", "GPU memory in use.", names + ["gpu"], registry=self.registry)
        self.started = time.time()
        self.hourly = node_hourly_usd
        self._nvml: Any = None
        try:
            import pynvml  # nvidia-ml-py, present in GPU images

            pynvml.nvmlInit()
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVIDIA driver here: GPU metrics stay absent
            self._nvml = None
        if port:
            addr = os.environ.get("METRICS_ADDR") or "127.0.0.1"  # the node's / pod's private address (the stack sets it)
            start_http_server(port, addr=addr, registry=self.registry)
            log.info("metrics on %s:%d/metrics", addr, port)

    def refresh(self) -> None:
        self.cost.set(self.hourly * (time.time() - self.started) / 3600)
        if self._nvml is None:
            return
        for i in range(self._nvml.nvmlDeviceGetCount()):
            handle = self._nvml.nvmlDeviceGetHandleByIndex(i)
            self.gpu_util.labels(**self.labels, gpu=str(i)).set(self._nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            self.gpu_mem.labels(**self.labels, gpu=str(i)).set(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)
