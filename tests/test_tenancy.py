"""Teams that share a cloud cannot reach each other's runs (issue 27).

The rendezvous store: the exploit (a pickled payload written under a run's id, which anyone
can compute from the stack file, and which torch's agents unpickle) on loopback with our own
store and entrypoint; the plan's rules around each store admit exactly its group."""

from __future__ import annotations

import base64
import hashlib
import os
import pickle
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from tests.training_helpers import BIN, ROOT, Run, free_port, kill_tree, retry_until, wait_port

KEY = "k" * 48


class Payload:
    """What an attacker writes: unpickling it runs a command (here: creates a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def run_id(group: str, checkpoint_url: str, steps: str) -> str:
    """The run's rendezvous id as training/node/entrypoint.sh computes it (from the stack's values)."""
    digest = hashlib.sha256(f"{checkpoint_url} {steps}".encode()).hexdigest()[:12]
    return f"{group}-{digest}"


def poison(port: int, rdzv_id: str, marker: Path) -> None:
    """Write the payload as the rendezvous state of `rdzv_id`, as torch's c10d backend stores it."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    client.set(f"torch.rendezvous.{rdzv_id}", base64.b64encode(pickle.dumps(Payload(marker))).decode())


def store(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "training.node.rdzv_store", "--host", "127.0.0.1", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port)
    return proc


def node_env(port: int, tmp: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "LAUNCHER": "torchrun", "NNODES": "2", "MIN_NNODES": "2", "NPROC_PER_NODE": "1",
            "RDZV_ENDPOINT": f"127.0.0.1:{port}", "GTS_NODE_GROUP": "victim",
            "CHECKPOINT_URL": f"file://{tmp}/ckpt/", "TRAIN_STEPS": "50", "CHECKPOINT_DIR": str(tmp / "local"),
            **extra}


def test_a_poisoned_rendezvous_state_never_runs_in_a_node(tmp_path: Path) -> None:
    """The entrypoint's agent reads the payload, refuses it unread (no signature under the
    group's key) and stops; the payload never runs."""
    port = free_port()
    server = store(port)
    marker = tmp_path / "pwned"
    try:
        env = node_env(port, tmp_path, RDZV_KEY=KEY)
        poison(port, run_id("victim", env["CHECKPOINT_URL"], env["TRAIN_STEPS"]), marker)
        node = Run(subprocess.Popen(["bash", str(ROOT / "training/node/entrypoint.sh"), "--workload", "tiny"], env=env,
                                    cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        node.start_reader()
        try:
            assert node.finish(timeout=180) != 0, node.output[-3000:]
        finally:
            if node.proc.poll() is None:
                kill_tree(node.proc.pid)
        assert "not signed with this run's key" in node.output, node.output[-3000:]
        assert not marker.exists()
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_the_same_payload_runs_in_an_unsigned_torchrun_agent(tmp_path: Path) -> None:
    """The exploit is real: torch's own c10d backend (what the entrypoint ran before) unpickles
    the payload in the agent."""
    port = free_port()
    server = store(port)
    marker = tmp_path / "pwned"
    agent = None
    try:
        poison(port, "victim-run", marker)
        agent = subprocess.Popen([str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
                                  "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                                  "--rdzv-id", "victim-run", "--rdzv-conf", "is_host=false",
                                  "-m", "training.trainer.train"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert retry_until(marker.exists, timeout=120), "the unsigned agent did not run the payload"
    finally:
        if agent is not None and agent.poll() is None:
            kill_tree(agent.pid)
            agent.wait(timeout=30)
        server.terminate()
        server.wait(timeout=10)


def test_a_state_signed_with_another_groups_key_is_refused(tmp_path: Path) -> None:
    """A group's nodes cannot write a state another group's agents accept: the signature is
    under the writer's key and the run's id."""
    from torch.distributed import FileStore  # type: ignore[attr-defined]
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError

    from training.node.rdzv_launch import SignedC10dBackend

    shared = FileStore(str(tmp_path / "store"), -1)
    theirs = SignedC10dBackend(shared, "run-a", b"a" * 48)
    ours = SignedC10dBackend(shared, "run-a", b"b" * 48)
    written = theirs.set_state(pickle.dumps({"round": 1}))
    assert written is not None and written[2]
    with pytest.raises(RendezvousStateError, match="not signed"):
        ours.get_state()
    # The same key under another run's id is refused too (no replay across runs).
    other_run = SignedC10dBackend(shared, "run-b", b"a" * 48)
    shared.set("torch.rendezvous.run-b", shared.get("torch.rendezvous.run-a").decode())
    with pytest.raises(RendezvousStateError, match="not signed"):
        other_run.get_state()
    assert theirs.get_state() is not None


def test_a_multi_node_run_without_a_key_never_starts(tmp_path: Path) -> None:
    port = free_port()
    env = node_env(port, tmp_path)
    env.pop("RDZV_KEY", None)
    proc = subprocess.run(["bash", str(ROOT / "training/node/entrypoint.sh")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "RDZV_KEY" in proc.stderr, proc.stderr[-2000:]


def test_the_store_listens_on_its_address_alone() -> None:
    """Bound to the address it is given (the instance's private address), not the wildcard that
    TCPStore's own server takes whatever host it is told."""
    port = free_port()
    server = store(port)
    try:
        listening = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True,
                                   check=True).stdout.split()
        assert f"127.0.0.1:{port}" in listening and f"*:{port}" not in listening, listening
    finally:
        server.terminate()
        server.wait(timeout=10)


# --- the plan: each store admits its own group's nodes and nothing else ---------------------------

STORES = {"aws": "aws:ec2/instance:Instance", "alicloud": "alicloud:ecs/instance:Instance",
          "tencentcloud": "tencentcloud:Instance/instance:Instance"}
STORE_GROUPS = {"aws": "vpcSecurityGroupIds", "alicloud": "securityGroups", "tencentcloud": "orderlySecurityGroups"}
IMAGE_FIELD = {"aws": "ami", "alicloud": "imageId", "tencentcloud": "imageId"}
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
    import ipaddress

    from infra.plan.engine import unwrap_secrets
    from infra.userdata import RDZV_KEY
    from tests.harness import shipped
    from tests.nodes import lay_down, node_env

    resources = list(shipped("prod"))
    (reservation,) = [r for r in resources if r.type == "aws:ec2/subnetCidrReservation:SubnetCidrReservation"]
    assert reservation.inputs["reservationType"] == "explicit"
    (store,) = [r for r in resources if r.type == STORES["aws"] and "-rdzv-" in r.name]
    assert ipaddress.ip_address(store.inputs["privateIp"]) in ipaddress.ip_network(reservation.inputs["cidrBlock"])
    assert store.options["dependencies"] and any(reservation.urn == d for d in store.options["dependencies"])
    (template,) = [r for r in resources if r.type == "aws:ec2/launchTemplate:LaunchTemplate" and r.name == "aws-train-lt"]
    assert not isinstance(template.inputs["userData"], str), "a user data with a key must be a secret"
    root = tmp_path / "node"
    lay_down(base64.b64decode(unwrap_secrets(template.inputs["userData"])), root)
    env = node_env(root)
    assert len(env[RDZV_KEY]) >= 32 and env["RDZV_ENDPOINT"] == f"{store.inputs['privateIp']}:29400"
    # The node's own env file into the launcher's key reader: the key it signs with is the plan's.
    from training.node import rdzv_launch

    assert rdzv_launch.run_key(env) == env[RDZV_KEY].encode()


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

    from infra.cloud_rules import POD_CIDR, SERVICE_CIDR
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
    from infra.groups import resolve
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
    from infra.errors import SpecError
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
    from infra.errors import SpecError
    from tests.harness import parse_spec
    from tests.harness import key, spec_raw, stack_values

    values = stack_values("prod")
    groups = values[key("nodeGroups")]
    base = next(g for g in groups if g["name"] == "tc-train")
    groups += [dict(base, name=f"tc-extra{k}") for k in range(rendezvous.OWN_SUBNET_STORES)]
    values[key("budget")]["monthlyLimitUsd"] = 100_000_000
    with pytest.raises(SpecError, match=rf"tc-train holds {rendezvous.OWN_SUBNET_STORES + 1} multi-node VM groups"):
        parse_spec(spec_raw(values))


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


# --- metrics endpoints: the node's / pod's address, never every interface ---------------------------

def _listening(port: int) -> list[str]:
    return subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.parametrize("addr", ["", "127.0.0.1"])
def test_the_trainers_metrics_listen_on_one_address(addr: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """METRICS_ADDR is what the stack sets (the node's private address from its default route,
    the pod's from the downward API); unset, the trainer keeps to loopback."""
    from training.trainer.metrics import Metrics

    if addr:
        monkeypatch.setenv("METRICS_ADDR", addr)
    else:
        monkeypatch.delenv("METRICS_ADDR", raising=False)
    port = free_port()
    Metrics(port, 1.0, {"group": "g"})
    listening = _listening(port)
    assert f"127.0.0.1:{port}" in listening and f"*:{port}" not in listening and f"0.0.0.0:{port}" not in listening


def test_the_node_units_bind_the_exporters_and_trainer_to_the_private_address() -> None:
    exporters = (ROOT / "cloudinit/units/gts-exporters.service").read_text()
    trainer = (ROOT / "cloudinit/units/gts-trainer.service").read_text()
    starts = [line for line in exporters.splitlines() if line.startswith("ExecStart=")]
    assert len(starts) == 2 and all("addr=$$(/usr/local/sbin/gts-node-addr.sh) || exit 1;" in line for line in starts)
    assert '-p "$$addr:9400:9400"' in starts[0] and '--web.listen-address="$$addr:9100"' in starts[1]
    assert "-p 9400:9400" not in exporters
    assert '-e METRICS_ADDR="$$(/usr/local/sbin/gts-node-addr.sh)"' in trainer


@pytest.mark.parametrize("route,addrs,want", [
    ("1.1.1.1 via 10.0.0.1 dev eth0 src 10.0.3.7 uid 0", "", "10.0.3.7"),
    ("", "2: eth0    inet 10.99.0.5/24 brd 10.99.0.255 scope global eth0", "10.99.0.5"),
    ("", "", None)])
def test_the_node_address_is_its_private_one_or_nothing(route: str, addrs: str, want: str | None,
                                                        tmp_path: Path) -> None:
    """gts-node-addr.sh: the default route's source, else the first global address; none at all
    is a failure (the exporters' unit then starts nothing rather than listen on every interface)."""
    stub = tmp_path / "ip"
    stub.write_text(f"#!/bin/sh\ncase \"$*\" in *route*) printf '%s' '{route}';; *) printf '%s' '{addrs}';; esac\n")
    stub.chmod(0o755)
    proc = subprocess.run(["bash", str(ROOT / "cloudinit/scripts/gts-node-addr.sh")], capture_output=True, text=True,
                          env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, timeout=30)
    if want is None:
        assert proc.returncode == 1 and "no private IPv4 address" in proc.stderr and not proc.stdout
    else:
        assert proc.returncode == 0 and proc.stdout.strip() == want, proc


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


def _tke_env(meta: object, tmp: Path, token: str) -> dict[str, str]:
    from tests.metadata_server import FakeMetadata

    assert isinstance(meta, FakeMetadata)
    (tmp / "token").write_text(token)
    return {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "TKE_REGION": "ap-guangzhou",
            "TKE_PROVIDER_ID": "cls-abc", "TKE_ROLE_ARN": "qcs::cam::uin/100000000001:roleName/prod-tc-tke-train-pods",
            "TKE_WEB_IDENTITY_TOKEN_FILE": str(tmp / "token"), "GTS_STS_ENDPOINT": meta.url}


SHOW_CREDENTIALS = ("from training.credentials import credential_source; c = credential_source('tke-pod-identity', "
                    "__import__('os').environ)(); print(c.access_key, c.token, int(c.expires))")


def test_a_tke_pod_exchanges_its_token_at_sts_and_never_asks_the_metadata_service(tmp_path: Path) -> None:
    """A real process with what TKE's webhook gives a pod: the token file and the TKE_* variables.
    It asks STS the way the Tencent SDKs do (unsigned TC3 JSON POST), reads the token file anew
    each time (Kubernetes rotates it), and never reads the instance role."""
    from tests.metadata_server import FakeMetadata

    with FakeMetadata("tencentcloud") as meta:
        env = _tke_env(meta, tmp_path, meta.web_identity_token)
        got = subprocess.run([sys.executable, "-c", SHOW_CREDENTIALS], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=60)
        assert got.returncode == 0, got.stderr
        key, token, _ = got.stdout.split()
        assert (key, token) == ("STS.tencentcloud.0", "token-0")
        ((headers, body),) = meta.web_identity_requests
        assert headers["x-tc-action"] == "AssumeRoleWithWebIdentity" and headers["x-tc-version"] == "2018-08-13"
        assert headers["authorization"] == "SKIP" and headers["x-tc-region"] == "ap-guangzhou"
        assert headers["content-type"] == "application/json"
        assert body["ProviderId"] == "cls-abc" and body["WebIdentityToken"] == meta.web_identity_token
        assert body["RoleArn"] == env["TKE_ROLE_ARN"] and body["RoleSessionName"]
        assert meta.requests == 0, "no GET reached the metadata paths"
        # A rotated token is read again; a stolen or stale one is refused with STS's reason.
        meta.web_identity_token = "rotated"
        (tmp_path / "token").write_text("rotated")
        meta.rotate()
        again = subprocess.run([sys.executable, "-c", SHOW_CREDENTIALS], env=env, cwd=tmp_path, capture_output=True,
                               text=True, timeout=60)
        assert again.stdout.split()[0] == "STS.tencentcloud.1", again.stderr
        (tmp_path / "token").write_text("someone-elses-token")
        refused = subprocess.run([sys.executable, "-c", SHOW_CREDENTIALS], env=env, cwd=tmp_path, capture_output=True,
                                 text=True, timeout=60)
        assert refused.returncode != 0 and "InvalidParameter.WebIdentityTokenError" in refused.stderr


def test_a_pod_without_the_webhooks_variables_is_told_what_is_missing(tmp_path: Path) -> None:
    from training.cloudmeta import MetadataError
    from training.credentials import credential_source

    with pytest.raises(MetadataError, match="TKE_ROLE_ARN, TKE_WEB_IDENTITY_TOKEN_FILE .*tke.cloud.tencent.com/role-arn"):
        credential_source("tke-pod-identity", {"TKE_REGION": "ap-guangzhou", "TKE_PROVIDER_ID": "cls-abc"})()


@pytest.mark.parametrize("source,env,named", [
    ("tke-pod-identity", {"TKE_REGION": "ap-guangzhou", "TKE_PROVIDER_ID": "cls-abc", "TKE_ROLE_ARN": "qcs::cam::r",
                          "TKE_WEB_IDENTITY_TOKEN_FILE": "/nonexistent/token"}, "TKE_WEB_IDENTITY_TOKEN_FILE"),
    ("tke-pod-identity", {"TKE_REGION": "ap-guangzhou", "TKE_PROVIDER_ID": "cls-abc", "TKE_ROLE_ARN": "qcs::cam::r",
                          "TKE_WEB_IDENTITY_TOKEN_FILE": "{token}", "GTS_STS_ENDPOINT": "http://sts.example.com"},
     "over https only"),
    ("ack-rrsa", {"ALIBABA_CLOUD_ROLE_ARN": "acs:ram::1:role/r", "ALIBABA_CLOUD_OIDC_PROVIDER_ARN": "acs:ram::1:oidc/p",
                  "ALIBABA_CLOUD_OIDC_TOKEN_FILE": "/nonexistent/token"}, "ALIBABA_CLOUD_OIDC_TOKEN_FILE"),
    ("ack-rrsa", {"ALIBABA_CLOUD_ROLE_ARN": "acs:ram::1:role/r", "ALIBABA_CLOUD_OIDC_PROVIDER_ARN": "acs:ram::1:oidc/p",
                  "ALIBABA_CLOUD_OIDC_TOKEN_FILE": "{token}", "ALIBABA_CLOUD_STS_ENDPOINT": "http://10.0.0.9"},
     "over https only")])
def test_a_pods_token_is_never_sent_in_clear_and_a_missing_one_is_named(source: str, env: dict[str, str], named: str,
                                                                        tmp_path: Path) -> None:
    """The pod's token is its identity: a plain-http STS endpoint other than loopback is refused
    before anything is sent, and an unreadable token file is an error naming its variable."""
    from training.cloudmeta import MetadataError
    from training.credentials import credential_source

    token = tmp_path / "token"
    token.write_text("eyJ.token")
    env = {k: v.replace("{token}", str(token)) for k, v in env.items()}
    with pytest.raises(MetadataError, match=named):
        credential_source(source, env)()


@pytest.mark.parametrize("value", ["", "short", "x" * 31])
def test_a_rendezvous_key_shorter_than_32_characters_is_refused_by_name(value: str) -> None:
    from training.node import rdzv_launch

    with pytest.raises(SystemExit, match="RDZV_KEY must hold the run's rendezvous key"):
        rdzv_launch.run_key({"RDZV_KEY": value})
