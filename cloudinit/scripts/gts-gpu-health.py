#!/usr/bin/env python3
"""GPU health on a training node: a boot gate before the trainer starts, and a watch of the
kernel's Xid messages while it runs. A bad GPU costs minutes, not the run.

gate  (gts-gpu-gate.service, which gts-trainer.service Requires; the Kubernetes Job's init
      container): the GPU count nvidia-smi sees is the type's, persistence mode is on, Fabric
      Manager is active where the type has NVSwitch, `dcgmi diag -r <level>` passes, and each
      GPU has its NVLinks up where the type has them. A failing node logs one line, writes
      gts_gpu_gate_* to the node exporter's textfile directory, asks its group to replace it,
      and exits 1: the trainer is never started.
watch (gts-gpu-watch.service): follows the kernel log (`journalctl -k -f`, or a file) for
      `NVRM: Xid` lines and classifies each by infra/data/gpu_health.yaml:
      replace -> the emergency checkpoint through the spot notice's path (gts-spot-watch.py),
                 then the node hands itself back to its group (below);
      restart -> the workers are killed; torchrun restarts them from the newest checkpoint;
      monitor -> a metric only (an unknown Xid is monitored too, and the journal says so).

Handing the node back: training/node/node_replace.py asks the cloud's node module
(infra/clouds/<cloud>/node.py replace_self) after a slot of the group's replacement budget
(replace_budget.py). A node with no scaling group (GTS_REPLACE=none: fixed instances), over the
budget, or refused, checkpoints and stops its trainer all the same and stays out of the run
(quarantined: gts_gpu_quarantined 1, and the journal says why) for the operator.

    gts-gpu-health.py gate --cloud aws --gpus 8 --nvswitch --nvlinks 12 --diag-level 1
"""

import argparse
import datetime as dt
import importlib.util
import logging
import os
import re
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
LIB = os.environ.get("GTS_LIB", "/usr/local/lib/gts")
sys.path[:0] = [LIB, os.path.join(LIB, "node")]  # node_replace.py: flat in /usr/local/lib/gts on a VM, in training/node/ in the image
import cloudmeta  # noqa: E402  (the node's copy of training/cloudmeta.py)
import node_replace  # noqa: E402  (training/node/node_replace.py: the replace-this-node request)
import replace_budget  # noqa: E402  (training/node/replace_budget.py: the group's replacement budget)


def _beside(name, script):
    """A node script beside this one, as a module: gts-spot-watch.py (its trainer signalling, node
    mark and bounded wait), gts-gpu-gate-checks.py (the boot gate's checks)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


spot = _beside("gts_spot_watch", "gts-spot-watch.py")
checks = _beside("gts_gpu_gate_checks", "gts-gpu-gate-checks.py")
log = logging.getLogger("gts-gpu-health")
XID = re.compile(r"NVRM: Xid \((?P<pci>[^)]*)\): (?P<code>\d+)(?:, (?P<text>.*))?")
ACTIONS = ("replace", "restart", "monitor")
DEFAULT_TABLE = os.path.join(LIB, "gpu_health.yaml")


# ---------------------------------------------------------------------------- the table

def load_table(path):
    """{xid: action} and the action for unknown codes, from gpu_health.yaml (PyYAML: cloud-init's
    own dependency, so every node's python3 has it)."""
    import yaml

    with open(path, encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    table = {}
    for action in ACTIONS:
        for code in doc["xid"][action]["codes"]:
            if code in table:
                raise ValueError(f"{path}: Xid {code} is in both {table[code]} and {action}")
            table[int(code)] = action
    return table, doc["xid"]["unknown"], doc


def classify(table, unknown, code):
    """(action, known) for an Xid code."""
    return (table[code], True) if code in table else (unknown, False)


# ---------------------------------------------------------------------------- metrics

def write_textfile(directory, name, lines):
    """Atomically replace <directory>/<name>.prom (the node exporter reads whole files only)."""
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{name}.prom.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    os.replace(tmp, os.path.join(directory, f"{name}.prom"))


def _labels(**kv):
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(kv.items())) + "}"


# ---------------------------------------------------------------------------- the gate

def gate(args):
    results = checks.gate_checks(args)
    failed = [(c, d) for c, ok, d, tool in results if not ok and not tool]
    missing = [(c, d) for c, ok, d, tool in results if not ok and tool]
    labels = dict(cloud=args.cloud, group=args.group)
    lines = ["# HELP gts_gpu_gate_ok 1 when the node passed its GPU boot gate; 0 keeps its trainer from starting.",
             "# TYPE gts_gpu_gate_ok gauge", f"gts_gpu_gate_ok{_labels(**labels)} {0 if failed else 1}",
             "# HELP gts_gpu_gate_check_ok Each boot-gate check (gpu_count, persistence_mode, fabric_manager, "
             "dcgm_diag, nvlink).", "# TYPE gts_gpu_gate_check_ok gauge"]
    lines += [f"gts_gpu_gate_check_ok{_labels(check=c, **labels)} {int(ok)}" for c, ok, _, _ in results]
    if not failed and not missing:
        write_textfile(args.textfile_dir, "gts_gpu_gate", lines)
        # the trainer's entrypoint records when the gate passed (training/records.py): a marker on scratch
        marker = os.path.join(os.environ.get("GTS_SCRATCH_DIR", "/scratch"), ".gts-gate-passed")
        try:
            with open(marker, "w", encoding="utf-8") as fh:
                fh.write(f"{time.time():.0f}\n")
        except OSError as exc:
            log.warning("gate marker %s not written: %s", marker, exc)
        log.info("GPU gate passed: %s", "; ".join(f"{c}: {d}" for c, _, d, _ in results))
        return 0
    if not failed:
        # The gate could not judge this node: the trainer stays off, but the node is not handed
        # back — a new one boots the same image and would fail the same way, draining the group.
        reason = "; ".join(f"{c}: {d}" for c, d in missing)
        log.error("GPU gate could not run (a tool of the gate, not this node, is missing): the trainer does not "
                  "start and the node is NOT replaced; fix the image or the node's services: %s", reason)
        spot.mark(args.run_dir)
        lines += quarantine_metric(labels, "gate_tool:" + missing[0][0])
        write_textfile(args.textfile_dir, "gts_gpu_gate", lines)
        return 1
    reason = "; ".join(f"{c}: {d}" for c, d in failed)
    log.error("GPU gate FAILED, the trainer does not start and the node asks for its replacement: %s", reason)
    spot.mark(args.run_dir)  # the trainer unit's ConditionPathExists: never started on this node
    if args.replace == "group":
        lines += replace_metric(labels, "gate:" + failed[0][0])
    write_textfile(args.textfile_dir, "gts_gpu_gate", lines)
    lines += leave(args, labels, "gate:" + failed[0][0])
    write_textfile(args.textfile_dir, "gts_gpu_gate", lines)
    return 1


# ---------------------------------------------------------------------------- handing the node back

def leave(args, labels, reason):
    """After a replace-class fault (the trainer is stopped and marked never to start again): hand
    the node back to its group; with no group, or when the group refuses, the node stays
    quarantined for the operator. Returns the metric lines that say which."""
    if args.no_replace:  # Kubernetes: the pod fails with the reason; the cloud's node repair acts
        return []
    if args.replace == "none":
        log.error("%s: this node has no scaling group (a fixed instance: GTS_REPLACE=none); it stays out of the "
                  "run, quarantined, for the operator to repair or replace", reason)
        return quarantine_metric(labels, "no_scaling_group")
    spent = over_budget(args, labels, reason)
    if spent:
        return spent
    if hand_back(args):
        return []
    log.error("%s: the scaling group did not take the node back; it stays out of the run, quarantined, for the "
              "operator to repair or replace", reason)
    return quarantine_metric(labels, "hand_back_failed")


HELD_SLOT = "replace-slot"  # in the run dir (/run: gone with the instance): the slot this node holds


def over_budget(args, labels, reason):
    """Take a slot of the group's replacement budget (training/node/replace_budget.py) before the
    node asks to be replaced: [] when it holds one (or the bound is off), else the quarantine's
    metric lines — over budget, or the budget unreachable (fail safe: never replace unbudgeted)."""
    if args.replacements_per_hour == 0:
        return []
    held = os.path.join(args.run_dir, HELD_SLOT)  # one node, one slot: the gate's, then the watch's ask
    if os.path.exists(held):
        log.warning("%s: this node already holds replacement slot %s", reason, open(held, encoding="utf-8").read())
        return []
    meta = cloudmeta.Metadata(args.cloud, args.metadata_url)
    try:
        try:
            creds = meta.credentials()
            instance = meta.get(cloudmeta.cloud_node(args.cloud).INSTANCE_ID_PATH) or "unknown"
        except (OSError, ValueError, KeyError, cloudmeta.MetadataError) as exc:
            raise replace_budget.Unreachable("the instance role's credentials: %s" % exc) from None
        taken, detail = replace_budget.take(os.environ, args.replacements_per_hour, instance, reason, creds)
    except replace_budget.Unreachable as exc:
        log.error("%s: the group's replacement budget could not be read (%s); this node is NOT replaced (fail "
                  "safe) and stays out of the run, quarantined, for the operator", reason, exc)
        return quarantine_metric(labels, "replace_budget_unreachable")
    if not taken:
        log.error("%s: replacement budget spent for group %s (%d an hour: %s); this node is NOT replaced and stays "
                  "out of the run, quarantined: many nodes failing at once is more likely our fault (image, gate, "
                  "driver) than theirs; see docs/gpu-health.md", reason, args.group, args.replacements_per_hour,
                  detail)
        return quarantine_metric(labels, "replace_budget_spent")
    log.warning("%s: took replacement slot %s", reason, detail)
    os.makedirs(args.run_dir, exist_ok=True)
    with open(held, "w", encoding="utf-8") as fh:
        fh.write(detail)
    return []


def quarantine_metric(labels, why):
    return ["# HELP gts_gpu_quarantined 1 when a GPU fault took this node out of the run and no group replaces it.",
            "# TYPE gts_gpu_quarantined gauge", f"gts_gpu_quarantined{_labels(why=why, **labels)} 1"]


def replace_metric(labels, reason):
    return ["# HELP gts_gpu_replace_requested 1 once this node asked its group to replace it (a GPU fault).",
            "# TYPE gts_gpu_replace_requested gauge",
            f"gts_gpu_replace_requested{_labels(reason=reason, **labels)} 1",
            "# HELP gts_gpu_replace_requested_timestamp_seconds When (unix time).",
            "# TYPE gts_gpu_replace_requested_timestamp_seconds gauge",
            f"gts_gpu_replace_requested_timestamp_seconds{_labels(**labels)} {time.time():.0f}"]


def hand_back(args, attempts=5):
    """Ask the node's group to replace this node; True once the cloud accepted. Retries transient
    failures (the role's credentials, the network) a few times: the node is broken either way."""
    meta = cloudmeta.Metadata(args.cloud, args.metadata_url)
    for attempt in range(1, attempts + 1):
        try:
            instance, answer = node_replace.request_replacement(meta, args.region, args.api_url, args.group,
                                                                args.group_id)
            log.warning("asked the %s group to replace instance %s: %s", args.cloud, instance, answer.strip()[:300])
            return True
        except (OSError, ValueError, KeyError, cloudmeta.MetadataError) as exc:
            detail = exc.read().decode()[:300] if hasattr(exc, "read") else str(exc)
            log.error("replacement request %d/%d failed: %s", attempt, attempts, detail)
            if attempt < attempts:
                time.sleep(min(30.0, 2.0 ** attempt))
    return False


# ---------------------------------------------------------------------------- the watch

def follow(path):
    """Lines of the kernel log as they come: `journalctl -k -f` or, for tests, a file."""
    if path:
        with open(path, encoding="utf-8", errors="replace") as fh:
            while True:
                line = fh.readline()
                if line:
                    yield line
                else:
                    time.sleep(0.2)
    proc = subprocess.Popen(["journalctl", "-k", "-f", "-n", "0", "-o", "short-iso"], stdout=subprocess.PIPE,
                            universal_newlines=True)
    yield from proc.stdout


class Watch:
    def __init__(self, args):
        self.args = args
        self.table, self.unknown, self.doc = load_table(args.table)
        self.trainer = spot.Trainer(args.action)
        self.labels = dict(cloud=args.cloud, group=args.group)
        self.counts = {}
        self.replacing = False
        self.extra = []

    def metrics(self):
        lines = ["# HELP gts_gpu_watch_up 1 while the node's Xid watch runs.", "# TYPE gts_gpu_watch_up gauge",
                 f"gts_gpu_watch_up{_labels(**self.labels)} 1",
                 "# HELP gts_gpu_xid_events_total NVRM Xid lines in the kernel log, by code and the action taken.",
                 "# TYPE gts_gpu_xid_events_total counter"]
        lines += [f"gts_gpu_xid_events_total{_labels(xid=str(code), action=action, **self.labels)} {n}"
                  for (code, action), n in sorted(self.counts.items())]
        write_textfile(self.args.textfile_dir, "gts_gpu_watch", lines + self.extra)

    def handle(self, line):
        match = XID.search(line)
        if not match:
            return None
        code = int(match.group("code"))
        action, known = classify(self.table, self.unknown, code)
        self.counts[(code, action)] = self.counts.get((code, action), 0) + 1
        note = self.doc["xid"].get(action, {}).get("notes", {}).get(code, "") if known else \
            "not in gpu_health.yaml: monitored only"
        log.warning("Xid %d on %s (%s): %s%s", code, match.group("pci"), note or match.group("text") or "", action,
                    "" if known else " (unknown Xid)")
        if action == "replace" and not self.replacing:
            self.replacing = True
            self.extra = replace_metric(self.labels, f"xid:{code}") if self.args.replace == "group" else []
            self.metrics()
            self.extra += self.replace(f"xid:{code}")
        elif action == "restart" and not self.replacing:
            # SIGUSR2: the entrypoint kills its workers and the launcher restarts them from the
            # newest committed checkpoint (training/node/entrypoint.sh); the spot watcher's path to it.
            self.trainer.signal_workers(signal.SIGUSR2)
            log.warning("Xid %d: the training workers were killed; torchrun restarts them from the newest "
                        "committed checkpoint", code)
        self.metrics()
        return action

    def replace(self, reason):
        spot.mark(self.args.run_dir)  # the trainer unit is never started again on this node
        goes = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=self.args.checkpoint_wait + spot.MARGIN_S)
        took = spot.emergency_checkpoint(self.trainer, goes)
        if took is None:
            log.error("no emergency checkpoint within %.0f s; the node goes anyway (the run resumes from the newest "
                      "committed one)", self.args.checkpoint_wait)
        return leave(self.args, self.labels, reason)

    def run(self):
        self.metrics()
        log.info("watching the kernel log%s for NVRM Xid lines", f" {self.args.kernel_log}" if self.args.kernel_log else "")
        for line in follow(self.args.kernel_log):
            self.handle(line)
            if self.replacing and self.args.once:
                return 0
        return 0


# ---------------------------------------------------------------------------- main

REPLACE_MODES = ("group", "none")
DIAG_LEVELS = (0, 1, 2)


def _per_hour(value):
    """The bound, or the default when node.env's value is not one: a typo there must not stop the
    gate and the watch on every node of the group (each would exit 2, no trainer anywhere)."""
    try:
        return replace_budget.per_hour_setting(value)
    except ValueError as exc:
        log.error("--replacements-per-hour (GTS_REPLACEMENTS_PER_HOUR) %r is not a whole number of 0 (no bound) "
                  "or more (%s); the default applies: %d an hour; fix the value in node.env", value, exc,
                  replace_budget.DEFAULT_PER_HOUR)
        return replace_budget.DEFAULT_PER_HOUR


def main(argv=None):
    env = os.environ.get
    parser = argparse.ArgumentParser(description="GPU boot gate and Xid watch")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("gate", "watch"):
        p = sub.add_parser(name)
        p.add_argument("--cloud", choices=cloudmeta.known_clouds(), default=env("GTS_CLOUD"))
        p.add_argument("--group", default=env("GTS_NODE_GROUP", ""))
        p.add_argument("--group-id", default=env("GTS_SCALING_GROUP_ID", ""),
                       help="the scaling group's id, where the cloud's call needs one; default: the plan's object "
                            "in the bucket")
        p.add_argument("--region", default="", help="default: the metadata service's")
        p.add_argument("--metadata-url", default=env("GTS_METADATA_URL") or None)
        p.add_argument("--api-url", default="", help="the scaling API's endpoint (tests)")
        p.add_argument("--textfile-dir", default="/var/lib/node_exporter/textfile")
        p.add_argument("--run-dir", default=env("GTS_RUN_DIR", "/run/gpu-training"))
        p.add_argument("--no-replace", action="store_true", help="report only (Kubernetes: the cloud's repair acts)")
        p.add_argument("--replace", choices=REPLACE_MODES, default=env("GTS_REPLACE") or "group",
                       help="none: the node has no scaling group (fixed instances); it is quarantined instead")
        p.add_argument("--replacements-per-hour", default=env("GTS_REPLACEMENTS_PER_HOUR"),
                       help="the group's replacement requests per clock hour, all nodes together (default "
                            f"{replace_budget.DEFAULT_PER_HOUR}; 0: no bound); over it a node is quarantined")
    g = sub.choices["gate"]
    # String defaults from node.env go through `type` like a typed flag (a bad one is a usage error).
    g.add_argument("--gpus", type=int, default=env("GTS_GPU_COUNT") or env("NPROC_PER_NODE") or "0",
                   help="the type's GPU count (node.env: NPROC_PER_NODE, one process per GPU)")
    g.add_argument("--nvswitch", action="store_true", default=env("GTS_NVSWITCH") == "true")
    g.add_argument("--nvlinks", type=int, default=env("GTS_NVLINKS") or "0", help="active NVLinks per GPU (0: skip)")
    g.add_argument("--diag-level", type=int, choices=DIAG_LEVELS, default=env("GTS_GPU_DIAG_LEVEL") or "1")
    g.add_argument("--diag-timeout", type=float, default=900.0)
    g.add_argument("--dcgm-image", default=env("GTS_DCGM_EXPORTER_IMAGE", ""))
    w = sub.choices["watch"]
    w.add_argument("--action", default=env("GTS_SPOT_ACTION"), help="pid:N | docker:CONTAINER | crictl:NAME")
    w.add_argument("--table", default=DEFAULT_TABLE)
    w.add_argument("--kernel-log", default="", help="follow this file instead of journalctl -k")
    w.add_argument("--checkpoint-wait", type=float, default=600.0, help="seconds the emergency checkpoint may take")
    w.add_argument("--once", action="store_true", help="exit after a replacement (tests)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    if not args.cloud:
        parser.error("--cloud (GTS_CLOUD) is required")
    # argparse checks `choices` on what the command line gives, not on defaults (node.env's values).
    if args.replace not in REPLACE_MODES:
        parser.error(f"--replace (GTS_REPLACE) must be one of {', '.join(REPLACE_MODES)}; got {args.replace!r}")
    args.replacements_per_hour = _per_hour(args.replacements_per_hour)
    if args.command == "gate" and args.diag_level not in DIAG_LEVELS:
        parser.error(f"--diag-level (GTS_GPU_DIAG_LEVEL) must be one of {DIAG_LEVELS}; got {args.diag_level!r}")
    try:
        problem = cloudmeta.cloud_node(args.cloud).group_id_problem(args.group_id)
    except cloudmeta.UnknownCloud as exc:
        parser.error(f"--cloud (GTS_CLOUD): {exc}")
    if problem:
        parser.error(f"--group-id (GTS_SCALING_GROUP_ID) {problem}; got {args.group_id[:60]!r}")
    if args.command == "gate":
        if args.gpus < 1:
            parser.error("--gpus (GTS_GPU_COUNT) must be the node type's GPU count")
        return gate(args)
    if not args.action:
        parser.error("--action (GTS_SPOT_ACTION) is required")
    return Watch(args).run()


if __name__ == "__main__":
    sys.exit(main())
