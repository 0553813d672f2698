#!/usr/bin/env python3
"""Log the node's Docker in to the registry its trainer image is in (gts-trainer.service and
gts-dataset.sh run this before `docker pull`). AWS: ECR, with a GetAuthorizationToken call
signed by the instance role. Alibaba and Tencent: nothing to do — their registries serve the
stack's VPCs without credentials and nobody else (infra/clouds/*/registry.py).

    gts-registry-login.py --env /etc/gpu-training/node.env
"""

import argparse
import base64
import datetime as dt
import json
import os
import subprocess
import sys
import urllib.request
from typing import Dict, Optional, Tuple

sys.path.insert(0, os.environ.get("GTS_LIB", "/usr/local/lib/gts"))
import cloudmeta  # noqa: E402  (the node's copy of training/cloudmeta.py)

ECR_TARGET = "AmazonEC2ContainerRegistry_V20150921.GetAuthorizationToken"


def ecr_login(region: str, creds: "cloudmeta.Credentials", endpoint: Optional[str] = None) -> Tuple[str, str, str]:
    """(registry, user, password) for `docker login` to the account's ECR."""
    url = (endpoint or "https://api.ecr.%s.amazonaws.com" % region).rstrip("/") + "/"
    body = b"{}"
    extra = {"Content-Type": "application/x-amz-json-1.1", "X-Amz-Target": ECR_TARGET}
    headers = cloudmeta.sign_v4("POST", url, region, creds, dt.datetime.now(dt.timezone.utc), "ecr", body, extra)
    headers.pop("host", None)
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as resp:
        data = json.loads(resp.read().decode())["authorizationData"][0]
    user, _, password = base64.b64decode(data["authorizationToken"]).decode().partition(":")
    return data["proxyEndpoint"], user, password


def registry_login(env: Dict[str, str], metadata_url: Optional[str] = None, endpoint: Optional[str] = None,
                   docker: str = "docker") -> str:
    cloud = env.get("GTS_CLOUD", "")
    if cloud != "aws":
        return "%s: the registry serves this VPC without a login" % cloud
    creds = cloudmeta.Metadata(cloud, metadata_url or env.get("GTS_METADATA_URL") or None).credentials()
    # The repository lives in the cloud's default region, with the stack's bucket.
    registry, user, password = ecr_login(env.get("STORAGE_REGION", ""), creds, endpoint)
    subprocess.run([docker, "login", "--username", user, "--password-stdin", registry], input=password.encode(),
                   check=True, stdout=subprocess.DEVNULL)
    return "logged in to %s" % registry


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="/etc/gpu-training/node.env")
    parser.add_argument("--metadata-url")
    parser.add_argument("--endpoint", help="ECR API endpoint override, for tests")
    args = parser.parse_args(argv)
    try:
        print(registry_login(cloudmeta.read_env(args.env), args.metadata_url, args.endpoint))
    except (OSError, cloudmeta.MetadataError, KeyError, ValueError, subprocess.CalledProcessError) as exc:
        print("gts-registry-login: %s" % exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
