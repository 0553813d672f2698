"""Cloud-neutral Kubernetes wiring for GPU pools: the NVIDIA device plugin and the training run
as a Kubernetes Job. EKS, ACK and TKE all call this with their cluster's provider."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from infra.groups import TAG_NODE_GROUP, ResolvedGroup
from infra.spec import NodeGroup, StackSpec

DEVICE_PLUGIN_IMAGE = "nvcr.io/nvidia/k8s-device-plugin:v0.17.2"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}
GPU_TOLERATION = k8s.core.v1.TolerationArgs(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")
GPU_LABEL = TAG_NODE_GROUP


@dataclass
class TrainingJobArgs:
    image: str
    launcher: str  # torchrun | accelerate | horovod
    node_group: str  # label value of the GPU nodes to run on
    nodes: int
    gpus_per_node: int
    env: dict[str, str] = field(default_factory=dict)
    namespace: str = "training"
    backoff_limit: int = 6
    shm_gb: int = 64
    labels: dict[str, str] = field(default_factory=dict)


def launch_command(launcher: str, nodes: int, gpus: int, job: str, namespace: str) -> list[str]:
    """The container command: every pod starts the same launcher; torchrun meets at pod 0."""
    rdzv = f"{job}-0.{job}.{namespace}.svc.cluster.local:29400"
    if launcher == "torchrun":
        return ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={gpus}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv}", f"--rdzv-id={job}", "-m", "training.train"]
    if launcher == "accelerate":
        return ["accelerate", "launch", "--multi_gpu", f"--num_machines={nodes}",
                f"--num_processes={nodes * gpus}", "--machine_rank=$(JOB_COMPLETION_INDEX)",
                f"--main_process_ip={job}-0.{job}.{namespace}.svc.cluster.local", "--main_process_port=29400",
                "-m", "training.train"]
    return ["horovodrun", "-np", str(nodes * gpus), "python", "-m", "training.train"]


class NvidiaDevicePlugin(pulumi.ComponentResource):
    """Advertises nvidia.com/gpu on the GPU nodes (the EKS/ACK/TKE GPU images do not ship it)."""

    def __init__(self, name: str, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:k8s:NvidiaDevicePlugin", name, None, opts)
        labels = {"app.kubernetes.io/name": "nvidia-device-plugin"}
        self.daemonset = k8s.apps.v1.DaemonSet(
            f"{name}-ds",
            metadata=k8s.meta.v1.ObjectMetaArgs(name="nvidia-device-plugin", namespace="kube-system", labels=labels),
            spec=k8s.apps.v1.DaemonSetSpecArgs(
                selector=k8s.meta.v1.LabelSelectorArgs(match_labels=labels),
                update_strategy=k8s.apps.v1.DaemonSetUpdateStrategyArgs(type="RollingUpdate"),
                template=k8s.core.v1.PodTemplateSpecArgs(
                    metadata=k8s.meta.v1.ObjectMetaArgs(labels=labels),
                    spec=k8s.core.v1.PodSpecArgs(
                        priority_class_name="system-node-critical",
                        tolerations=[GPU_TOLERATION],
                        node_selector={"nvidia.com/gpu.present": "true"},
                        containers=[k8s.core.v1.ContainerArgs(
                            name="nvidia-device-plugin", image=DEVICE_PLUGIN_IMAGE,
                            env=[k8s.core.v1.EnvVarArgs(name="FAIL_ON_INIT_ERROR", value="false")],
                            security_context=k8s.core.v1.SecurityContextArgs(
                                allow_privilege_escalation=False,
                                capabilities=k8s.core.v1.CapabilitiesArgs(drop=["ALL"])),
                            volume_mounts=[k8s.core.v1.VolumeMountArgs(name="device-plugin",
                                                                       mount_path="/var/lib/kubelet/device-plugins")])],
                        volumes=[k8s.core.v1.VolumeArgs(
                            name="device-plugin",
                            host_path=k8s.core.v1.HostPathVolumeSourceArgs(path="/var/lib/kubelet/device-plugins"))]))),
            opts=pulumi.ResourceOptions(parent=self))
        self.register_outputs({"name": self.daemonset.metadata.name})


class TrainingJob(pulumi.ComponentResource):
    """The training run: an Indexed Job (one pod per node), restartPolicy OnFailure, a headless
    Service for rendezvous, GPU limits, the GPU toleration and a memory-backed /dev/shm."""

    def __init__(self, name: str, args: TrainingJobArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:k8s:TrainingJob", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        job = name
        labels = {"app.kubernetes.io/name": job, **args.labels}
        ns = k8s.core.v1.Namespace(f"{name}-ns", metadata=k8s.meta.v1.ObjectMetaArgs(name=args.namespace, labels=args.labels),
                                   opts=child)
        namespace = ns.metadata.name
        # Pods find rank 0 at <job>-0.<job>; a Job's pods get that hostname/subdomain.
        k8s.core.v1.Service(f"{name}-rdzv", metadata=k8s.meta.v1.ObjectMetaArgs(name=job, namespace=namespace, labels=labels),
                            spec=k8s.core.v1.ServiceSpecArgs(cluster_ip="None", selector={"job-name": job},
                                                             ports=[k8s.core.v1.ServicePortArgs(name="rdzv", port=29400)]),
                            opts=child)
        env = [k8s.core.v1.EnvVarArgs(name=k, value=v) for k, v in sorted(args.env.items())]
        env.append(k8s.core.v1.EnvVarArgs(name="NODE_RANK", value_from=k8s.core.v1.EnvVarSourceArgs(
            field_ref=k8s.core.v1.ObjectFieldSelectorArgs(
                field_path="metadata.annotations['batch.kubernetes.io/job-completion-index']"))))
        gpus = str(args.gpus_per_node)
        self.job = k8s.batch.v1.Job(
            f"{name}-job",
            metadata=k8s.meta.v1.ObjectMetaArgs(name=job, namespace=namespace, labels=labels),
            spec=k8s.batch.v1.JobSpecArgs(
                completion_mode="Indexed", completions=args.nodes, parallelism=args.nodes,
                backoff_limit=args.backoff_limit,
                template=k8s.core.v1.PodTemplateSpecArgs(
                    metadata=k8s.meta.v1.ObjectMetaArgs(labels=labels),
                    spec=k8s.core.v1.PodSpecArgs(
                        restart_policy="OnFailure", subdomain=job,
                        # The trainer checkpoints on SIGTERM; give it time before SIGKILL.
                        termination_grace_period_seconds=120,
                        node_selector={GPU_LABEL: args.node_group},
                        tolerations=[GPU_TOLERATION],
                        containers=[k8s.core.v1.ContainerArgs(
                            name="trainer", image=args.image,
                            command=launch_command(args.launcher, args.nodes, args.gpus_per_node, job, args.namespace),
                            env=env,
                            ports=[k8s.core.v1.ContainerPortArgs(name="rdzv", container_port=29400),
                                   k8s.core.v1.ContainerPortArgs(name="metrics", container_port=9401)],
                            resources=k8s.core.v1.ResourceRequirementsArgs(
                                limits={"nvidia.com/gpu": gpus}, requests={"nvidia.com/gpu": gpus}),
                            volume_mounts=[k8s.core.v1.VolumeMountArgs(name="dshm", mount_path="/dev/shm")])],
                        volumes=[k8s.core.v1.VolumeArgs(
                            name="dshm", empty_dir=k8s.core.v1.EmptyDirVolumeSourceArgs(
                                medium="Memory", size_limit=f"{args.shm_gb}Gi"))]))),
            opts=child)
        self.register_outputs({"jobName": self.job.metadata.name})


def deploy_training_jobs(spec: StackSpec, groups: list[ResolvedGroup],
                         opts: pulumi.ResourceOptions) -> list[TrainingJob]:
    """One training Job per Kubernetes training group, sized from the catalog, on the cluster
    whose provider `opts` carries."""
    jobs = []
    for g in groups:
        if g.workload != "training":
            continue
        jobs.append(TrainingJob(g.name, TrainingJobArgs(
            image=spec.training.image, launcher=spec.training.launcher, node_group=g.name,
            nodes=g.nnodes, gpus_per_node=g.gpus,
            env={"CHECKPOINT_URL": g.checkpoint_url, "DATASET_URL": spec.training.dataset_url,
                 "CHECKPOINT_EVERY": str(spec.training.checkpoint_every), "WORKLOAD": spec.training.workload,
                 "CHECKPOINT_DIR": "/scratch/checkpoints", "METRICS_PORT": "9401",
                 "NODE_HOURLY_USD": f"{g.node_hourly_usd:.4f}", "GTS_CLOUD": g.cloud,
                 "GTS_NODE_GROUP": g.name},
            labels={"env": spec.env}), opts=opts))
    return jobs


@dataclass(frozen=True)
class PoolPart:
    """One managed node pool of a node group: EKS node groups and TKE node pools buy a single
    way, so a spot group's on-demand base becomes a pool of its own (ACK pools take an
    on-demand base natively and use one part)."""

    suffix: str  # od | spot
    spot: bool
    min: int
    max: int
    desired: int


def pool_parts(group: NodeGroup) -> list[PoolPart]:
    s = group.scaling
    if group.market.type != "spot":
        return [PoolPart("od", False, s.min, s.max, s.baseline)]
    base = group.market.on_demand_base
    parts = [PoolPart("od", False, base, base, base)] if base else []
    return parts + [PoolPart("spot", True, max(0, s.min - base), max(1, s.max - base), max(0, s.baseline - base))]


def cluster_workloads(name: str, kubeconfig: pulumi.Input[str], pools: Sequence[pulumi.Resource], spec: StackSpec,
                      groups: list[ResolvedGroup], parent: pulumi.Resource, device_plugin: bool) -> None:
    """A Kubernetes provider on the new cluster (after its GPU pools exist), the NVIDIA device
    plugin where the cloud does not install it, and the training Jobs."""
    provider = k8s.Provider(f"{name}-k8s", kubeconfig=kubeconfig,
                            opts=pulumi.ResourceOptions(parent=parent, depends_on=list(pools)))
    opts = pulumi.ResourceOptions(parent=parent, provider=provider)
    if device_plugin:
        NvidiaDevicePlugin(f"{name}-nvidia", opts=opts)
    deploy_training_jobs(spec, groups, opts)
