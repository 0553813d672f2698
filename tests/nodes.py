"""What the plan gives a node, decoded as the node decodes it: the registered resource, its user
data, the files cloud-init (or the node pool's script, or EKS's MIME parser) writes from it, and
the node's /etc/gpu-training/node.env."""

from __future__ import annotations

import base64
import subprocess
from email import message_from_bytes
from pathlib import Path
from typing import Any

from infra.plan.engine import Registered
from tests.harness import by_type, shipped
from tests.system_tools import debian_tool
from training import cloudmeta

CLOUD_INIT_WRITE = """
import os, sys
from cloudinit import util
from cloudinit.config.cc_write_files import canonicalize_extraction, decode_perms, extract_contents
doc = util.load_yaml(sys.stdin.read())
root = sys.argv[1]
for f in doc["write_files"]:
    data = extract_contents(f.get("content", ""), canonicalize_extraction(f.get("encoding")))
    path = root + f["path"]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as out:
        out.write(data if isinstance(data, bytes) else data.encode())
    os.chmod(path, decode_perms(f.get("permissions"), 0o644))
"""


def registered(type_token: str, name: str, stack: str = "prod") -> Registered:
    (found,) = [r for r in by_type(list(shipped(stack)), type_token) if r.name == name]
    return found


def user_data(type_token: str, name: str, path: tuple[str, ...], stack: str = "prod") -> bytes:
    from infra.plan.engine import unwrap_secrets

    value: Any = unwrap_secrets(registered(type_token, name, stack).inputs)  # a multi-node group's is a secret
    for key in path:
        value = value[key]
    return base64.b64decode(value)


def lay_down(raw: bytes, root: Path) -> None:
    """Put the user data's files under `root` as the node would."""
    if raw.startswith(b"#!"):  # ACK / TKE: the node pool runs it as a script
        subprocess.run(["bash", "-c", raw.decode()], env={"GTS_ROOT": str(root), "PATH": "/usr/bin:/bin"},
                       check=True, timeout=60)
        return
    if raw.startswith(b"Content-Type: multipart"):  # EKS: the cloud-config part of the MIME document
        parts = [p for p in message_from_bytes(raw).walk() if not p.is_multipart()]
        assert [p.get_content_type() for p in parts] == ["text/cloud-config"]
        payload = parts[0].get_payload(decode=True)
        assert isinstance(payload, bytes)
        raw = payload
    assert raw.startswith(b"#cloud-config\n")
    tool = debian_tool("cloud-init", "cloud-init")
    python = Path(tool).read_text().splitlines()[0].removeprefix("#!").strip() or "/usr/bin/python3"
    subprocess.run([python, "-c", CLOUD_INIT_WRITE, str(root)], input=raw.decode(), text=True, check=True, timeout=60)


def node_env(root: Path) -> dict[str, str]:
    return cloudmeta.read_env(str(root / "etc/gpu-training/node.env"))
