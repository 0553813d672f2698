"""The trainer contract: every environment variable the stack hands a training container, on a
VM (the node's /etc/gpu-training/node.env, passed with --env-file) and on Kubernetes (the Job's
env) alike. This table is the only place that names them: the stack fills them
(infra/contract.py), the trainer's config reads them (training/trainer/config.py), the entrypoint and
storage layer use them, and docs/contract.md's table is checked against it.

Standard library only: the stack imports it without torch.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Var:
    name: str
    meaning: str
    set_by: str  # who fills it
    field: str = ""  # the TrainConfig field it sets, if any


STACK = "the stack (training.* and the node group)"
NODE = "the node bootstrap (VM) / the Job's init container (Kubernetes)"
K8S = "Kubernetes (the Job's pod)"

WORKLOAD = Var("WORKLOAD", "built-in workload: tiny | resnet50", STACK, "workload")
TRAIN_STEPS = Var("TRAIN_STEPS", "optimizer steps of the whole run (across restarts)", STACK, "steps")
DATA_DIR = Var("DATA_DIR", "local copy of the dataset the trainer reads", NODE, "data_dir")
DATASET_URL = Var("DATASET_URL", "the dataset in this cloud's bucket (datasets/<name>/), cached into DATA_DIR", STACK)
CHECKPOINT_URL = Var("CHECKPOINT_URL", "the node group's checkpoint prefix in its cloud's bucket", STACK,
                     "checkpoint_url")
CHECKPOINT_DIR = Var("CHECKPOINT_DIR", "local checkpoint cache on node-local scratch", STACK, "checkpoint_dir")
CHECKPOINT_EVERY = Var("CHECKPOINT_EVERY", "steps between checkpoints (and one on every SIGTERM), or auto: "
                       "Daly's interval from the measured checkpoint cost, MTBF_S and NOTICE_S", STACK,
                       "checkpoint_every")
MTBF_S = Var("MTBF_S", "mean seconds between interruptions of one run of this group (for CHECKPOINT_EVERY=auto)",
             STACK, "mtbf_s")
NOTICE_S = Var("NOTICE_S", "seconds of notice before a reclaim (0: none)", STACK, "notice_s")
KEEP_CHECKPOINTS = Var("KEEP_CHECKPOINTS", "newest checkpoints kept locally and in the bucket", STACK, "keep")
LAUNCHER = Var("LAUNCHER", "torchrun | accelerate | horovod", STACK, "launcher")
TRAIN_MODULE = Var("TRAIN_MODULE", "the Python module every training process runs (when TRAIN_COMMAND is empty)",
                   STACK)
TRAIN_COMMAND = Var("TRAIN_COMMAND", "your training command (training.command): its argv as JSON, base64url-encoded "
                    "so that env files, shells and systemd read it alike; empty: our trainer", STACK)
NNODES = Var("NNODES", "most nodes of one training run (elastic: torchrun --nnodes MIN_NNODES:NNODES)", STACK)
MIN_NNODES = Var("MIN_NNODES", "fewest nodes the run goes on with after losing some", STACK)
NPROC_PER_NODE = Var("NPROC_PER_NODE", "training processes per node (its GPUs)", STACK)
NODE_RANK = Var("NODE_RANK", "this node's index (Kubernetes: the Job completion index)", K8S)
SPARES = Var("SPARES", "warm spares beside the run (scaling.spares): a Job's pods NNODES.. are spares that wait "
             "outside the run's world (NODE_RANK below NNODES + SPARES)", "the stack, for a Kubernetes Job")
RDZV_ENDPOINT = Var("RDZV_ENDPOINT", "host:port of the rendezvous store of a multi-node run (VMs: the stack's "
                    "store instance; Kubernetes: the Job's store Service)", STACK)
SHARED_DIR = Var("SHARED_DIR", "the network's shared file system, mounted here (empty: none; nodeGroups[].sharedFs)",
                 STACK)
METRICS_PORT = Var("METRICS_PORT", "Prometheus endpoint of the trainer", STACK, "metrics_port")
NODE_HOURLY_USD = Var("NODE_HOURLY_USD", "what this node costs per hour (cost-so-far metric, budget pace)", STACK,
                      "node_hourly_usd")
MLFLOW_TRACKING_URI = Var("MLFLOW_TRACKING_URI", "MLflow server (empty: no tracking)", STACK)
STORAGE_ENDPOINT_URL = Var("STORAGE_ENDPOINT_URL", "S3-compatible endpoint of the bucket, as this node reaches it",
                           STACK)
STORAGE_REGION = Var("STORAGE_REGION", "the bucket's region (request signing)", STACK)
STORAGE_ADDRESSING_STYLE = Var("STORAGE_ADDRESSING_STYLE", "virtual (OSS requires it) | path", STACK)
STORAGE_CREDENTIALS = Var(
    "STORAGE_CREDENTIALS",
    "where the bucket credentials come from: default (AWS chain: instance role, EKS Pod Identity) | "
    "instance-role (the ECS RAM / CVM CAM role from the metadata service) | ack-rrsa (the pod's RAM role) | "
    "tke-pod-identity (the pod's CAM role)", STACK)
AWS_REGION = Var("AWS_REGION", "region for AWS SDKs in pods (IMDS is out of their reach)", STACK)
GTS_CLOUD = Var("GTS_CLOUD", "aws | alicloud | tencentcloud", STACK)
GTS_NODE_GROUP = Var("GTS_NODE_GROUP", "the node group (metrics labels)", STACK)
GTS_TEAM = Var("GTS_TEAM", "the team the node's cost is shown back to (metrics label; teams.yaml, else the owner tag)",
               STACK)

VARS = (WORKLOAD, TRAIN_STEPS, DATA_DIR, DATASET_URL, CHECKPOINT_URL, CHECKPOINT_DIR, CHECKPOINT_EVERY, MTBF_S, NOTICE_S,
        KEEP_CHECKPOINTS, LAUNCHER, TRAIN_MODULE, TRAIN_COMMAND, NNODES, MIN_NNODES, NPROC_PER_NODE, NODE_RANK, SPARES,
        RDZV_ENDPOINT, SHARED_DIR, METRICS_PORT,
        NODE_HOURLY_USD, MLFLOW_TRACKING_URI, STORAGE_ENDPOINT_URL, STORAGE_REGION, STORAGE_ADDRESSING_STYLE,
        STORAGE_CREDENTIALS, AWS_REGION, GTS_CLOUD, GTS_NODE_GROUP, GTS_TEAM)
NAMES = frozenset(v.name for v in VARS)

# The multi-node fabric's settings (infra/fabric.py, data/fabric.csv), set only where they apply:
# NCCL and libfabric read them, the trainer does not. On a VM node the fabric check
# (gts-fabric.sh) adds what differs per node (the RDMA devices it sees) in its own env file.
FABRIC = "the stack, for a group with a fabric (nodeGroups[].fabric)"
GTS_FABRIC = Var("GTS_FABRIC", "the group's fabric: efa | erdma | hcc", FABRIC)
GTS_FABRIC_DEVICES = Var("GTS_FABRIC_DEVICES", "fabric devices each node must see before it joins a run", FABRIC)
NCCL_DEBUG = Var("NCCL_DEBUG", "NCCL log level (WARN; the node's fabric check runs with INFO)", STACK)
NCCL_SOCKET_IFNAME = Var("NCCL_SOCKET_IFNAME", "interfaces NCCL bootstraps over (VMs: ^lo,docker; a fabric's: its "
                         "VPC interface)", STACK)
FI_PROVIDER = Var("FI_PROVIDER", "libfabric provider: efa (aws-ofi-nccl then carries NCCL over EFA)", FABRIC)
FI_EFA_USE_DEVICE_RDMA = Var("FI_EFA_USE_DEVICE_RDMA", "1: GPUDirect RDMA over EFA (p4d, p5)", FABRIC)
FI_EFA_USE_HUGE_PAGE = Var("FI_EFA_USE_HUGE_PAGE", "0 on VM nodes (no huge pages reserved there); pods request "
                           "hugepages-2Mi instead", FABRIC)
NCCL_IB_HCA = Var("NCCL_IB_HCA", "RDMA devices NCCL uses, by prefix (erdma, mlx5_bond); the node's fabric check "
                  "narrows it to the devices it sees", FABRIC)
NCCL_IB_GID_INDEX = Var("NCCL_IB_GID_INDEX", "RoCE GID index: -1 (NCCL finds each device's RoCEv2 IPv4 GID; it "
                        "differs per eRDMA device) or the cloud's fixed index (HCC: 3)", FABRIC)
NCCL_IB_ADDR_FAMILY = Var("NCCL_IB_ADDR_FAMILY", "AF_INET: the GID NCCL picks is an IPv4 one", FABRIC)
NCCL_IB_ROCE_VERSION_NUM = Var("NCCL_IB_ROCE_VERSION_NUM", "2: RoCEv2 GIDs", FABRIC)
NCCL_IB_ADDR_RANGE = Var("NCCL_IB_ADDR_RANGE", "the network's CIDR: the eRDMA GIDs NCCL picks are in it", FABRIC)
NCCL_IB_TC = Var("NCCL_IB_TC", "RDMA traffic class (HCC: 160)", FABRIC)
NCCL_IB_SL = Var("NCCL_IB_SL", "RDMA service level (HCC: 3)", FABRIC)
NCCL_NET_GDR_LEVEL = Var("NCCL_NET_GDR_LEVEL", "GPUDirect RDMA distance (eRDMA: SYS, off by default there; "
                         "HCC: 2)", FABRIC)
FABRIC_VARS = (GTS_FABRIC, GTS_FABRIC_DEVICES, NCCL_DEBUG, NCCL_SOCKET_IFNAME, FI_PROVIDER, FI_EFA_USE_DEVICE_RDMA,
               FI_EFA_USE_HUGE_PAGE, NCCL_IB_HCA, NCCL_IB_GID_INDEX, NCCL_IB_ADDR_FAMILY, NCCL_IB_ROCE_VERSION_NUM,
               NCCL_IB_ADDR_RANGE, NCCL_IB_TC, NCCL_IB_SL, NCCL_NET_GDR_LEVEL)
FABRIC_NAMES = frozenset(v.name for v in FABRIC_VARS)
# The end of a reservation that takes the nodes back (an EC2 Capacity Block; infra/data/reservations.yaml),
# set only for such a group: the trainer stops with a checkpoint in the bucket before (training/reservation.py).
RESERVED = "the stack, for a group whose reservation's end takes its nodes (market.type: capacity-block)"
RESERVATION_END = Var("RESERVATION_END", "when the group's reservation ends, ISO 8601 UTC: the trainer stops with a "
                      "checkpoint in the bucket RESERVATION_NOTICE_S (and its upload deadline) before it", RESERVED)
RESERVATION_NOTICE_S = Var("RESERVATION_NOTICE_S", "seconds before RESERVATION_END the cloud starts taking the "
                           "nodes back (EC2 Capacity Blocks: 1800)", RESERVED)
RESERVATION_VARS = (RESERVATION_END, RESERVATION_NOTICE_S)
# Recovery after a lost node (docs/recovery.md): the image's defaults (RECOVERY_DEFAULTS, which
# training/node/entrypoint.sh repeats), which a node's env file or the Job may override.
IMAGE = "the image's default (a node's env file or the Job may set it)"
RDZV_LAST_CALL_S = Var("RDZV_LAST_CALL_S", "seconds a rendezvous waits for more nodes once MIN_NNODES are in "
                       "(torch's last_call_timeout; default 30, 3 with PEER_EVERY > 0)", IMAGE)
RDZV_KEEPALIVE_S = Var("RDZV_KEEPALIVE_S", "seconds between a node agent's rendezvous heartbeats (torch's "
                       "keep_alive_interval; default 2)", IMAGE)
RDZV_KEEPALIVE_MISSES = Var("RDZV_KEEPALIVE_MISSES", "heartbeats a node may miss before the others drop it from the "
                            "rendezvous (torch's keep_alive_max_attempt; default 5)", IMAGE)
STACK_PEER = "the stack (training.{}) where it is not the default; else the image's default"
PEER_EVERY = Var("PEER_EVERY", "steps between in-memory copies of each rank's state on another node of the run "
                 "(0: off; default 0; docs/recovery.md)", STACK_PEER.format("peerEvery"))
PEER_PORT = Var("PEER_PORT", "port of the node's peer store, on its private address (default 29600)", IMAGE)
PEER_STORE_GIB = Var("PEER_STORE_GIB", "GiB of host memory the node's peer store may hold; a copy over it is refused "
                     "(507) and the sender says so (0: half the node's memory, or of its container's limit where "
                     "less; default 0)",
                     STACK_PEER.format("peerStoreGib"))
PEER_HOLDERS = Var("PEER_HOLDERS", "other nodes that hold each node's sharded peer copies (default 1: its buddy; "
                   "2 keeps a step through a node lost with its buddy, at one more node's shards in each store's "
                   "memory and one more send per copy; docs/recovery.md)", STACK_PEER.format("peerHolders"))
RECOVERY_VARS = (RDZV_LAST_CALL_S, RDZV_KEEPALIVE_S, RDZV_KEEPALIVE_MISSES, PEER_EVERY, PEER_PORT, PEER_STORE_GIB,
                 PEER_HOLDERS)
RECOVERY_DEFAULTS = {RDZV_LAST_CALL_S.name: 30, RDZV_KEEPALIVE_S.name: 2, RDZV_KEEPALIVE_MISSES.name: 5,
                     PEER_EVERY.name: 0, PEER_PORT.name: 29600, PEER_STORE_GIB.name: 0, PEER_HOLDERS.name: 1}
LAST_CALL_PEER_S = 3  # RDZV_LAST_CALL_S's default with PEER_EVERY > 0 (the entrypoint's)
RECOVERY_LEAST = {RDZV_LAST_CALL_S.name: 0, RDZV_KEEPALIVE_S.name: 1, RDZV_KEEPALIVE_MISSES.name: 2,
                  PEER_EVERY.name: 0, PEER_PORT.name: 1, PEER_STORE_GIB.name: 0, PEER_HOLDERS.name: 1}


def recovery(name: str, env: dict[str, str] | None = None) -> int:
    """A recovery setting from the environment, else its default."""
    import os

    raw = (os.environ if env is None else env).get(name, "")
    return int(raw) if raw.isdigit() else RECOVERY_DEFAULTS[name]


# Hang and straggler settings (training/node/watchdog.py, training/trainer/progress.py): optional,
# their defaults in the meaning; set in the container's environment to change them.
OPTIONAL = "optional (default in the meaning)"
HANG_TIMEOUT_S = Var("HANG_TIMEOUT_S", "seconds without a step on every rank of a node before the hang watchdog "
                     "saves the stacks and restarts the workers: max(3 x the p99 step time, this); default 60",
                     OPTIONAL)
HANG_REPLACE = Var("HANG_REPLACE", "true: a node that hangs twice (or a persistent straggler's, with "
                   "STRAGGLER_REPLACE) asks its group for its replacement; default true", OPTIONAL)
HANG_RESTARTS = Var("HANG_RESTARTS", "hangs in a row with no step finished between them after which the "
                    "node's watchdog stops restarting the workers and fails the node's launcher; default 3", OPTIONAL)
STRAGGLER_WINDOW_STEPS = Var("STRAGGLER_WINDOW_STEPS", "steps over which the ranks' compute times are compared "
                             "(0: off); default 50", OPTIONAL)
STRAGGLER_FACTOR = Var("STRAGGLER_FACTOR", "a rank slower than this x the median rank over a window is flagged; "
                       "default 1.2", OPTIONAL)
STRAGGLER_REPLACE = Var("STRAGGLER_REPLACE", "true: a rank flagged 3 windows in a row has its node replaced; "
                        "default false", OPTIONAL)
WATCH_VARS = (HANG_TIMEOUT_S, HANG_REPLACE, HANG_RESTARTS, STRAGGLER_WINDOW_STEPS, STRAGGLER_FACTOR, STRAGGLER_REPLACE)
# environment variable -> TrainConfig field, for the trainer's config parser
CONFIG_FIELDS = {v.name: v.field for v in VARS if v.field}
CREDENTIAL_SOURCES = ("default", "instance-role", "ack-rrsa", "tke-pod-identity")


LAUNCHERS = ("torchrun", "accelerate", "horovod")
REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def encode_command(argv: list[str]) -> str:
    """TRAIN_COMMAND's value for `argv`: JSON, base64url (only [A-Za-z0-9_-=]: safe unquoted in an
    env file that bash sources, systemd reads and `docker run --env-file` passes literally)."""
    return base64.urlsafe_b64encode(json.dumps(argv, separators=(",", ":")).encode()).decode()


def decode_command(value: str) -> list[str]:
    """The argv TRAIN_COMMAND holds; ValueError naming what is wrong with it."""
    try:
        argv = json.loads(base64.urlsafe_b64decode(value.encode()).decode())
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{TRAIN_COMMAND.name}: not base64url-encoded JSON (infra/contract.py writes it)") from None
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) and a for a in argv):
        raise ValueError(f"{TRAIN_COMMAND.name}: not a non-empty list of non-empty strings")
    if argv[0] == "-m" and len(argv) < 2:
        raise ValueError(f"{TRAIN_COMMAND.name}: '-m' without a module name")
    return argv


def expand(argv: list[str], env: dict[str, str]) -> list[str]:
    """`${NAME}` in each argument replaced by the contract variable's value (other text is kept
    as it is: no shell runs the command)."""
    return [REFERENCE.sub(lambda m: env.get(m.group(1), "") if m.group(1) in NAMES else m.group(0), a) for a in argv]


def problems(env: dict[str, str] | None = None) -> list[str]:
    """What is wrong with the contract's values in `env` (the trainer refuses to start on any):
    each names the variable and what it takes. The TrainConfig fields are checked by the config
    parser; these are the ones the launcher and the storage layer read."""
    import os

    env = dict(os.environ) if env is None else env
    found = []
    source = env.get(STORAGE_CREDENTIALS.name) or "default"
    if source not in CREDENTIAL_SOURCES:
        found.append(f"{STORAGE_CREDENTIALS.name}={source!r}: use one of {', '.join(CREDENTIAL_SOURCES)}")
    for var in (NNODES, MIN_NNODES, NPROC_PER_NODE, NODE_RANK, SPARES):
        value, counts_from_0 = env.get(var.name, ""), var in (NODE_RANK, SPARES)
        if value and not (value.isdigit() and (counts_from_0 or int(value) >= 1)):
            found.append(f"{var.name}={value!r}: a whole number{'' if counts_from_0 else ' of at least 1'}")
    nnodes = env.get(NNODES.name, "1")
    if nnodes.isdigit() and int(nnodes) > 1 and not env.get(RDZV_ENDPOINT.name):
        found.append(f"{NNODES.name}={nnodes} needs {RDZV_ENDPOINT.name} (host:port of the rendezvous store): "
                     "without it every node would train alone")
    least = env.get(MIN_NNODES.name, "")
    if least.isdigit() and nnodes.isdigit() and int(least) > int(nnodes):
        found.append(f"{MIN_NNODES.name}={least} is more than {NNODES.name}={nnodes}")
    rank, spares = env.get(NODE_RANK.name, "0"), env.get(SPARES.name) or "0"
    if rank.isdigit() and nnodes.isdigit() and spares.isdigit() and int(rank) >= max(int(nnodes), 1) + int(spares):
        beside = f" + {SPARES.name}={spares}" if int(spares) else ""  # a Job's spare pods: ranks NNODES..
        found.append(f"{NODE_RANK.name}={rank} is not below {NNODES.name}={nnodes}{beside}")
    if env.get(TRAIN_COMMAND.name):
        try:
            decode_command(env[TRAIN_COMMAND.name])
        except ValueError as exc:
            found.append(str(exc))
    for var in RECOVERY_VARS:
        setting, fewest = env.get(var.name, ""), RECOVERY_LEAST[var.name]
        if setting and not (setting.isdigit() and fewest <= int(setting) <= (65535 if var is PEER_PORT else 86400)):
            found.append(f"{var.name}={setting!r}: a whole number of at least {fewest} (default "
                         f"{RECOVERY_DEFAULTS[var.name]})")
    launcher = env.get(LAUNCHER.name) or "torchrun"
    if launcher not in LAUNCHERS:
        found.append(f"{LAUNCHER.name}={launcher!r}: use one of {', '.join(LAUNCHERS)}")
    return found + _reservation_problems(env) + _watch_problems(env)


def _watch_problems(env: dict[str, str]) -> list[str]:
    """The hang and straggler settings (WATCH_VARS): a typo would crash the trainer or the
    watchdog mid-run (or, as nan, never fire), so they are refused before the launch."""
    import math

    found = []
    for var, fewest, most in ((HANG_TIMEOUT_S, 1.0, 86400.0), (STRAGGLER_FACTOR, 1.01, 100.0)):
        raw = env.get(var.name, "")
        try:
            value = float(raw) if raw else fewest
        except ValueError:
            value = math.nan
        if not fewest <= value <= most:  # nan fails too
            found.append(f"{var.name}={raw!r}: a number from {fewest:g} to {most:g}")
    for var, fewest in ((HANG_RESTARTS, 1), (STRAGGLER_WINDOW_STEPS, 0)):
        raw = env.get(var.name, "")
        if raw and not (raw.isdigit() and int(raw) >= fewest):
            found.append(f"{var.name}={raw!r}: a whole number of at least {fewest}")
    for var in (HANG_REPLACE, STRAGGLER_REPLACE):
        raw = env.get(var.name, "")
        if raw and raw.lower() not in ("true", "false"):
            found.append(f"{var.name}={raw!r}: true or false")
    return found


def _reservation_problems(env: dict[str, str]) -> list[str]:
    from datetime import datetime

    found = []
    end = env.get(RESERVATION_END.name, "")
    try:
        if end and datetime.fromisoformat(end.replace("Z", "+00:00")).tzinfo is None:
            raise ValueError(end)
    except ValueError:
        found.append(f"{RESERVATION_END.name}={end!r}: an ISO 8601 time with its offset, e.g. 2026-12-24T08:00:00Z")
    notice = env.get(RESERVATION_NOTICE_S.name, "")
    if notice and not notice.isdigit():
        found.append(f"{RESERVATION_NOTICE_S.name}={notice!r}: whole seconds, e.g. 1800")
    return found


def table() -> str:
    """The contract as docs/contract.md's Markdown table."""
    rows = ["| variable | meaning | set by |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.meaning} | {v.set_by} |" for v in VARS + FABRIC_VARS + RESERVATION_VARS + RECOVERY_VARS + WATCH_VARS]
    return "\n".join(rows)


USAGE = """usage: python -m training.contract check|table|command
  check    the trainer contract's variables in this environment: one line per problem, exit 2 (the
           entrypoint's first step, before any launcher starts)
  table    docs/contract.md's table of the variables
  command  TRAIN_COMMAND decoded, with ${NAME} expanded, NUL-separated (what the entrypoint runs)"""


def main(argv: list[str] | None = None) -> int:
    """`python -m training.contract check`: the entrypoint's first step (one line per problem,
    exit 2, before any launcher starts); `table`: docs/contract.md's table."""
    import os
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if args == ["table"]:
        print(table())
        return 0
    if args == ["command"]:  # the entrypoint reads the argv NUL-separated (mapfile -d '')
        env = dict(os.environ)
        sys.stdout.write("".join(a + "\0" for a in expand(decode_command(env[TRAIN_COMMAND.name]), env)))
        return 0
    if args != ["check"]:
        print(USAGE.splitlines()[0] + " (--help says what each does)", file=sys.stderr)
        return 2
    found = problems()
    for problem in found:
        print(f"trainer contract: {problem}", file=sys.stderr)
    return 2 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
