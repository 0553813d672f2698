"""Teams that share a cloud cannot reach each other's runs (issue 27): the clusters. Every
namespace the stack creates denies by default, a Job's rendezvous store admits that Job's pods
alone, each cluster enforces NetworkPolicy (EKS vpc-cni, ACK Terway, TKE's add-on), and TKE
Job pods assume their own CAM role while no namespace reaches the metadata service."""

from __future__ import annotations

from pathlib import Path

import pytest


# --- the plan: NetworkPolicies in every namespace the stack creates --------------------------------

def _policies(resources: list) -> list[dict]:  # type: ignore[type-arg]
    from infra.plan.engine import unwrap_secrets

    return [unwrap_secrets(r.inputs) for r in resources if r.type == "kubernetes:networking.k8s.io/v1:NetworkPolicy"]


@pytest.mark.parametrize("stack", ["prod"])  # dev has no cluster
def test_every_namespace_the_stack_creates_denies_by_default(stack: str) -> None:
    from infra.plan.engine import unwrap_secrets
    from infra.k8s.netpol import METADATA
    from tests.harness import shipped

    resources = list(shipped(stack))
    namespaces = {unwrap_secrets(r.inputs)["metadata"]["name"] for r in resources
                  if r.type == "kubernetes:core/v1:Namespace"}
    assert namespaces, "the shipped stack has clusters"
    policies = _policies(resources)
    for ns in namespaces:
        mine = [p for p in policies if p["metadata"]["namespace"] == ns]
        deny = [p for p in mine if p["spec"]["podSelector"].get("matchLabels", {}) == {}
                and sorted(p["spec"]["policyTypes"]) == ["Egress", "Ingress"]
                and not p["spec"].get("ingress") and not p["spec"].get("egress")]
        assert deny, f"namespace {ns} has no default-deny NetworkPolicy"
        # Nothing in it admits ingress from another namespace, but the monitoring namespaces.
        for p in mine:
            for rule in p["spec"].get("ingress") or []:
                for peer in rule.get("from") or []:
                    selector = peer.get("namespaceSelector")
                    assert selector is None or selector == {"matchLabels": {"gpu-training-stack/monitoring": "true"}}, p
                    assert "ipBlock" not in peer, p
    # Team namespaces never reach the metadata service (their node's role is the pool's, not theirs).
    teams = {unwrap_secrets(r.inputs)["metadata"]["name"] for r in resources if r.type == "kubernetes:core/v1:Namespace"
             and "gpu-training-stack/team" in (unwrap_secrets(r.inputs)["metadata"].get("labels") or {})}
    for p in policies:
        if p["metadata"]["namespace"] not in teams:
            continue
        for rule in p["spec"].get("egress") or []:
            for peer in rule.get("to") or []:
                block = peer.get("ipBlock")
                if block and block["cidr"] == "0.0.0.0/0":
                    assert set(METADATA) <= set(block.get("except") or []), p


def _two_node_jobs(values: dict) -> None:  # type: ignore[type-arg]
    from tests.harness import key

    values[key("kubernetes")].pop("queues", None)  # the shared queues' quotas are sized for one-node Jobs
    for g in values[key("nodeGroups")]:
        if g.get("kind") == "kubernetes" and g.get("workload", "training") == "training":
            g["scaling"] = {**g["scaling"], "desired": 2, "max": max(2, g["scaling"]["max"])}


def test_a_jobs_store_admits_that_jobs_pods_alone(tmp_path: Path) -> None:
    from infra.plan.engine import unwrap_secrets
    from infra.rendezvous import PORT
    from tests.harness import run_stack

    resources = run_stack("prod", _two_node_jobs, tmp_path)
    stores = [unwrap_secrets(r.inputs) for r in resources if r.type == "kubernetes:apps/v1:Deployment"
              and r.name.endswith("-rdzv-deploy")]
    assert stores, "prod has multi-node Jobs"
    policies = _policies(resources)
    for store in stores:
        name = store["metadata"]["name"]
        job = name.removesuffix("-rdzv")
        container = store["spec"]["template"]["spec"]["containers"][0]
        assert container["command"][container["command"].index("--host") + 1] == "$(POD_IP)"
        guarding = [p for p in policies if p["spec"]["podSelector"].get("matchLabels") == {"app.kubernetes.io/name": name}]
        assert len(guarding) == 1, guarding
        (rule,) = guarding[0]["spec"]["ingress"]
        assert rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": job}}}]
        assert rule["ports"] == [{"protocol": "TCP", "port": PORT}]
    # Each multi-node Job's pods get their own key from a Secret.
    for r in resources:
        if r.type == "kubernetes:batch/v1:Job" and r.name.removesuffix("-job") + "-rdzv" in {s["metadata"]["name"] for s in stores}:
            env = unwrap_secrets(r.inputs)["spec"]["template"]["spec"]["containers"][0]["env"]
            (key,) = [e for e in env if e["name"] == "RDZV_KEY"]
            assert key["valueFrom"]["secretKeyRef"]["name"] == r.name.removesuffix("-job") + "-rdzv-key"


def test_each_cluster_enforces_network_policy() -> None:
    import json

    from infra.plan.engine import unwrap_secrets
    from tests.harness import shipped

    resources = list(shipped("prod"))
    cni = [unwrap_secrets(r.inputs) for r in resources if r.type == "aws:eks/addon:Addon"
           and unwrap_secrets(r.inputs)["addonName"] == "vpc-cni"]
    assert cni and all(json.loads(a["configurationValues"]) == {"enableNetworkPolicy": "true"} for a in cni)
    tke = [r for r in resources if r.type == "tencentcloud:Kubernetes/addon:Addon"]
    assert [unwrap_secrets(r.inputs)["addonName"] for r in tke] == ["networkpolicy"]


def test_ack_runs_terway_with_network_policy_on_its_own_pod_switches() -> None:
    """ACK enforces NetworkPolicy with Terway only; the plugin is chosen at creation, with pod
    vSwitches of its own in the nodes' zones, apart from the nodes' vSwitches."""
    import ipaddress
    import json

    from infra.plan.engine import unwrap_secrets
    from tests.harness import shipped

    resources = list(shipped("prod"))
    clusters = [unwrap_secrets(r.inputs) for r in resources if r.type == "alicloud:cs/managedKubernetes:ManagedKubernetes"]
    assert clusters
    switches = {r.name: unwrap_secrets(r.inputs) for r in resources if r.type == "alicloud:vpc/switch:Switch"}
    for c in clusters:
        (addon,) = c["addons"]
        assert addon["name"] == "terway-eniip" and json.loads(addon["config"])["NetworkPolicy"] == "true"
        assert "podCidr" not in c and c["podVswitchIds"]
        pods = [switches[i.removesuffix("-id")] for i in c["podVswitchIds"]]
        nodes = [switches[i.removesuffix("-id")] for i in c["vswitchIds"]]
        assert sorted(p["zoneId"] for p in pods) == sorted(n["zoneId"] for n in nodes)
        for p in pods:
            assert not any(ipaddress.ip_network(p["cidrBlock"]).overlaps(ipaddress.ip_network(n["cidrBlock"]))
                           for n in nodes), (p, nodes)
    # No Flannel pod range is admitted anywhere on Alibaba any more.
    for r in resources:
        if r.type == "alicloud:ecs/securityGroupRule:SecurityGroupRule":
            assert unwrap_secrets(r.inputs).get("cidrIp") != "172.20.0.0/16", r.name


# --- TKE pod identity: the training namespace's pods hold their own CAM role ------------------------

def test_tke_job_pods_assume_their_own_role_and_no_namespace_reaches_the_metadata_service() -> None:
    import json

    from infra.k8s.netpol import METADATA
    from infra.plan.engine import unwrap_secrets
    from tests.harness import shipped

    resources = list(shipped("prod"))
    values = {r.urn: unwrap_secrets(r.inputs) for r in resources}
    (oidc,) = [r for r in resources if r.type == "tencentcloud:Kubernetes/authAttachment:AuthAttachment"]
    attach = values[oidc.urn]
    assert attach["autoCreateOidcConfig"] and attach["autoInstallPodIdentityWebhookAddon"] and attach["useTkeDefault"]
    cluster_id = attach["clusterId"]
    # The TKE cluster's provider (and so its Jobs) waits for the webhook.
    (provider,) = [r for r in resources if r.type == "pulumi:providers:kubernetes" and r.name.startswith("prod-tc-")]
    assert oidc.urn in provider.options["dependencies"], provider.options
    roles = {values[r.urn]["name"]: r for r in resources if r.type == "tencentcloud:Cam/role:Role"}
    jobs = [r for r in resources if r.type == "kubernetes:batch/v1:Job" and r.name.startswith("tc-")]
    assert jobs, "prod has a TKE training Job"
    for job in jobs:
        pod = values[job.urn]["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["STORAGE_CREDENTIALS"] == "tke-pod-identity", env
        (account,) = [values[r.urn] for r in resources if r.type == "kubernetes:core/v1:ServiceAccount"
                      and values[r.urn]["metadata"]["name"] == pod["serviceAccountName"]]
        ns, sa = account["metadata"]["namespace"], account["metadata"]["name"]
        arn = account["metadata"]["annotations"]["tke.cloud.tencent.com/role-arn"]
        uin, role_name = arn.removeprefix("qcs::cam::uin/").split(":roleName/")
        role = roles[role_name]
        (statement,) = json.loads(values[role.urn]["document"])["statement"]
        assert statement["action"] == ["name/sts:AssumeRoleWithWebIdentity"]
        assert statement["principal"] == {"federated": [f"qcs::cam::uin/{uin}:oidc-provider/{cluster_id}"]}
        assert statement["condition"] == {"string_equal": {"oidc:aud": ["sts.cloud.tencent.com"],
                                                           "oidc:sub": [f"system:serviceaccount:{ns}:{sa}"]}}
        assert oidc.urn in role.options["dependencies"]
        # The role's policy: the group's own checkpoints to write, nothing of another group's.
        group = job.name.removesuffix("-job")
        (policy,) = [values[r.urn] for r in resources if r.type == "tencentcloud:Cam/policy:Policy"
                     and values[r.urn]["name"] == f"{role_name}-bucket"]
        written = [res for s in json.loads(policy["document"])["statement"] if "name/cos:PutObject" in s["action"]
                   for res in s["resource"]]
        assert written and all(res.endswith(f"/checkpoints/{group}/*") for res in written), written
    # No namespace the stack creates on any cluster reaches the metadata services now: every
    # egress to 0.0.0.0/0 excepts them.
    wide = [(p["metadata"]["namespace"], peer["ipBlock"]) for p in _policies(resources)
            for rule in p["spec"].get("egress") or [] for peer in rule.get("to") or []
            if (peer.get("ipBlock") or {}).get("cidr") == "0.0.0.0/0"]
    assert {ns for ns, _ in wide} >= {"training"}
    assert all(set(METADATA) <= set(block.get("except") or []) for _, block in wide), wide
