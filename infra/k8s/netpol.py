"""NetworkPolicies: every namespace the stack creates denies all traffic by default, then admits
what the stack's pods need, and nothing that crosses from one team to another.

- default deny, ingress and egress, for every pod of the namespace;
- DNS to the cluster's resolver (kube-system, port 53);
- out to anywhere except the instance metadata services (a pod would otherwise get its node's
  role from them: on TKE that is the GPU pool's storage role; the stack's Jobs hold roles of
  their own on every cluster); what a pod may reach of other
  teams is closed on the receiving side: every namespace the stack creates denies ingress
  (other teams' pods), security groups close nodes and stores, bucket policies the data;
- inside a Job: its pods with each other (NCCL / gloo, any port) and with its own rendezvous
  store, whose pod admits that Job's pods alone on the store's port;
- metrics: the trainer's and the DCGM exporter's port from namespaces labelled MONITORING_LABEL
  (the cluster's Prometheus) only.

Enforcement is the cluster's (docs/tenancy.md): EKS through the VPC CNI's network
policy agent (enableNetworkPolicy on the vpc-cni add-on), TKE through its NetworkPolicy add-on,
ACK through Terway (terway-eniip with NetworkPolicy on; Flannel would not enforce it)."""

from __future__ import annotations

from collections.abc import Sequence

import pulumi
import pulumi_kubernetes as k8s

from infra.clouds import profile

MONITORING_LABEL = "gpu-training-stack/monitoring"  # a namespace whose pods may scrape metrics
# Instance metadata services a pod must not reach: AWS's, Tencent's (metadata.tencentyun.com is
# 169.254.0.23) and Alibaba's. Only these addresses: Tencent's private COS and DNS endpoints are
# link-local and private addresses too (COS "Private network access").
METADATA = ("169.254.169.254/32", "169.254.0.23/32", "100.100.100.200/32")

np = k8s.networking.v1


def _meta(name: str, namespace: pulumi.Input[str], labels: dict[str, str]) -> k8s.meta.v1.ObjectMetaArgs:
    return k8s.meta.v1.ObjectMetaArgs(name=name, namespace=namespace, labels=labels)


def _ports(*ports: tuple[str, int]) -> list[np.NetworkPolicyPortArgs]:
    return [np.NetworkPolicyPortArgs(protocol=proto, port=port) for proto, port in ports]


def namespace_baseline(name: str, namespace: pulumi.Input[str], labels: dict[str, str], opts: pulumi.ResourceOptions,
                       *, egress_out: bool = True, extra_egress: Sequence[str] = (),
                       same_namespace: bool = False) -> list[np.NetworkPolicy]:
    """Default deny for the namespace, DNS, and (egress_out) out to anywhere but the metadata
    services; `extra_egress` CIDRs too (EKS Pod Identity's agent, in the metadata range); same_namespace:
    the namespace's pods with each other (a team's own multi-node Jobs)."""
    every: dict[str, str] = {}
    made = [np.NetworkPolicy(f"{name}-default-deny", metadata=_meta("default-deny", namespace, labels),
                             spec=np.NetworkPolicySpecArgs(pod_selector=k8s.meta.v1.LabelSelectorArgs(match_labels=every),
                                                           policy_types=["Ingress", "Egress"]), opts=opts),
            np.NetworkPolicy(f"{name}-dns", metadata=_meta("allow-dns", namespace, labels),
                             spec=np.NetworkPolicySpecArgs(
                                 pod_selector=k8s.meta.v1.LabelSelectorArgs(match_labels=every), policy_types=["Egress"],
                                 egress=[np.NetworkPolicyEgressRuleArgs(
                                     to=[np.NetworkPolicyPeerArgs(namespace_selector=k8s.meta.v1.LabelSelectorArgs(
                                         match_labels={"kubernetes.io/metadata.name": "kube-system"}))],
                                     ports=_ports(("UDP", 53), ("TCP", 53)))]), opts=opts)]
    if same_namespace:
        own = [np.NetworkPolicyPeerArgs(pod_selector=k8s.meta.v1.LabelSelectorArgs(match_labels=every))]
        made.append(np.NetworkPolicy(f"{name}-same-namespace", metadata=_meta("allow-same-namespace", namespace, labels),
                                     spec=np.NetworkPolicySpecArgs(
                                         pod_selector=k8s.meta.v1.LabelSelectorArgs(match_labels=every),
                                         policy_types=["Ingress", "Egress"],
                                         ingress=[np.NetworkPolicyIngressRuleArgs(from_=own)],
                                         egress=[np.NetworkPolicyEgressRuleArgs(to=own)]), opts=opts))
    if egress_out:
        peers = [np.NetworkPolicyPeerArgs(ip_block=np.IPBlockArgs(
            cidr="0.0.0.0/0", except_=list(METADATA)))]
        peers += [np.NetworkPolicyPeerArgs(ip_block=np.IPBlockArgs(cidr=c)) for c in extra_egress]
        made.append(np.NetworkPolicy(f"{name}-egress-out", metadata=_meta("allow-egress-out", namespace, labels),
                                     spec=np.NetworkPolicySpecArgs(
                                         pod_selector=k8s.meta.v1.LabelSelectorArgs(match_labels=every),
                                         policy_types=["Egress"],
                                         egress=[np.NetworkPolicyEgressRuleArgs(to=peers)]),
                                     opts=opts))
    return made


def metrics_from_monitoring(name: str, namespace: pulumi.Input[str], selector: dict[str, str], port: int,
                            labels: dict[str, str], opts: pulumi.ResourceOptions) -> np.NetworkPolicy:
    """The metrics port of the selected pods, from the monitoring namespaces only."""
    return np.NetworkPolicy(f"{name}-metrics", metadata=_meta(f"{name}-metrics", namespace, labels),
                            spec=np.NetworkPolicySpecArgs(
                                pod_selector=k8s.meta.v1.LabelSelectorArgs(match_labels=selector),
                                policy_types=["Ingress"],
                                ingress=[np.NetworkPolicyIngressRuleArgs(
                                    from_=[np.NetworkPolicyPeerArgs(namespace_selector=k8s.meta.v1.LabelSelectorArgs(
                                        match_labels={MONITORING_LABEL: "true"}))],
                                    ports=_ports(("TCP", port)))]), opts=opts)


def job_policies(name: str, namespace: pulumi.Input[str], job_pods: dict[str, str], store_pods: dict[str, str] | None,
                 store_port: int, metrics_port: int, labels: dict[str, str],
                 opts: pulumi.ResourceOptions) -> list[np.NetworkPolicy]:
    """A Job's pods with each other and with their own store; the store from the Job's pods only."""
    peers = [np.NetworkPolicyPeerArgs(pod_selector=k8s.meta.v1.LabelSelectorArgs(match_labels=job_pods))]
    egress = [np.NetworkPolicyEgressRuleArgs(to=peers)]
    if store_pods is not None:
        egress.append(np.NetworkPolicyEgressRuleArgs(
            to=[np.NetworkPolicyPeerArgs(pod_selector=k8s.meta.v1.LabelSelectorArgs(match_labels=store_pods))],
            ports=_ports(("TCP", store_port))))
    made = [np.NetworkPolicy(f"{name}-peers", metadata=_meta(f"{name}-peers", namespace, labels),
                             spec=np.NetworkPolicySpecArgs(
                                 pod_selector=k8s.meta.v1.LabelSelectorArgs(match_labels=job_pods),
                                 policy_types=["Ingress", "Egress"],
                                 ingress=[np.NetworkPolicyIngressRuleArgs(from_=peers)], egress=egress), opts=opts),
            metrics_from_monitoring(name, namespace, job_pods, metrics_port, labels, opts)]
    if store_pods is not None:
        made.append(np.NetworkPolicy(f"{name}-rdzv", metadata=_meta(f"{name}-rdzv", namespace, labels),
                                     spec=np.NetworkPolicySpecArgs(
                                         pod_selector=k8s.meta.v1.LabelSelectorArgs(match_labels=store_pods),
                                         policy_types=["Ingress"],
                                         ingress=[np.NetworkPolicyIngressRuleArgs(from_=peers,
                                                                                  ports=_ports(("TCP", store_port)))]),
                                     opts=opts))
    return made


def pod_identity_egress(cloud: str) -> tuple[str, ...]:
    """What a pod's own identity needs in the metadata range (EKS Pod Identity's node agent on
    every node, link-local): the cloud's profile, infra/clouds/<cloud>/profile.py."""
    return profile(cloud).pod_identity_egress
