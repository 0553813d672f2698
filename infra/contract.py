"""What the stack hands each training container: the one place that decides the trainer's
environment. The VM node's env file (cloudinit/node.env.j2) and the Kubernetes Job
(infra/k8s/job.py) are both rendered from `trainer_env`; the variables are the ones
training/contract.py names, which the trainer reads."""

from __future__ import annotations

from datetime import timezone

from infra import rendezvous
from infra.buckets import DATASET_PREFIX, endpoint
from infra.capacity import reservations
from infra.clouds import profile
from infra.core import catalog as cat
from infra.resolve.resolved import ResolvedGroup
from infra.model.scrape import METRICS_PORT as METRICS_PORT  # the trainer's; infra/k8s/job.py reads it here
from infra.model.spec import StackSpec
from training import contract as c

RDZV_PORT = rendezvous.PORT
SCRATCH = "/scratch"
VM_DATA_DIR = f"{SCRATCH}/datasets/current"  # where gts-dataset.service caches it
POD_SCRATCH = "/scratch"  # the Job's node-local scratch volume, mounted at the same path
TRAIN_MODULE = "training.trainer.train"


def credentials_source(rg: ResolvedGroup) -> str:
    """How the trainer gets its bucket credentials on this group's nodes: the AWS SDK chain finds
    the instance role and EKS Pod Identity itself; ECS RAM and CVM CAM roles come from the
    metadata service; ACK pods use their own RAM role (RRSA), TKE pods their own CAM role (pod
    identity) (infra/clouds/<cloud>/profile.py storage_credentials)."""
    return profile(rg.cloud).storage_credentials(rg.kind)


def interruptions(rg: ResolvedGroup) -> tuple[float, float]:
    """(mean seconds between interruptions of one run of the group, the reclaim notice in
    seconds) for `checkpointEvery: auto`: the group's observed reclaims, else the estimates in
    infra/data/interruptions.yaml (spot: the type's AWS Spot Advisor band in the group's region
    from prices.csv, or the cloud's default band; on-demand: host faults, no notice). A run on N nodes stops when any of them goes: its
    MTBF is the node's divided by N."""
    data = cat.load_interruptions()
    cloud = data["clouds"][rg.cloud]
    market = rg.market
    notice = float(cloud["notice_s"]) if market.spot else 0.0  # only spot reclaims are announced
    if market.observed_mtbf_hours:
        hours = market.observed_mtbf_hours
    elif market.spot:
        # the Spot Advisor's band for the type in the group's region (prices.csv), else the cloud's estimate
        band = rg.primary.spot_band or cloud["spot_band"]
        hours = cat.HOURS_PER_MONTH / float(data["bands"][band])
    else:
        hours = float(cloud["on_demand_mtbf_hours"])
    return hours * 3600 / max(1, rg.max_nodes), notice


def dataset_url(spec: StackSpec, rg: ResolvedGroup) -> str:
    """The dataset in the group's own cloud's bucket (nodes never read another cloud's)."""
    name = spec.training.dataset
    return f"{rg.bucket.url}{DATASET_PREFIX}{name}/" if name else ""


def trainer_env(spec: StackSpec, rg: ResolvedGroup) -> dict[str, str]:
    """The trainer contract's values for one node group (training/contract.py names them)."""
    t = spec.training
    command = spec.command_of(rg.group)
    mtbf_s, notice_s = interruptions(rg)
    env = {
        c.WORKLOAD: t.workload, c.TRAIN_STEPS: str(t.steps), c.TRAIN_MODULE: TRAIN_MODULE,
        c.TRAIN_COMMAND: c.encode_command(command) if command else "",
        c.DATA_DIR: VM_DATA_DIR, c.DATASET_URL: dataset_url(spec, rg),
        c.CHECKPOINT_URL: rg.checkpoint_url, c.CHECKPOINT_DIR: f"{SCRATCH}/checkpoints",
        c.CHECKPOINT_EVERY: str(t.checkpoint_every), c.KEEP_CHECKPOINTS: str(t.keep_checkpoints),
        c.MTBF_S: f"{mtbf_s:.0f}", c.NOTICE_S: f"{notice_s:.0f}",
        c.LAUNCHER: t.launcher, c.NNODES: str(rg.max_nodes), c.MIN_NNODES: str(rg.min_nodes),
        c.NPROC_PER_NODE: str(rg.gpus), c.RDZV_ENDPOINT: rendezvous.endpoint_for(spec, rg),
        c.SHARED_DIR: shared.mount_path if (shared := spec.shared_fs_of(rg.group)) else "",
        c.METRICS_PORT: str(METRICS_PORT),
        c.NODE_HOURLY_USD: f"{rg.node_hourly_usd:.4f}", c.MLFLOW_TRACKING_URI: t.mlflow_tracking_uri or "",
        c.STORAGE_ENDPOINT_URL: endpoint(rg.cloud, rg.bucket.region, rg.region),
        c.STORAGE_REGION: rg.bucket.region, c.STORAGE_ADDRESSING_STYLE: "virtual",
        c.STORAGE_CREDENTIALS: credentials_source(rg), c.AWS_REGION: rg.region if profile(rg.cloud).sets_aws_region else "",
        c.GTS_CLOUD: rg.cloud, c.GTS_NODE_GROUP: rg.name, c.GTS_TEAM: spec.team_name,
    }
    env.update(fabric_env(spec, rg))
    env.update(reservation_env(rg))
    env.update(peer_env(spec))
    return {var.name: value for var, value in env.items()}


def peer_env(spec: StackSpec) -> dict[c.Var, str]:
    """The peer tier's settings the stack gives (training.peerEvery, peerHolders, peerStoreGib),
    where they are not the image's defaults (training/contract.py RECOVERY_DEFAULTS)."""
    t = spec.training
    given = {c.PEER_EVERY: t.peer_every, c.PEER_HOLDERS: t.peer_holders, c.PEER_STORE_GIB: t.peer_store_gib}
    return {var: str(value) for var, value in given.items() if value != c.RECOVERY_DEFAULTS[var.name]}


def reservation_env(rg: ResolvedGroup) -> dict[c.Var, str]:
    """A reservation whose end takes the nodes (infra/data/reservations.yaml noticeS): its end and
    notice, for the trainer to stop with a checkpoint in the bucket before (training/reservation.py)."""
    market = rg.market
    notice = reservations.notice_s(rg.cloud, market.type) if market.reservation else 0
    if not notice or market.end is None:
        return {}
    end = market.end.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {c.RESERVATION_END: end, c.RESERVATION_NOTICE_S: str(notice)}


def fabric_env(spec: StackSpec, rg: ResolvedGroup) -> dict[c.Var, str]:
    """NCCL / libfabric settings of the group's fabric (none without one): the fabric and its
    device count, then what the group's cloud answers for its kind of node (infra/clouds/<cloud>/
    profile.py fabric_env, with the sources; each a training/contract.py FABRIC_VARS name).
    Device lists are narrowed on the node (gts-fabric.sh), where they differ per node."""
    f = rg.fabric
    if f is None:
        return {}
    env = {c.GTS_FABRIC: f.fabric, c.GTS_FABRIC_DEVICES: str(f.devices), c.NCCL_DEBUG: "WARN"}
    settings = profile(rg.cloud).fabric_env(rg.kind, str(spec.network(rg.network).cidr))
    env.update({_FABRIC_VARS[name]: value for name, value in settings.items()})
    return env


_FABRIC_VARS = {v.name: v for v in c.FABRIC_VARS}
