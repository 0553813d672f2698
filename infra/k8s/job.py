"""The training run as a Kubernetes Job, on any cluster's provider.

The pod runs the trainer image's own entrypoint with the trainer contract in its environment
(infra/contract.py, the same values a VM node's env file holds); an init container caches the
dataset on node-local scratch first. The pod is restricted (non-root, no privilege escalation,
no capabilities, RuntimeDefault seccomp, no service-account token unless its workload identity
needs one), and requests what it limits, sized from the node type, so it is never BestEffort.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s
import pulumi_random as random

from infra import clouds, contract, rendezvous
from infra.k8s import netpol
from infra.k8s.daemons import GPU_TOLERATION
from infra.pods import NAMESPACE, QUEUE_LABEL, QUEUES_MANAGED, TRAINER_UID, pod_resources
from infra.render.bundle import ROOT
from infra.resolve import gpu_health
from infra.resolve.groups import LABEL_NODE_GROUP, ResolvedGroup
from infra.resolve.sharedfs import SharedFsOutputs
from training import contract as c

SKIP_AWAIT = "pulumi.com/skipAwait"
SECRET_VARS = frozenset({c.MLFLOW_TRACKING_URI.name})


@dataclass
class Identity:
    """How the pod gets its bucket credentials (infra/contract.py, credentials_source)."""

    service_account: str
    env: dict[str, pulumi.Input[str]] = field(default_factory=dict)  # e.g. ACK RRSA's role and provider
    token_audience: str = ""  # a projected service-account token for this audience, when needed
    token_path: str = ""
    annotations: dict[str, pulumi.Input[str]] = field(default_factory=dict)  # the service account's (TKE's role)


@dataclass
class TrainingJobArgs:
    group: ResolvedGroup
    image: pulumi.Input[str]
    env: dict[str, str]  # the trainer contract
    identity: Identity
    namespace: pulumi.Input[str]
    scratch_gb: int
    labels: dict[str, str] = field(default_factory=dict)
    backoff_limit: int = 6
    shared: SharedFsOutputs | None = None  # the network's shared file system, when the group mounts it
    queue: str | None = None  # the Kueue LocalQueue it is submitted to, on a shared cluster
    after: list[pulumi.Resource] = field(default_factory=list)  # created after these (Kueue, its queues)
    key_provider: pulumi.ProviderResource | None = None  # the random provider of a multi-node Job's key


def restricted() -> k8s.core.v1.SecurityContextArgs:
    """The Pod Security "restricted" level for a container."""
    return k8s.core.v1.SecurityContextArgs(
        run_as_non_root=True, run_as_user=TRAINER_UID, allow_privilege_escalation=False,
        capabilities=k8s.core.v1.CapabilitiesArgs(drop=["ALL"]),
        seccomp_profile=k8s.core.v1.SeccompProfileArgs(type="RuntimeDefault"))


def success_policy(rg: ResolvedGroup) -> k8s.batch.v1.SuccessPolicyArgs | None:
    """A Job with spares is done when its run's pods (indexes 0..NNODES-1) are; the spares' are removed."""
    if not rg.group.scaling.spares or not clouds.profile(rg.cloud).kubernetes_job_success_policy:
        return None
    return k8s.batch.v1.SuccessPolicyArgs(rules=[k8s.batch.v1.SuccessPolicyRuleArgs(
        succeeded_indexes=f"0-{rg.nnodes - 1}", succeeded_count=rg.nnodes)])  # spares: nnodes >= 2


def store_name(job: str) -> str:
    return f"{job}-rdzv"


def job_env(rg: ResolvedGroup, job: str) -> dict[str, str]:
    """The contract's values on Kubernetes: the node group's own (scratch is the pod's node-local
    volume at the same path); a multi-node Job's pods meet at its rendezvous store's Service."""
    endpoint = f"{store_name(job)}.{NAMESPACE}.svc.cluster.local:{contract.RDZV_PORT}" if rg.max_nodes > 1 else ""
    # The spares' completion indexes (NODE_RANK) are NNODES..: the contract admits < NNODES + SPARES.
    return {**rg.trainer, c.RDZV_ENDPOINT.name: endpoint, c.SPARES.name: str(rg.group.scaling.spares)}


def rendezvous_store(name: str, image: pulumi.Input[str], namespace: pulumi.Input[str], labels: dict[str, str],
                     opts: pulumi.ResourceOptions) -> dict[str, str]:
    """A multi-node Job's rendezvous store (training/node/rdzv_store.py) as a Deployment on the
    untainted system pool behind a Service: losing any training pod leaves it, and the run,
    alive; the Indexed Job recreates the lost pod, which joins again. It listens on its pod's
    address; a NetworkPolicy admits the Job's pods alone (job_policies). Returns its selector."""
    selector = {"app.kubernetes.io/name": name}
    k8s.core.v1.Service(f"{name}-svc", metadata=k8s.meta.v1.ObjectMetaArgs(name=name, namespace=namespace,
                                                                          labels={**labels, **selector}),
                        spec=k8s.core.v1.ServiceSpecArgs(selector=selector, ports=[k8s.core.v1.ServicePortArgs(
                            name="rdzv", port=contract.RDZV_PORT, target_port=contract.RDZV_PORT)]),
                        opts=opts)
    small = {"cpu": "250m", "memory": "512Mi"}
    k8s.apps.v1.Deployment(f"{name}-deploy", metadata=k8s.meta.v1.ObjectMetaArgs(
        name=name, namespace=namespace, labels={**labels, **selector}),
        spec=k8s.apps.v1.DeploymentSpecArgs(
            replicas=1, selector=k8s.meta.v1.LabelSelectorArgs(match_labels=selector),
            template=k8s.core.v1.PodTemplateSpecArgs(
                metadata=k8s.meta.v1.ObjectMetaArgs(labels={**labels, **selector}),
                spec=k8s.core.v1.PodSpecArgs(
                    automount_service_account_token=False,
                    security_context=k8s.core.v1.PodSecurityContextArgs(
                        run_as_non_root=True, run_as_user=TRAINER_UID,
                        seccomp_profile=k8s.core.v1.SeccompProfileArgs(type="RuntimeDefault")),
                    containers=[k8s.core.v1.ContainerArgs(
                        name="store", image=image, command=["python", "-m", "training.node.rdzv_store",
                                                            "--host", "$(POD_IP)", "--port", str(contract.RDZV_PORT)],
                        env=[k8s.core.v1.EnvVarArgs(name="POD_IP", value_from=k8s.core.v1.EnvVarSourceArgs(
                            field_ref=k8s.core.v1.ObjectFieldSelectorArgs(field_path="status.podIP")))],
                        security_context=restricted(),
                        ports=[k8s.core.v1.ContainerPortArgs(name="rdzv", container_port=contract.RDZV_PORT)],
                        resources=k8s.core.v1.ResourceRequirementsArgs(requests=small, limits=small))]))),
        opts=opts)
    return selector


def deploy_training_jobs(groups: list[ResolvedGroup], images: Mapping[str, pulumi.Output[str]],
                         identities: dict[str, Identity], namespace: pulumi.Input[str], labels: dict[str, str],
                         opts: pulumi.ResourceOptions, shared: SharedFsOutputs | None = None,
                         queue: str | None = None, after: list[pulumi.Resource] | None = None,
                         key_provider: pulumi.ProviderResource | None = None) -> list[TrainingJob]:
    """One training Job per Kubernetes training group, on the cluster whose provider `opts` carries."""
    return [TrainingJob(g.name, TrainingJobArgs(
        group=g, image=images[g.name], env=job_env(g, g.name), identity=identities[g.name], namespace=namespace,
        scratch_gb=max(g.scratch_gb, 50), labels=labels, shared=shared if g.group.shared_fs else None, queue=queue,
        after=list(after or []), key_provider=key_provider), opts=opts)
            for g in groups if g.workload == "training"]


def _volume_source(shared: SharedFsOutputs) -> dict[str, Any]:
    """NFS, or the CSI driver the type's cloud names (infra/clouds/<cloud>/profile.py
    shared_fs_kinds; EFS: efs.csi.aws.com, an EKS add-on), which mounts through the access point
    (volumeHandle `[FileSystemId]::[AccessPointId]`, kubernetes-sigs/aws-efs-csi-driver
    examples/kubernetes/access_points) as the file system policy requires."""
    kind = shared.kind
    if kind.csi_driver and shared.file_system_id is not None and shared.access_point is not None:
        handle = pulumi.Output.all(shared.file_system_id, shared.access_point).apply(lambda fa: f"{fa[0]}::{fa[1]}")
        return {"csi": k8s.core.v1.CSIPersistentVolumeSourceArgs(
            driver=kind.csi_driver, volume_handle=handle, volume_attributes=dict(kind.csi_attributes))}
    return {"nfs": k8s.core.v1.NFSVolumeSourceArgs(server=shared.server, path=shared.export)}


def shared_claim(name: str, shared: SharedFsOutputs, namespace: pulumi.Input[str], labels: dict[str, str],
                 opts: pulumi.ResourceOptions) -> k8s.core.v1.PersistentVolumeClaim:
    """The network's NFS file system as a static PersistentVolume bound to this Job's claim (the
    restricted Pod Security level admits claims, not inline nfs volumes); Retain: deleting the
    Job never deletes a file."""
    options = shared.kind.options
    size = f"{shared.spec.size_gb}Gi"
    volume = k8s.core.v1.PersistentVolume(
        f"{name}-shared-pv", metadata=k8s.meta.v1.ObjectMetaArgs(name=f"{name}-shared", labels=labels),
        spec=k8s.core.v1.PersistentVolumeSpecArgs(
            capacity={"storage": size}, access_modes=["ReadWriteMany"], persistent_volume_reclaim_policy="Retain",
            storage_class_name="", mount_options=[o for o in options.split(",") if o != "_netdev"],
            **_volume_source(shared),
            claim_ref=k8s.core.v1.ObjectReferenceArgs(namespace=namespace, name=f"{name}-shared")),
        opts=opts)
    return k8s.core.v1.PersistentVolumeClaim(
        f"{name}-shared-pvc", metadata=k8s.meta.v1.ObjectMetaArgs(name=f"{name}-shared", namespace=namespace,
                                                                  labels=labels),
        spec=k8s.core.v1.PersistentVolumeClaimSpecArgs(
            access_modes=["ReadWriteMany"], storage_class_name="", volume_name=volume.metadata.name,
            resources=k8s.core.v1.VolumeResourceRequirementsArgs(requests={"storage": size})),
        opts=opts)


class TrainingJob(pulumi.ComponentResource):
    """An Indexed Job (one pod per node), restartPolicy OnFailure, with its rendezvous store when
    it spans nodes; submitted and not awaited."""

    def __init__(self, name: str, args: TrainingJobArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:k8s:TrainingJob", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        rg, job = args.group, name
        labels = {"app.kubernetes.io/name": job, **args.labels}
        store = rendezvous_store(store_name(job), args.image, args.namespace, args.labels, child) \
            if rg.max_nodes > 1 else None
        # Its pods with each other and their own store; the store from them alone; metrics from
        # the monitoring namespaces (infra/k8s/netpol.py).
        netpol.job_policies(job, args.namespace, {"app.kubernetes.io/name": job}, store, contract.RDZV_PORT,
                            contract.METRICS_PORT, args.labels, child)
        account = k8s.core.v1.ServiceAccount(f"{name}-sa", metadata=k8s.meta.v1.ObjectMetaArgs(
            name=args.identity.service_account, namespace=args.namespace, labels=labels,
            annotations=args.identity.annotations or None),
            automount_service_account_token=False, opts=child)
        resources, shm_gb = pod_resources(rg)
        env = self._env(name, args, labels, child)
        mounts, volumes = self._volumes(name, args, shm_gb, labels, child)
        gate, gate_volume = _gpu_gate(name, args, env, resources, labels, child)
        volumes.append(gate_volume)
        pod = k8s.core.v1.PodSpecArgs(
            restart_policy="OnFailure", service_account_name=account.metadata.name,
            automount_service_account_token=False,
            # The trainer checkpoints on SIGTERM; give it time before SIGKILL.
            termination_grace_period_seconds=120,
            node_selector={LABEL_NODE_GROUP: rg.name},
            tolerations=[GPU_TOLERATION],
            security_context=k8s.core.v1.PodSecurityContextArgs(
                run_as_non_root=True, run_as_user=TRAINER_UID, fs_group=TRAINER_UID,
                seccomp_profile=k8s.core.v1.SeccompProfileArgs(type="RuntimeDefault")),
            init_containers=[gate, *_dataset_cache(args, env, mounts)],
            containers=[k8s.core.v1.ContainerArgs(
                name="trainer", image=args.image, env=env, security_context=restricted(),
                ports=[k8s.core.v1.ContainerPortArgs(name="rdzv", container_port=contract.RDZV_PORT),
                       k8s.core.v1.ContainerPortArgs(name="metrics", container_port=contract.METRICS_PORT)],
                resources=k8s.core.v1.ResourceRequirementsArgs(limits=resources, requests=resources),
                volume_mounts=mounts)],
            volumes=volumes)
        # On a shared cluster the Job waits in its LocalQueue until Kueue admits all its pods at
        # once. Kueue's webhook suspends a labelled Job in a managed namespace as it is created
        # (site/content/en/docs/tasks/run/jobs.md), so the spec leaves `suspend` to Kueue: a spec
        # value would read as drift on every refresh once Kueue unsuspends it. The Job is created
        # after Kueue and its queues, so that the webhook is there to catch it.
        queued = {QUEUE_LABEL: args.queue} if args.queue else {}
        self.job = k8s.batch.v1.Job(
            f"{name}-job",
            # The stack submits the run and does not wait for it: pulumi-kubernetes otherwise awaits
            # a Job until Complete, at most 10 minutes (batch/v1/Job.py), failing every real run's
            # `pulumi up`. The run is watched through its metrics and `kubectl`, not the deploy.
            metadata=k8s.meta.v1.ObjectMetaArgs(name=job, namespace=args.namespace, labels={**labels, **queued},
                                                annotations={SKIP_AWAIT: "true"}),
            spec=k8s.batch.v1.JobSpecArgs(
                # One pod per node and per warm spare: a spare's pod waits outside NNODES (rdzv_launch.py).
                completion_mode="Indexed", completions=rg.job_pods, parallelism=rg.job_pods,
                backoff_limit=args.backoff_limit, success_policy=success_policy(rg),
                template=k8s.core.v1.PodTemplateSpecArgs(metadata=k8s.meta.v1.ObjectMetaArgs(labels=labels),
                                                         spec=pod)),
            opts=pulumi.ResourceOptions.merge(child, pulumi.ResourceOptions(depends_on=args.after)))
        self.register_outputs({"jobName": self.job.metadata.name})

    @staticmethod
    def _volumes(name: str, args: TrainingJobArgs, shm_gb: int, labels: dict[str, str],
                 child: pulumi.ResourceOptions) -> tuple[list[k8s.core.v1.VolumeMountArgs], list[k8s.core.v1.VolumeArgs]]:
        """Scratch, shared memory and the dataset, and the network's shared file system through
        its claim where the group mounts one."""
        mounts, volumes = _volumes(args, shm_gb)
        if args.shared is not None:
            claim = shared_claim(name, args.shared, args.namespace, labels, child)
            mounts.append(k8s.core.v1.VolumeMountArgs(name="shared", mount_path=args.shared.spec.mount_path))
            volumes.append(k8s.core.v1.VolumeArgs(name="shared", persistent_volume_claim=(
                k8s.core.v1.PersistentVolumeClaimVolumeSourceArgs(claim_name=claim.metadata.name))))
        return mounts, volumes

    @staticmethod
    def _env(name: str, args: TrainingJobArgs, labels: dict[str, str],
             child: pulumi.ResourceOptions) -> list[k8s.core.v1.EnvVarArgs]:
        """The contract's values, the secret ones through a Kubernetes Secret, the workload
        identity's, and this pod's node index."""
        env = [k8s.core.v1.EnvVarArgs(name=k, value=v) for k, v in sorted(args.env.items())
               if not (k in SECRET_VARS and v)]
        secrets = {k: v for k, v in args.env.items() if k in SECRET_VARS and v}
        if secrets:
            # An MLflow URI may hold a token: a Kubernetes Secret, created from a Pulumi secret, and
            # the env refers to it (the Job's spec stays readable in previews).
            held = k8s.core.v1.Secret(f"{name}-secrets", metadata=k8s.meta.v1.ObjectMetaArgs(
                name=f"{name}-secrets", namespace=args.namespace, labels=labels),
                string_data={k.lower(): pulumi.Output.secret(v) for k, v in secrets.items()}, opts=child)
            env += [k8s.core.v1.EnvVarArgs(name=k, value_from=k8s.core.v1.EnvVarSourceArgs(
                secret_key_ref=k8s.core.v1.SecretKeySelectorArgs(name=held.metadata.name, key=k.lower())))
                for k in sorted(secrets)]
        if args.group.max_nodes > 1:
            # The Job's rendezvous key (training/node/rdzv_launch.py), drawn once, in a Secret of its own.
            if args.key_provider is None:
                raise ValueError(f"{name}: a multi-node Job needs the random provider for its rendezvous key")
            key = random.RandomPassword(f"{name}-rdzv-key", length=rendezvous.KEY_LENGTH, special=False,
                                        opts=pulumi.ResourceOptions(parent=child.parent, provider=args.key_provider))
            held_key = k8s.core.v1.Secret(f"{name}-rdzv-key", metadata=k8s.meta.v1.ObjectMetaArgs(
                name=f"{name}-rdzv-key", namespace=args.namespace, labels=labels),
                string_data={"key": key.result}, opts=child)
            env.append(k8s.core.v1.EnvVarArgs(name="RDZV_KEY", value_from=k8s.core.v1.EnvVarSourceArgs(
                secret_key_ref=k8s.core.v1.SecretKeySelectorArgs(name=held_key.metadata.name, key="key"))))
        env += [k8s.core.v1.EnvVarArgs(name=k, value=v) for k, v in sorted(args.identity.env.items())]
        # The trainer's metrics listen on the pod's address alone (training/trainer/metrics.py).
        env.append(k8s.core.v1.EnvVarArgs(name="METRICS_ADDR", value_from=k8s.core.v1.EnvVarSourceArgs(
            field_ref=k8s.core.v1.ObjectFieldSelectorArgs(field_path="status.podIP"))))
        env.append(k8s.core.v1.EnvVarArgs(name=c.NODE_RANK.name, value_from=k8s.core.v1.EnvVarSourceArgs(
            field_ref=k8s.core.v1.ObjectFieldSelectorArgs(
                field_path="metadata.annotations['batch.kubernetes.io/job-completion-index']"))))
        return env


def _volumes(args: TrainingJobArgs, shm_gb: int) -> tuple[list[k8s.core.v1.VolumeMountArgs],
                                                          list[k8s.core.v1.VolumeArgs]]:
    """Node-local scratch for the dataset cache and the checkpoints (not the container layer),
    a bounded /dev/shm, and the projected identity token where the workload identity needs one."""
    mounts = [k8s.core.v1.VolumeMountArgs(name="scratch", mount_path=contract.POD_SCRATCH),
              k8s.core.v1.VolumeMountArgs(name="dshm", mount_path="/dev/shm")]
    volumes = [
        k8s.core.v1.VolumeArgs(name="scratch", empty_dir=k8s.core.v1.EmptyDirVolumeSourceArgs(
            size_limit=f"{args.scratch_gb}Gi")),
        k8s.core.v1.VolumeArgs(name="dshm", empty_dir=k8s.core.v1.EmptyDirVolumeSourceArgs(
            medium="Memory", size_limit=f"{shm_gb}Gi"))]
    identity = args.identity
    if identity.token_audience:
        folder, file = identity.token_path.rsplit("/", 1)
        mounts.append(k8s.core.v1.VolumeMountArgs(name="identity-token", read_only=True, mount_path=folder))
        volumes.append(k8s.core.v1.VolumeArgs(name="identity-token", projected=k8s.core.v1.ProjectedVolumeSourceArgs(
            sources=[k8s.core.v1.VolumeProjectionArgs(service_account_token=k8s.core.v1.ServiceAccountTokenProjectionArgs(
                audience=identity.token_audience, expiration_seconds=3600, path=file))])))
    return mounts, volumes


GATE_SCRIPTS = ("gts-gpu-health.py", "gts-spot-watch.py", "gts-gpu-gate-checks.py")  # the gate loads the other two
GATE_DIR = "/opt/gts/gpu-gate"


def gate_env(rg: ResolvedGroup) -> dict[str, str]:
    """The node gate's expectations as the pod can check them: GPU count, persistence mode and
    NVLinks through nvidia-smi (the device plugin puts the GPUs and the driver's tools in the
    container). Not from a pod: Fabric Manager (a host unit) and `dcgmi diag` (the trainer image
    carries no DCGM) — on EKS the node monitoring agent watches both for node repair."""
    return {**gpu_health.node_env(rg), "GTS_NVSWITCH": "false", "GTS_GPU_DIAG_LEVEL": "0",
            "GTS_LIB": "/opt/gts/training"}


def _gpu_gate(name: str, args: TrainingJobArgs, env: list[k8s.core.v1.EnvVarArgs], resources: dict[str, str],
              labels: dict[str, str], child: pulumi.ResourceOptions) -> tuple[k8s.core.v1.ContainerArgs,
                                                                              k8s.core.v1.VolumeArgs]:
    """The VM node's GPU boot gate (cloudinit/scripts/gts-gpu-health.py, from a ConfigMap) as the
    pod's first init container, on all the node's GPUs: a failing check fails the pod before the
    trainer starts, the reason in the container's termination message (its last log lines) and
    the pod's events; the node itself is the cloud's to repair (EKS node repair, ACK auto repair)."""
    scripts = k8s.core.v1.ConfigMap(f"{name}-gpu-gate", metadata=k8s.meta.v1.ObjectMetaArgs(
        name=f"{name}-gpu-gate", namespace=args.namespace, labels=labels),
        data={f: (ROOT / "cloudinit" / "scripts" / f).read_text(encoding="utf-8") for f in GATE_SCRIPTS}, opts=child)
    small = {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": resources["nvidia.com/gpu"]}
    return k8s.core.v1.ContainerArgs(
        name="gpu-gate", image=args.image, security_context=restricted(),
        env=env + [k8s.core.v1.EnvVarArgs(name=k, value=v) for k, v in sorted(gate_env(args.group).items())],
        command=["python", f"{GATE_DIR}/gts-gpu-health.py", "gate", "--no-replace", "--textfile-dir", "",
                 "--run-dir", "/tmp/gts-run"],
        termination_message_policy="FallbackToLogsOnError",
        volume_mounts=[k8s.core.v1.VolumeMountArgs(name="gpu-gate", mount_path=GATE_DIR, read_only=True)],
        resources=k8s.core.v1.ResourceRequirementsArgs(requests=small, limits=small)), k8s.core.v1.VolumeArgs(
            name="gpu-gate", config_map=k8s.core.v1.ConfigMapVolumeSourceArgs(name=scripts.metadata.name))


def _dataset_cache(args: TrainingJobArgs, env: list[k8s.core.v1.EnvVarArgs],
                   mounts: list[k8s.core.v1.VolumeMountArgs]) -> list[k8s.core.v1.ContainerArgs]:
    """The dataset on node-local scratch before the trainer starts (resumable, verified)."""
    dataset = args.env.get(c.DATASET_URL.name)
    if not dataset:
        return []
    return [k8s.core.v1.ContainerArgs(
        name="dataset", image=args.image, env=env, volume_mounts=mounts, security_context=restricted(),
        command=["python", "-m", "training.node.datasync", dataset, args.env[c.DATA_DIR.name]],
        resources=k8s.core.v1.ResourceRequirementsArgs(
            requests={"cpu": "2", "memory": "4Gi"}, limits={"cpu": "2", "memory": "4Gi"}))]


def training_namespace(name: str, opts: pulumi.ResourceOptions, managed: bool = False) -> k8s.core.v1.Namespace:
    """Where the cluster's training Jobs run, at the restricted Pod Security level (and, on a
    shared cluster, with its Jobs managed by Kueue)."""
    labels = {f"pod-security.kubernetes.io/{mode}": "restricted" for mode in ("enforce", "audit", "warn")}
    if managed:
        labels[QUEUES_MANAGED] = "true"
    return k8s.core.v1.Namespace(f"{name}-training-ns", metadata=k8s.meta.v1.ObjectMetaArgs(
        name=NAMESPACE, labels=labels), opts=opts)
