#!/usr/bin/env python3
"""Log the node's Docker in to the registry its trainer image is in (gts-trainer.service and
gts-dataset.sh run this before `docker pull`). The cloud's node module (infra/clouds/<cloud>/node.py
registry_login) says how: AWS ECR takes a GetAuthorizationToken call signed by the instance role;
Alibaba's and Tencent's registries serve the stack's VPCs without credentials and nobody else
(infra/clouds/*/registry.py), so there is nothing to do.

    gts-registry-login.py --env /etc/gpu-training/node.env
"""

import argparse
import os
import subprocess
import sys
from typing import Dict, Optional

sys.path.insert(0, os.environ.get("GTS_LIB", "/usr/local/lib/gts"))
import cloudmeta  # noqa: E402  (the node's copy of training/cloudmeta.py)


def registry_login(env: Dict[str, str], metadata_url: Optional[str] = None, endpoint: Optional[str] = None,
                   docker: str = "docker") -> str:
    cloud = env.get("GTS_CLOUD", "")
    meta = cloudmeta.Metadata(cloud, metadata_url or env.get("GTS_METADATA_URL") or None)
    # The repository lives in the cloud's default region, with the stack's bucket.
    login = cloudmeta.cloud_node(cloud).registry_login(meta, env.get("STORAGE_REGION", ""), endpoint)
    if login is None:
        return "%s: the registry serves this VPC without a login" % cloud
    registry, user, password = login
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
    except (OSError, cloudmeta.MetadataError, KeyError, ValueError, subprocess.CalledProcessError) as exc:  # UnknownCloud too
        print("gts-registry-login: %s" % exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
