"""What the tenancy tests (issue 27) and the scrape tests share: reading the security groups a
planned resource gives its nodes, and the ingress rules the plan puts on a security group, the
same way on AWS, Alibaba and Tencent."""

from __future__ import annotations


FLEET_GROUPS = ("vpcSecurityGroupIds", "securityGroupIds", "securityGroups", "orderlySecurityGroups")


def fleet_groups(inputs: dict) -> list:  # type: ignore[type-arg]
    """The security groups a node-starting resource gives its nodes: at its top level, or on each of
    its network interfaces (an EFA launch template carries them on the interfaces only, issue 30)."""
    found = [g for k in FLEET_GROUPS for g in (inputs.get(k) or [])]
    for nic in inputs.get("networkInterfaces") or []:
        found += [g for k in FLEET_GROUPS for g in (nic.get(k) or [])]
    return list(dict.fromkeys(found))


def ingress_rules(resources: list, group_id: str) -> list[dict]:  # type: ignore[type-arg]
    """Every ingress rule the plan puts on a security group, as {source, cidr, port}."""
    from infra.plan.engine import unwrap_secrets

    found = []
    for r in resources:
        i = unwrap_secrets(r.inputs)
        if i.get("securityGroupId") != group_id:
            continue
        if r.type == "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule":
            found.append({"source": i.get("referencedSecurityGroupId"), "cidr": i.get("cidrIpv4") or i.get("cidrIpv6"),
                          "port": (i.get("fromPort"), i.get("toPort")), "protocol": i.get("ipProtocol")})
        elif r.type == "alicloud:ecs/securityGroupRule:SecurityGroupRule" and i.get("type") == "ingress":
            found.append({"source": i.get("sourceSecurityGroupId"), "cidr": i.get("cidrIp"),
                          "port": i.get("portRange"), "protocol": i.get("ipProtocol")})
        elif r.type == "tencentcloud:Security/groupRuleSet:GroupRuleSet":
            found += [{"source": x.get("sourceSecurityId"), "cidr": x.get("cidrBlock"), "port": x.get("port"),
                       "protocol": x.get("protocol")} for x in i.get("ingresses") or []]
        elif "Ingress" in r.type or "ingress" in str(i.get("type")):
            found.append({"unknown": r.type})
    return found
