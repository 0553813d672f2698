"""Issue 41: Kueue's quota cannot be skipped on the shared clusters (EKS, ACK, TKE).

Before, a Job without `kueue.x-k8s.io/queue-name` in a team's namespace was managed by nobody
and run at once (Kueue's `manageJobsWithoutQueueName` defaults to false), and nothing else capped
a team's GPUs. No Kubernetes API server or Kueue controller runs here (both are binaries fetched
from registries this workplace cannot reach: registry.k8s.io, the envtest downloads), so the
policy's rule is evaluated by a real CEL implementation (the `common-expression-language`
package) on the plan's own Jobs and on the Jobs a team member could write, and the rest is read
on the plan."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

VAP = "kubernetes:admissionregistration.k8s.io/v1:ValidatingAdmissionPolicy"
BINDING = "kubernetes:admissionregistration.k8s.io/v1:ValidatingAdmissionPolicyBinding"


@pytest.fixture(scope="module")
def prod() -> list[Any]:
    from infra.plan.engine import unwrap_secrets
    from tests.harness import shipped

    return [(r.type, r.name, unwrap_secrets(r.inputs)) for r in shipped("prod")]


def admitted(expression: str, job: dict[str, Any]) -> bool:
    import cel  # common-expression-language: CEL as the API server evaluates it

    return bool(cel.evaluate(expression, {"object": job}))


def test_every_shared_cluster_has_kueue_manage_unlabelled_jobs(prod: list[Any]) -> None:
    releases = [i for t, _, i in prod if t == "kubernetes:helm.sh/v3:Release" and i.get("name") == "kueue"]
    assert len(releases) == 3, "EKS, ACK and TKE"
    for release in releases:
        config = yaml.safe_load(release["values"]["managerConfig"]["controllerManagerConfigYaml"])
        assert config["manageJobsWithoutQueueName"] is True
        assert config["managedJobsNamespaceSelector"] == {"matchLabels": {"gpu-training-stack/queues": "true"}}


def test_a_job_without_a_queue_is_refused_and_the_plans_own_jobs_pass(prod: list[Any]) -> None:
    policies = [i for t, _, i in prod if t == VAP]
    bindings = [i for t, _, i in prod if t == BINDING]
    assert len(policies) == len(bindings) == 3
    for policy, binding in zip(policies, bindings):
        assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
        spec = policy["spec"]
        assert spec["failurePolicy"] == "Fail"
        assert spec["matchConstraints"]["namespaceSelector"] == {"matchLabels": {"gpu-training-stack/queues": "true"}}
        assert spec["matchConstraints"]["resourceRules"] == [
            {"apiGroups": ["batch"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["jobs"]}]
        [rule] = spec["validations"]
        expression = rule["expression"]
        jobs = [i for t, _, i in prod if t == "kubernetes:batch/v1:Job"]
        assert jobs and all(admitted(expression, job) for job in jobs), "the stack's own Jobs name their queue"
        hostile: dict[str, Any]
        for hostile in ({"metadata": {"name": "skip"}}, {"metadata": {"labels": {}}},
                        {"metadata": {"labels": {"app": "x"}}},
                        {"metadata": {"labels": {"kueue.x-k8s.io/queue-name": ""}}}):
            assert not admitted(expression, hostile), hostile
        assert "kueue.x-k8s.io/queue-name" in rule["message"]


def test_each_team_namespace_has_a_gpu_quota_of_what_its_queue_may_be_admitted(prod: list[Any]) -> None:
    from infra.teams.registry import load
    from tests.harness import ROOT

    registry = load(ROOT)
    quotas = {(i["metadata"]["namespace"], n.split("-")[1]): i for t, n, i in prod if t == "kubernetes:core/v1:ResourceQuota"}
    shared = [team for team in registry.teams if team.placement == "shared"]
    expected = {}
    for team in shared:
        for cloud, models in team.gpus.items():
            short = {"aws": "aws", "alicloud": "ali", "tencentcloud": "tc"}[cloud]
            expected[(f"team-{team.name}", short)] = sum(models.values())
    assert set(quotas) == set(expected), (sorted(quotas), sorted(expected))
    for where, quota in quotas.items():
        gpus = int(quota["spec"]["hard"]["requests.nvidia.com/gpu"])
        assert gpus >= expected[where], (where, gpus)
        team = next(t for t in shared if f"team-{t.name}" == where[0])
        if not team.borrowing:
            assert gpus == expected[where], (where, gpus)
