#!/usr/bin/env python3
"""Print the trainer image this node runs now: its group's current image from the stack's bucket
(nodes/images/<group>, which the plan writes: infra/buckets.py image_key), read with the instance
role, else the one its user data named (GTS_IMAGE). gts-trainer.service runs the container with
what this prints, so a new image reaches a node at its next trainer start even when its user data
is never read again (a fixed instance: cloud-init runs once per instance).

    gts-image.py --env /etc/gpu-training/node.env
"""

import argparse
import os
import re
import sys
import urllib.error
import urllib.parse
from typing import Dict, Optional

sys.path.insert(0, os.environ.get("GTS_LIB", "/usr/local/lib/gts"))
import cloudmeta  # noqa: E402  (the node's copy of training/cloudmeta.py)

# An image reference as the plan writes them: registry/path[:tag]@sha256:<digest> or a plain ref,
# in the characters node.env allows (never a space, quote or shell character).
REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,511}")


def image_key(group: str) -> str:
    return "nodes/images/%s" % group


def current(env: Dict[str, str], metadata_url: Optional[str] = None) -> str:
    fallback = env.get("GTS_IMAGE", "")
    bucket = urllib.parse.urlsplit(env.get("GTS_BUNDLE_URL", "")).netloc
    group, cloud = env.get("GTS_NODE_GROUP", ""), env.get("GTS_CLOUD", "")
    if not (bucket and group):
        return fallback
    try:
        creds = cloudmeta.Metadata(cloud, metadata_url or env.get("GTS_METADATA_URL") or None).credentials()
        body = cloudmeta.signed_get(cloud, env.get("STORAGE_ENDPOINT_URL", ""), env.get("STORAGE_REGION", ""), bucket,
                                    image_key(group), creds, env.get("STORAGE_ADDRESSING_STYLE", "virtual"))
    except urllib.error.HTTPError as err:
        if err.code != 404:
            print("gts-image: %s/%s answered HTTP %d; running %s" % (bucket, image_key(group), err.code, fallback),
                  file=sys.stderr)
        return fallback
    except (OSError, cloudmeta.MetadataError, ValueError) as exc:
        print("gts-image: could not read %s/%s (%s); running %s" % (bucket, image_key(group), exc, fallback),
              file=sys.stderr)
        return fallback
    ref = body.decode("utf-8", "replace").strip()
    if not REF.fullmatch(ref):
        raise SystemExit("gts-image: %s/%s holds %r, not an image reference" % (bucket, image_key(group), ref[:80]))
    return ref


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="/etc/gpu-training/node.env")
    parser.add_argument("--metadata-url")
    args = parser.parse_args(argv)
    try:
        print(current(cloudmeta.read_env(args.env), args.metadata_url))
    except (OSError, cloudmeta.UnknownCloud) as exc:
        print("gts-image: %s" % exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
