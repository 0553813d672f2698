"""Teams that share a cloud cannot reach each other's runs (issue 27): the plan's rendezvous
stores. Each store's security group admits its own group's nodes and nothing else; an AWS store
sits in its subnet's reserved range; Alibaba and Tencent stores sit in a vSwitch / subnet of
their own, clear of every other range, with egress; a network with no room for them is refused."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tenancy_helpers import fleet_groups, ingress_rules
from tests.training_helpers import ROOT


# --- the plan: each store admits its own group's nodes and nothing else ---------------------------

STORES = {"aws": "aws:ec2/instance:Instance", "alicloud": "alicloud:ecs/instance:Instance",
          "tencentcloud": "tencentcloud:Instance/instance:Instance"}
STORE_GROUPS = {"aws": "vpcSecurityGroupIds", "alicloud": "securityGroups", "tencentcloud": "orderlySecurityGroups"}
IMAGE_FIELD = {"aws": "ami", "alicloud": "imageId", "tencentcloud": "imageId"}


@pytest.mark.parametrize("stack", ["prod", "dev"])
def test_each_store_admits_its_own_groups_nodes_and_nothing_else(stack: str) -> None:
    from infra.plan.engine import unwrap_secrets
    from infra.rendezvous import PORT
    from tests.harness import shipped

    resources = list(shipped(stack))
    stores = [r for r in resources if r.type in STORES.values() and "-rdzv-" in r.name]
    assert stores, "the shipped stack has multi-node VM groups, so it has stores"
    for store in stores:
        cloud = store.type.split(":")[0]
        group = store.name.split("-rdzv-", 1)[1]
        own = unwrap_secrets(store.inputs)[STORE_GROUPS[cloud]]
        assert own == [f"{store.name}-sg-id"], (store.name, own)  # its own group alone: no training/peer/pod rules
        clients = f"{store.name}-clients-id"
        rules = ingress_rules(resources, own[0])
        port = {"aws": (PORT, PORT), "alicloud": f"{PORT}/{PORT}", "tencentcloud": str(PORT)}[cloud]
        assert rules == [{"source": clients, "cidr": None, "port": port, "protocol": rules[0]["protocol"]}], rules
        assert str(rules[0]["protocol"]).lower() == "tcp"
        carriers = {r.name for r in resources if r is not store and clients in fleet_groups(unwrap_secrets(r.inputs))}
        assert carriers and all(name.startswith(group) for name in carriers), (store.name, carriers)
        # A routine `up` never replaces or re-installs it for a newer image.
        assert IMAGE_FIELD[cloud] in store.options["ignoreChanges"], store.options
    # Every multi-node VM group's nodes carry exactly their own store's client group.
    for r in resources:
        held = [g for g in fleet_groups(unwrap_secrets(r.inputs)) if str(g).endswith("-clients-id")]
        owners = [g.split("-rdzv-", 1)[1].removesuffix("-clients-id") for g in held]
        assert len(held) <= 1 and all(r.name.startswith(f"{o}-") for o in owners), (r.name, held)


def test_a_stores_address_is_in_its_reserved_range_and_the_group_holds_the_key(tmp_path: Path) -> None:
    """The node's user data names its store and where its key is kept (issue 41: never the key,
    which DescribeLaunchTemplateVersions would show to anyone with read access to the account)."""
    import ipaddress
    import json

    from infra.plan.engine import unwrap_secrets
    from infra.userdata import RDZV_KEY, RDZV_KEY_REF
    from tests.harness import shipped
    from tests.nodes import lay_down, node_env

    resources = list(shipped("prod"))
    (reservation,) = [r for r in resources if r.type == "aws:ec2/subnetCidrReservation:SubnetCidrReservation"]
    assert reservation.inputs["reservationType"] == "explicit"
    (store,) = [r for r in resources if r.type == STORES["aws"] and "-rdzv-" in r.name]
    assert ipaddress.ip_address(store.inputs["privateIp"]) in ipaddress.ip_network(reservation.inputs["cidrBlock"])
    assert store.options["dependencies"] and any(reservation.urn == d for d in store.options["dependencies"])
    (template,) = [r for r in resources if r.type == "aws:ec2/launchTemplate:LaunchTemplate" and r.name == "aws-train-lt"]
    root = tmp_path / "node"
    lay_down(base64.b64decode(unwrap_secrets(template.inputs["userData"])), root)
    env = node_env(root)
    assert RDZV_KEY not in env and env["RDZV_ENDPOINT"] == f"{store.inputs['privateIp']}:29400"
    (parameter,) = [r for r in resources if r.type == "aws:ssm/parameter:Parameter"]
    assert env[RDZV_KEY_REF] == parameter.inputs["name"] and parameter.inputs["type"] == "SecureString"
    # In the region the node asks (its bucket's: gts-rdzv-key.py calls SSM in STORAGE_REGION).
    assert f"-{env['STORAGE_REGION']}::" in parameter.provider, (parameter.provider, env["STORAGE_REGION"])
    assert not isinstance(parameter.inputs["value"], str), "the key is a secret in the state"
    key = unwrap_secrets(parameter.inputs["value"])
    # The node's key reader takes it; and it is in no node's user data or launch settings.
    from training.node import rdzv_launch

    assert rdzv_launch.run_key({RDZV_KEY: key}) == key.encode()
    for r in resources:
        if r.type in ("aws:ssm/parameter:Parameter", "random:index/randomPassword:RandomPassword") or \
                r.type.endswith(("ssm/secretVersion:SecretVersion", "oos/secretParameter:SecretParameter")):
            continue
        text = json.dumps(unwrap_secrets(r.inputs), default=str)
        decoded = [base64.b64decode(v).decode(errors="replace") for k, v in unwrap_secrets(r.inputs).items()
                   if k in ("userData", "userDataBase64", "userDataRaw") and isinstance(v, str)]
        assert key not in text and not any(key in d for d in decoded), r.name


def test_every_aws_store_of_a_network_waits_for_the_networks_reservation(tmp_path: Path) -> None:
    """Two multi-node groups in one AWS network: one reservation, held by the network (as the
    other clouds' networks hold their stores' vSwitch / subnet), and each store created after it."""
    import ipaddress

    from tests.harness import key, run_stack

    def edit(values: dict) -> None:  # type: ignore[type-arg]
        twin = next(dict(g) for g in values[key("nodeGroups")] if g["name"] == "aws-train")
        twin["name"] = "aws-train-b"
        values[key("nodeGroups")].append(twin)
        values[key("budget")]["monthlyLimitUsd"] = 1_000_000

    resources = run_stack("prod", edit, tmp_path)
    (reservation,) = [r for r in resources if r.type == "aws:ec2/subnetCidrReservation:SubnetCidrReservation"]
    assert reservation.parent.endswith("gpu-training-stack:aws:Network::aws-train"), reservation.parent
    stores = [r for r in resources if r.type == STORES["aws"] and "-rdzv-" in r.name]
    assert len(stores) == 2
    for store in stores:
        assert reservation.urn in store.options["dependencies"], store.name
        assert ipaddress.ip_address(store.inputs["privateIp"]) in ipaddress.ip_network(reservation.inputs["cidrBlock"])


# --- the plan: Alibaba and Tencent stores in a vSwitch / subnet of their own -----------------------

OWN_SUBNETS = {"alicloud": ("alicloud:vpc/switch:Switch", "vswitchId", "zoneId"),
               "tencentcloud": ("tencentcloud:Subnet/instance:Instance", "subnetId", "availabilityZone")}
VPCS = {"alicloud": "alicloud:vpc/network:Network", "tencentcloud": "tencentcloud:Vpc/instance:Instance"}


def _mentions(value: object, needle: str) -> bool:
    if isinstance(value, dict):
        return any(_mentions(v, needle) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_mentions(v, needle) for v in value)
    return value == needle


def _egress(resources: list, cloud: str, own: dict, vpc_id: str) -> bool:  # type: ignore[type-arg]
    """The store's vSwitch has an SNAT entry on its VPC's NAT (Alibaba); its subnet is on a
    route table whose default route goes to a NAT gateway (Tencent)."""
    from infra.plan.engine import unwrap_secrets

    ins = [unwrap_secrets(r.inputs) | {"_name": r.name, "_type": r.type} for r in resources]
    if cloud == "alicloud":
        nats = {f"{i['_name']}-id" for i in ins if i["_type"] == "alicloud:vpc/natGateway:NatGateway"
                and i.get("vpcId") == vpc_id}
        snat = [i for i in ins if i["_type"] == "alicloud:vpc/snatEntry:SnatEntry"
                and i.get("sourceVswitchId") == f"{own['_name']}-id"]
        return len(snat) == 1 and bool(nats) and bool(snat[0].get("snatIp"))
    routes = [i for i in ins if i["_type"] == "tencentcloud:Route/tableEntry:TableEntry"
              and i.get("routeTableId") == own.get("routeTableId") and i.get("destinationCidrBlock") == "0.0.0.0/0"]
    nats = {f"{i['_name']}-id" for i in ins if i["_type"] == "tencentcloud:Nat/gateway:Gateway"
            and i.get("vpcId") == vpc_id}
    return len(routes) == 1 and routes[0].get("nextType") == "NAT" and routes[0].get("nextHub") in nats


@pytest.mark.parametrize("stack", ["prod", "dev"])
def test_alibaba_and_tencent_stores_sit_in_a_vswitch_or_subnet_nothing_else_takes(stack: str) -> None:
    import ipaddress

    from infra.checks.cloud_rules import POD_CIDR, SERVICE_CIDR
    from infra.plan.engine import unwrap_secrets
    from tests.harness import shipped

    resources = list(shipped(stack))
    stores = [r for r in resources if r.type in (STORES["alicloud"], STORES["tencentcloud"]) and "-rdzv-" in r.name]
    assert {s.type.split(":")[0] for s in stores} == {"alicloud", "tencentcloud"}, [s.name for s in stores]
    store_names = {s.name for s in stores}
    for store in stores:
        cloud = store.type.split(":")[0]
        kind, field, zone_key = OWN_SUBNETS[cloud]
        inputs = unwrap_secrets(store.inputs)
        own_id = inputs[field]
        (own,) = [unwrap_secrets(r.inputs) | {"_name": r.name} for r in resources
                  if r.type == kind and f"{r.name}-id" == own_id]
        # Its own: nothing but the network's stores (and, on Alibaba, their SNAT entry) names it.
        named_by = {r.name for r in resources if _mentions(unwrap_secrets(r.inputs), own_id)}
        snat = {r.name for r in resources if r.type == "alicloud:vpc/snatEntry:SnatEntry"}
        assert named_by and named_by <= store_names | snat, (store.name, named_by - store_names)
        assert store.name in named_by
        # Apart: inside its VPC, clear of every other vSwitch / subnet there (nodes, Terway's pods)
        # and of the clusters' pod and service ranges.
        block = ipaddress.IPv4Network(own["cidrBlock"])
        (vpc,) = [unwrap_secrets(r.inputs) for r in resources if r.type == VPCS[cloud] and f"{r.name}-id" == own["vpcId"]]
        assert block.subnet_of(ipaddress.IPv4Network(vpc["cidrBlock"])), (block, vpc["cidrBlock"])
        others = [(r.name, ipaddress.ip_network(unwrap_secrets(r.inputs)["cidrBlock"])) for r in resources
                  if r.type == kind and r.name != own["_name"] and unwrap_secrets(r.inputs).get("vpcId") == own["vpcId"]]
        assert others, "a network with a store has subnets of its own"
        assert not [name for name, c in others if c.overlaps(block)], (block, others)
        assert not block.overlaps(POD_CIDR) and not block.overlaps(SERVICE_CIDR)
        # The store's address inside it, clear of the addresses the cloud keeps (first, last three).
        at = ipaddress.IPv4Address(inputs["privateIp"])
        assert block.network_address + 1 <= at <= block.broadcast_address - 3, (at, block)
        # In the zone of the network's first subnet (the zone the store instance names).
        first = min(others, key=lambda nc: nc[1])[0]
        first_zone = next(unwrap_secrets(r.inputs)[zone_key] for r in resources if r.type == kind and r.name == first)
        assert own[zone_key] == first_zone
        if cloud == "tencentcloud":
            assert inputs["availabilityZone"] == own[zone_key]
        # Egress: it pulls the trainer image.
        assert _egress(resources, cloud, own, own["vpcId"]), (store.name, own["_name"])
    # AWS keeps its stores in the first subnet's explicit reservation: no subnet of their own.
    assert not [r.name for r in resources if r.type == "aws:ec2/subnet:Subnet" and r.name.endswith("-stores")]


def test_a_store_takes_the_vswitch_it_shares_with_nobody_and_its_nodes_name_it() -> None:
    """The spec side: own_subnet lays the stores' range out clear of the subnets and the ACK pod
    vSwitches, and each VM group's RDZV_ENDPOINT is its store's address there."""
    import ipaddress

    from infra import rendezvous
    from infra.clouds.alicloud.network import pod_switch_cidr
    from infra.resolve.groups import resolve
    from tests.harness import parse_spec
    from tests.harness import spec_raw, stack_values

    spec = parse_spec(spec_raw(stack_values("prod")))
    stack = resolve(spec)
    sites = {s.group: s for s in rendezvous.sites(spec, stack.groups)}
    for rg in stack.groups:
        endpoint = rendezvous.endpoint_for(spec, rg)
        if not rendezvous.multi_node_vm(rg):
            assert endpoint == ""
            continue
        site = sites[rg.name]
        assert endpoint == site.endpoint
        net = spec.network(rg.network)
        if net.cloud == "aws":
            assert site.subnet == "" and site.address == rendezvous.address(str(net.subnets[0].cidr), 0)
            continue
        block = ipaddress.ip_network(site.subnet)
        pods = [ipaddress.ip_network(pod_switch_cidr(net, i)) for i in range(len(net.subnets))] \
            if any(g.network == net.name and g.kind == "kubernetes" for g in spec.node_groups) else []
        assert not any(block.overlaps(c) for c in [*(s.cidr for s in net.subnets), *pods]), (block, pods)
        assert ipaddress.ip_address(site.address) in block and site.zone == net.subnets[0].zone


def _filled(values: dict, name: str) -> int:  # type: ignore[type-arg]
    """Give network `name` two subnets that fill its VPC; returns its index."""
    import ipaddress

    from tests.harness import key

    nets = values[key("networks")]
    i = next(k for k, n in enumerate(nets) if n["name"] == name)
    vpc = nets[i]["cidr"]
    halves = list(ipaddress.ip_network(vpc).subnets(prefixlen_diff=1))
    nets[i]["subnets"] = [{"zone": s["zone"], "cidr": str(h)} for s, h in zip(nets[i]["subnets"], halves)]
    return i


@pytest.mark.parametrize("network, word", [("ali-train", "vSwitch"), ("tc-train", "subnet")])
def test_a_network_with_no_free_range_for_its_stores_is_refused(network: str, word: str) -> None:
    from infra.core.errors import SpecError
    from tests.harness import parse_spec
    from tests.harness import spec_raw, stack_values

    values = stack_values("prod")
    i = _filled(values, network)
    with pytest.raises(SpecError) as err:
        parse_spec(spec_raw(values))
    text = str(err.value)
    assert f"networks[{i}].cidr" in text and network in text and f"stores' own {word}" in text, text
    assert "shrink a subnet or widen" in text


def test_a_network_without_room_for_its_stores_exits_2_from_the_plan(tmp_path: Path) -> None:
    from tests.harness import project_copy, stack_values, write_stack

    values = stack_values("prod")
    i = _filled(values, "ali-train")
    proj = project_copy(tmp_path)
    (proj / "Pulumi.prod.yaml").write_text((ROOT / "Pulumi.prod.yaml").read_text())  # teams.yaml's base stack
    write_stack(proj, "full", values)
    proc = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.argv=['plan','--stack','full','--format',"
                           "'json']; runpy.run_module('infra.plan', run_name='__main__')"], cwd=proj,
                          capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(proj), "PATH": "/usr/bin:/bin", "GTS_TODAY": os.environ["GTS_TODAY"]})
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stderr[-2000:])
    assert f"networks[{i}].cidr" in proc.stderr and "ali-train" in proc.stderr and "Traceback" not in proc.stderr


def test_more_stores_than_their_range_holds_is_refused() -> None:
    from infra import rendezvous
    from infra.core.errors import SpecError
    from tests.harness import parse_spec
    from tests.harness import key, spec_raw, stack_values

    values = stack_values("prod")
    groups = values[key("nodeGroups")]
    base = next(g for g in groups if g["name"] == "tc-train")
    groups += [dict(base, name=f"tc-extra{k}") for k in range(rendezvous.OWN_SUBNET_STORES)]
    values[key("budget")]["monthlyLimitUsd"] = 100_000_000
    with pytest.raises(SpecError, match=rf"tc-train holds {rendezvous.OWN_SUBNET_STORES + 1} multi-node VM groups"):
        parse_spec(spec_raw(values))
