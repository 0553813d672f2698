#!/usr/bin/env python3
"""Fetch the node group's rendezvous key from the cloud's secret store with the instance role
(gts-trainer.service runs this before the container starts) into a file only root reads (0600),
which the trainer container gets as an env file. The user data names where the key is
(GTS_RDZV_KEY_REF), never the key (infra/clouds/<cloud>/secrets.py). Single-node groups have no
key: nothing to do.

    gts-rdzv-key.py --env /etc/gpu-training/node.env --out /run/gpu-training/rdzv.env
"""

import argparse
import os
import sys
import time
from typing import Callable, Dict, Optional

sys.path.insert(0, os.environ.get("GTS_LIB", "/usr/local/lib/gts"))
import cloudmeta  # noqa: E402  (the node's copy of training/cloudmeta.py)

REF = "GTS_RDZV_KEY_REF"


def write_private(path: str, text: str) -> None:
    """`text` at `path`, readable by its owner alone from the first byte (never 0644 for a moment)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".gts-new"
    if os.path.exists(tmp):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)


def fetch(env: Dict[str, str], out: str, metadata_url: Optional[str] = None, endpoint: Optional[str] = None,
          attempts: int = 5, sleep: Callable[[float], None] = time.sleep) -> str:
    ref = env.get(REF, "")
    if not ref:
        return "no rendezvous key for this group (single node)"
    cloud = env.get("GTS_CLOUD", "")
    meta = cloudmeta.Metadata(cloud, metadata_url or env.get("GTS_METADATA_URL") or None)
    node = cloudmeta.cloud_node(cloud)
    last = ""
    for attempt in range(1, attempts + 1):
        try:
            key = node.rendezvous_key(meta, env.get("STORAGE_REGION", ""), ref, endpoint)
            break
        except (OSError, cloudmeta.MetadataError, KeyError, ValueError) as exc:  # HTTPError is an OSError
            last = "%s: %s" % (type(exc).__name__, exc)
            if attempt < attempts:
                sleep(min(30.0, 2.0 * attempt))
    else:
        raise SystemExit("gts-rdzv-key: could not read %s %s from the secret store with the instance role: %s"
                         % (cloud, ref, last))
    if not key or "\n" in key:
        raise SystemExit("gts-rdzv-key: %s %s holds no single-line key" % (cloud, ref))
    write_private(out, "RDZV_KEY=%s\n" % key)
    return "rendezvous key of %s written to %s (0600)" % (ref, out)


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="/etc/gpu-training/node.env")
    parser.add_argument("--out", default="/run/gpu-training/rdzv.env")
    parser.add_argument("--metadata-url")
    parser.add_argument("--endpoint", help="the secret store's API endpoint, for tests")
    parser.add_argument("--attempts", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        print(fetch(cloudmeta.read_env(args.env), args.out, args.metadata_url, args.endpoint, args.attempts))
    except (OSError, cloudmeta.UnknownCloud) as exc:
        print("gts-rdzv-key: %s" % exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
