"""What every GPU node of a cluster runs beside the training pods: the NVIDIA device plugin
(where the cloud does not install it), and the DCGM and node exporters, so that the GPU-idle
and spot-notice alerts see Kubernetes nodes as they see VM nodes."""

from __future__ import annotations

import re

import pulumi
import pulumi_kubernetes as k8s

from infra.k8s import netpol
from infra.model.images import NodeAgents
from infra.resolve.groups import LABEL_NODE_GROUP

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}
GPU_TOLERATION = k8s.core.v1.TolerationArgs(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")
# Every GPU pool of the stack carries the node-group label; the agents run on those nodes only.
ON_GPU_NODES = k8s.core.v1.AffinityArgs(node_affinity=k8s.core.v1.NodeAffinityArgs(
    required_during_scheduling_ignored_during_execution=k8s.core.v1.NodeSelectorArgs(node_selector_terms=[
        k8s.core.v1.NodeSelectorTermArgs(match_expressions=[
            k8s.core.v1.NodeSelectorRequirementArgs(key=LABEL_NODE_GROUP, operator="Exists")])])))
TEXTFILE_DIR = "/var/lib/node_exporter/textfile"  # the spot watcher writes its notice metric here


def daemonset(resource: str, name: str, namespace: pulumi.Input[str], container: k8s.core.v1.ContainerArgs,
              host_paths: dict[str, k8s.core.v1.HostPathVolumeSourceArgs], opts: pulumi.ResourceOptions, *,
              affinity: k8s.core.v1.AffinityArgs = ON_GPU_NODES, scrape_port: int | None = None,
              rolling_update: bool = False, host_network: bool | None = None,
              host_pid: bool | None = None) -> k8s.apps.v1.DaemonSet:
    """A node agent's DaemonSet, the one shape of all of them: one pod on each node of `affinity`
    (the GPU taint tolerated), node-critical, no service-account token (no agent calls the API),
    the host paths it reads as volumes, and Prometheus' scrape annotations where it serves metrics."""
    labels = {"app.kubernetes.io/name": name}
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(scrape_port)} if scrape_port else None
    return k8s.apps.v1.DaemonSet(
        resource,
        metadata=k8s.meta.v1.ObjectMetaArgs(name=name, namespace=namespace, labels=labels),
        spec=k8s.apps.v1.DaemonSetSpecArgs(
            selector=k8s.meta.v1.LabelSelectorArgs(match_labels=labels),
            update_strategy=k8s.apps.v1.DaemonSetUpdateStrategyArgs(type="RollingUpdate") if rolling_update else None,
            template=k8s.core.v1.PodTemplateSpecArgs(
                metadata=k8s.meta.v1.ObjectMetaArgs(labels=labels, annotations=scrape),
                spec=k8s.core.v1.PodSpecArgs(
                    priority_class_name="system-node-critical", host_network=host_network, host_pid=host_pid,
                    automount_service_account_token=False, tolerations=[GPU_TOLERATION], affinity=affinity,
                    containers=[container],
                    volumes=[k8s.core.v1.VolumeArgs(name=n, host_path=h) for n, h in host_paths.items()]))),
        opts=opts)


def device_plugin(resource: str, name: str, image: str, affinity: k8s.core.v1.AffinityArgs, paths: dict[str, str],
                  opts: pulumi.ResourceOptions, env: list[k8s.core.v1.EnvVarArgs] | None = None,
                  host_network: bool | None = None) -> k8s.apps.v1.DaemonSet:
    """A device plugin's DaemonSet in kube-system, rolled node by node: no privileges, serving from
    the host paths it mounts where they are on the host."""
    return daemonset(
        resource, name, "kube-system", k8s.core.v1.ContainerArgs(
            name=name, image=image, env=env,
            security_context=k8s.core.v1.SecurityContextArgs(
                allow_privilege_escalation=False, capabilities=k8s.core.v1.CapabilitiesArgs(drop=["ALL"])),
            volume_mounts=[k8s.core.v1.VolumeMountArgs(name=n, mount_path=p) for n, p in paths.items()]),
        {n: k8s.core.v1.HostPathVolumeSourceArgs(path=p) for n, p in paths.items()}, opts,
        affinity=affinity, rolling_update=True, host_network=host_network)


class NvidiaDevicePlugin(pulumi.ComponentResource):
    """Advertises nvidia.com/gpu on the GPU nodes (the EKS/ACK/TKE GPU images do not ship it)."""

    def __init__(self, name: str, image: str, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:k8s:NvidiaDevicePlugin", name, None, opts)
        self.daemonset = device_plugin(
            f"{name}-ds", "nvidia-device-plugin", image, ON_GPU_NODES, {"device-plugin": "/var/lib/kubelet/device-plugins"},
            env=[k8s.core.v1.EnvVarArgs(name="FAIL_ON_INIT_ERROR", value="false")],
            opts=pulumi.ResourceOptions(parent=self))
        self.register_outputs({"name": self.daemonset.metadata.name})


def repository_name(image: str) -> str:
    """The last part of an image reference's repository, without its tag or digest
    ("registry/eks/efa-plugin:v1" and "…/efa-plugin@sha256:…" both give "efa-plugin")."""
    return re.split(r"[@:]", image.rsplit("/", 1)[-1], maxsplit=1)[0]


class FabricDevicePlugin(pulumi.ComponentResource):
    """Advertises the fabric's pod resource on the nodes of the fabric groups, where the cloud
    names a device plugin for it (infra/clouds/<cloud>/profile.py fabric_device_plugin; EKS: the
    AMIs carry the EFA host components but not the plugin, EKS user guide device-management-efa).
    Shaped as the aws/eks-charts aws-efa-k8s-device-plugin chart's DaemonSet: host network, the
    kubelet's device-plugin socket directory and /dev/infiniband, no privileges; named after the
    image's repository."""

    def __init__(self, name: str, image: str, groups: list[str], opts: pulumi.ResourceOptions | None = None):
        # The type token is the one the first (EFA) plugin was registered with: a new one would
        # replace the running stacks' DaemonSets.
        super().__init__("gpu-training-stack:k8s:EfaDevicePlugin", name, None, opts)
        on_fabric_groups = k8s.core.v1.AffinityArgs(node_affinity=k8s.core.v1.NodeAffinityArgs(
            required_during_scheduling_ignored_during_execution=k8s.core.v1.NodeSelectorArgs(node_selector_terms=[
                k8s.core.v1.NodeSelectorTermArgs(match_expressions=[k8s.core.v1.NodeSelectorRequirementArgs(
                    key=LABEL_NODE_GROUP, operator="In", values=groups)])])))
        self.daemonset = device_plugin(
            f"{name}-ds", repository_name(image), image, on_fabric_groups,
            {"device-plugin": "/var/lib/kubelet/device-plugins", "infiniband": "/dev/infiniband"}, host_network=True,
            opts=pulumi.ResourceOptions(parent=self))
        self.register_outputs({"name": self.daemonset.metadata.name})


class GpuNodeExporters(pulumi.ComponentResource):
    """DCGM exporter (:9400, GPU utilisation and memory) and node exporter (:9100, with the
    spot watcher's textfile metrics) on every GPU node, in a namespace of their own (they need
    host access that the training namespace's restricted Pod Security level forbids)."""

    NAMESPACE = "gts-node-agents"

    def __init__(self, name: str, images: NodeAgents, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:k8s:GpuNodeExporters", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        ns = k8s.core.v1.Namespace(f"{name}-ns", metadata=k8s.meta.v1.ObjectMetaArgs(
            name=self.NAMESPACE, labels={"pod-security.kubernetes.io/enforce": "privileged"}), opts=child)
        namespace = ns.metadata.name
        # Default deny; the DCGM exporter's port from the monitoring namespaces only.
        ns_opts = pulumi.ResourceOptions(parent=ns)
        netpol.namespace_baseline(f"{name}-agents", namespace, {}, ns_opts, egress_out=False)
        netpol.metrics_from_monitoring(f"{name}-dcgm", namespace, {"app.kubernetes.io/name": "dcgm-exporter"}, 9400,
                                       {}, ns_opts)
        self._dcgm(name, namespace, images.dcgm_exporter, child)
        self._node(name, namespace, images.node_exporter, child)
        self.register_outputs({"namespace": namespace})

    @staticmethod
    def _dcgm(name: str, namespace: pulumi.Input[str], image: str, child: pulumi.ResourceOptions) -> None:
        daemonset(f"{name}-dcgm", "dcgm-exporter", namespace, k8s.core.v1.ContainerArgs(
            name="dcgm-exporter", image=image,
            # All GPUs of the node, through the NVIDIA runtime, without requesting any.
            env=[k8s.core.v1.EnvVarArgs(name="NVIDIA_VISIBLE_DEVICES", value="all"),
                 k8s.core.v1.EnvVarArgs(name="DCGM_EXPORTER_KUBERNETES", value="true")],
            ports=[k8s.core.v1.ContainerPortArgs(name="metrics", container_port=9400)],
            security_context=k8s.core.v1.SecurityContextArgs(capabilities=k8s.core.v1.CapabilitiesArgs(add=["SYS_ADMIN"])),
            resources=k8s.core.v1.ResourceRequirementsArgs(
                requests={"cpu": "100m", "memory": "256Mi"}, limits={"memory": "512Mi"}),
            volume_mounts=[k8s.core.v1.VolumeMountArgs(  # the kubelet's socket only: no API access
                name="pod-resources", mount_path="/var/lib/kubelet/pod-resources", read_only=True)]),
            {"pod-resources": k8s.core.v1.HostPathVolumeSourceArgs(path="/var/lib/kubelet/pod-resources")},
            child, scrape_port=9400)

    @staticmethod
    def _node(name: str, namespace: pulumi.Input[str], image: str, child: pulumi.ResourceOptions) -> None:
        daemonset(f"{name}-node", "node-exporter", namespace, k8s.core.v1.ContainerArgs(
            name="node-exporter", image=image,
            # Host network: on the node's address alone (NetworkPolicy cannot reach a host-network
            # pod; the nodes' security groups do).
            args=["--path.rootfs=/host", "--collector.textfile.directory=/textfile",
                  "--web.listen-address=$(HOST_IP):9100"],
            env=[k8s.core.v1.EnvVarArgs(name="HOST_IP", value_from=k8s.core.v1.EnvVarSourceArgs(
                field_ref=k8s.core.v1.ObjectFieldSelectorArgs(field_path="status.hostIP")))],
            ports=[k8s.core.v1.ContainerPortArgs(name="metrics", container_port=9100)],
            security_context=k8s.core.v1.SecurityContextArgs(
                read_only_root_filesystem=True, allow_privilege_escalation=False, run_as_non_root=True,
                run_as_user=65534),
            resources=k8s.core.v1.ResourceRequirementsArgs(
                requests={"cpu": "50m", "memory": "64Mi"}, limits={"memory": "128Mi"}),
            volume_mounts=[
                k8s.core.v1.VolumeMountArgs(name="root", mount_path="/host", read_only=True,
                                            mount_propagation="HostToContainer"),
                k8s.core.v1.VolumeMountArgs(name="textfile", mount_path="/textfile", read_only=True)]),
            {"root": k8s.core.v1.HostPathVolumeSourceArgs(path="/"),
             "textfile": k8s.core.v1.HostPathVolumeSourceArgs(path=TEXTFILE_DIR, type="DirectoryOrCreate")},
            child, scrape_port=9100, host_network=True, host_pid=True)
