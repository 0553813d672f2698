"""The training run as a Kubernetes Job, on any cluster's provider."""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from infra.groups import LABEL_NODE_GROUP, ResolvedGroup
from infra.k8s.daemons import GPU_TOLERATION
from infra.spec import StackSpec


SKIP_AWAIT = "pulumi.com/skipAwait"


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
            # The stack submits the run and does not wait for it: pulumi-kubernetes otherwise awaits
            # a Job until Complete, at most 10 minutes (batch/v1/Job.py), failing every real run's
            # `pulumi up`. The run is watched through its metrics and `kubectl`, not the deploy.
            metadata=k8s.meta.v1.ObjectMetaArgs(name=job, namespace=namespace, labels=labels,
                                                annotations={SKIP_AWAIT: "true"}),
            spec=k8s.batch.v1.JobSpecArgs(
                completion_mode="Indexed", completions=args.nodes, parallelism=args.nodes,
                backoff_limit=args.backoff_limit,
                template=k8s.core.v1.PodTemplateSpecArgs(
                    metadata=k8s.meta.v1.ObjectMetaArgs(labels=labels),
                    spec=k8s.core.v1.PodSpecArgs(
                        restart_policy="OnFailure", subdomain=job,
                        # The trainer checkpoints on SIGTERM; give it time before SIGKILL.
                        termination_grace_period_seconds=120,
                        node_selector={LABEL_NODE_GROUP: args.node_group},
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


