#!/usr/bin/env python3
"""Turn a reclaim notice into a checkpoint, with the whole notice for it.

Polls the cloud's metadata service (every 5 s by default) for a spot reclaim notice, and for the
other notices the cloud gives (its node module's other_notice: on AWS an Auto Scaling scale-in,
seen as the instance's target lifecycle state, and a rebalance recommendation). On a notice it:

1. marks the node (`/run/gpu-training/spot-notice`: the trainer unit is never started again);
2. sends SIGTERM to the container's entrypoint (training/node/entrypoint.sh, PID 1), which passes it to
   the training *workers*, not to their launcher: torchrun would forward it and SIGKILL the
   workers 30 s later and exit 1 (torch.distributed.elastic `PContext.close`); the workers instead
   finish their step, commit the emergency checkpoint, upload it and exit 0, and the entrypoint
   exits 0 with them;
3. waits for the trainer to exit, up to the reclaim time less a margin (then `docker stop`),
   logs how long the checkpoint took from the notice, and stops the trainer unit without a
   restart.

A rebalance recommendation (an elevated risk of interruption) asks the workers for a
checkpoint now (SIGUSR1) and lets them go on.

    gts-spot-watch.py --cloud aws --action docker:gts-trainer
    gts-spot-watch.py --cloud tencentcloud --action crictl:trainer       # Kubernetes nodes
    gts-spot-watch.py --cloud alicloud --action pid:1234 --metadata-url http://127.0.0.1:8080 --once
"""

import argparse
import logging
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.environ.get("GTS_LIB", "/usr/local/lib/gts"))
import cloudmeta  # noqa: E402  (the node's copy of training/cloudmeta.py)

MARGIN_S = 10.0  # stop waiting this long before the node goes
DEFAULT_NOTICE_S = 120.0  # when a notice carries no readable time
log = logging.getLogger("gts-spot-watch")


def write_metric(directory, cloud, when):
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, ".gts_spot.prom.tmp")
    seconds = when.timestamp() if when else time.time()
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write("# HELP gts_spot_interruption_notice 1 once the cloud announced this spot node's reclaim.\n")
        fh.write("# TYPE gts_spot_interruption_notice gauge\n")
        fh.write(f'gts_spot_interruption_notice{{cloud="{cloud}"}} 1\n')
        fh.write("# HELP gts_spot_interruption_time_seconds When the node goes (unix time).\n")
        fh.write("# TYPE gts_spot_interruption_time_seconds gauge\n")
        fh.write(f'gts_spot_interruption_time_seconds{{cloud="{cloud}"}} {seconds:.0f}\n')
    os.replace(tmp, os.path.join(directory, "gts_spot.prom"))


class Trainer:
    """The training run an action names: its workers to signal, and whether it still runs."""

    def __init__(self, action):
        self.kind, _, self.target = action.partition(":")
        if self.kind not in ("pid", "docker", "crictl"):
            raise ValueError(f"unknown action {action!r}: use pid:N, docker:NAME or crictl:NAME")

    def _crictl_ids(self):
        out = subprocess.run(["crictl", "ps", "-q", "--label", f"io.kubernetes.container.name={self.target}"],
                             check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout
        return out.split()

    def signal_workers(self, sig):
        """`sig` to the trainer's entrypoint, which hands it to the training processes."""
        name = signal.Signals(sig).name.replace("SIG", "")
        if self.kind == "pid":
            os.kill(int(self.target), sig)
        elif self.kind == "docker":
            subprocess.run(["docker", "kill", "--signal", name, self.target], check=False)
        else:
            for cid in self._crictl_ids():
                subprocess.run(["crictl", "exec", cid, "sh", "-c", f"kill -{name} 1"], check=False)

    def running(self):
        if self.kind == "pid":
            try:
                os.kill(int(self.target), 0)
            except ProcessLookupError:
                return False
            with open(f"/proc/{self.target}/stat", encoding="utf-8") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
        if self.kind == "docker":
            out = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", self.target],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, universal_newlines=True)
            return out.stdout.strip() == "true"
        return bool(self._crictl_ids())

    def stop(self):
        """The last resort, and what keeps a stopped unit from restarting."""
        if self.kind == "docker":
            subprocess.run(["systemctl", "stop", "--no-block", "gts-trainer.service"], check=False)
        elif self.kind == "pid" and self.running():
            os.kill(int(self.target), signal.SIGTERM)


def emergency_checkpoint(trainer, goes_at, now=time.time):
    """Signal the workers and wait for the trainer to exit; seconds it took (None: it did not)."""
    started = now()
    limit = (goes_at.timestamp() if goes_at else started + DEFAULT_NOTICE_S) - MARGIN_S
    trainer.signal_workers(signal.SIGTERM)
    while now() < limit:
        if not trainer.running():
            took = now() - started
            log.warning("emergency checkpoint: the trainer exited %.1f s after the notice (%.0f s before "
                        "the node goes)", took, max(0.0, limit + MARGIN_S - now()))
            trainer.stop()
            return took
        time.sleep(0.5)
    log.error("the trainer still runs %.0f s before the node goes; stopping it", MARGIN_S)
    trainer.stop()
    return None


def mark(run_dir):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "spot-notice"), "w", encoding="utf-8") as fh:
        fh.write(f"{time.time():.0f}\n")


def poll(meta, node):
    """(kind, body, when) of the first notice the metadata service gives, or (None, None, None):
    the reclaim notice at the cloud's spot path, else the cloud's other notices (its node module's
    other_notice: a scale-in or a rebalance recommendation where the cloud gives them)."""
    body = meta.get(node.SPOT_PATH, missing_ok=True)
    if body:
        return "reclaim", body, node.spot_deadline(body)
    return node.other_notice(meta)


def main(argv=None):
    parser = argparse.ArgumentParser(description="reclaim notice -> emergency checkpoint")
    parser.add_argument("--cloud", choices=cloudmeta.known_clouds(), required=True)
    parser.add_argument("--action", required=True, help="pid:N | docker:CONTAINER | crictl:CONTAINER_NAME")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between polls")
    parser.add_argument("--metadata-url", default=os.environ.get("GTS_METADATA_URL") or None, help="override, for tests")
    parser.add_argument("--textfile-dir", default="/var/lib/node_exporter/textfile")
    parser.add_argument("--run-dir", default=os.environ.get("GTS_RUN_DIR", "/run/gpu-training"))
    parser.add_argument("--once", action="store_true", help="exit after acting on a notice")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    meta, node = cloudmeta.Metadata(args.cloud, args.metadata_url), cloudmeta.cloud_node(args.cloud)
    trainer = Trainer(args.action)
    rebalanced = False
    log.info("watching %s%s every %.0f s", meta.base, node.SPOT_PATH, args.interval)
    while True:
        try:
            kind, body, when = poll(meta, node)
        except (OSError, cloudmeta.MetadataError) as exc:
            log.warning("metadata service unreachable: %s", exc)
            kind, body, when = None, None, None
        if kind == "rebalance" and not rebalanced:
            log.warning("rebalance recommendation (%s): asking the trainer for a checkpoint now", body)
            trainer.signal_workers(signal.SIGUSR1)
            rebalanced = True
        elif kind in ("reclaim", "scale-in"):
            log.warning("%s notice: %s (node goes at %s); checkpointing", kind, body, when)
            mark(args.run_dir)
            write_metric(args.textfile_dir, args.cloud, when)
            emergency_checkpoint(trainer, when)
            if args.once:
                return 0
            while True:  # nothing more to do on this node
                time.sleep(3600)
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
