"""`make dataset STACK=<name>`: copy the stack's dataset (`training.datasetSource`) into the
bucket of every cloud with node groups, at `datasets/<training.dataset>/`. Nodes read it only
there (their roles may read `datasets/`, never write it), so a dataset never crosses a border
at run time. Resumable (files already there with the right size are skipped) and verified
(every file's size against the source listing): run it again after an interruption.

Credentials are the operator's own, the ones `pulumi up` uses: AWS's default chain, Alibaba's
ALICLOUD_ACCESS_KEY / ALICLOUD_SECRET_KEY, Tencent's TENCENTCLOUD_SECRET_ID /
TENCENTCLOUD_SECRET_KEY. The source is read with this process's STORAGE_* settings (for a
non-AWS source: STORAGE_REGION or STORAGE_ENDPOINT_URL)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from infra.buckets import DATASET_PREFIX, bucket, endpoint
from infra.clouds import profile
from infra.core.errors import SpecError
from infra.model.spec import StackSpec
from infra.stack.stackfile import StackFileError, load_stack_spec

class DatasetError(Exception):
    pass


def targets(spec: StackSpec, endpoints: Mapping[str, str]) -> list[tuple[str, str, dict[str, str]]]:
    """(cloud, destination URL, its STORAGE_* settings) for each cloud with node groups."""
    if not spec.training.dataset:
        raise DatasetError("training.dataset is not set: name the dataset the nodes read (datasets/<name>/)")
    out: list[tuple[str, str, dict[str, str]]] = []
    for cloud in sorted({g.cloud for g in spec.node_groups}):
        b = bucket(spec, cloud)
        # From outside the cloud: the public endpoint (the nodes use the internal one).
        url = endpoints.get(cloud) or endpoint(cloud, b.region, node_region="")
        env = {"STORAGE_ENDPOINT_URL": url, "STORAGE_REGION": b.region,
               "STORAGE_ADDRESSING_STYLE": "path" if cloud in endpoints else "virtual"}
        out.append((cloud, f"{b.url}{DATASET_PREFIX}{spec.training.dataset}/", env))
    return out


def operator_keys(cloud: str, environ: Mapping[str, str]) -> tuple[str, str] | None:
    names = profile(cloud).operator_keys  # infra/clouds/<cloud>/profile.py
    if names is None:
        return None  # the SDK's default chain (profile, SSO, environment)
    values = [environ.get(n, "") for n in names]
    if not all(values):
        raise DatasetError(f"copying into the {cloud} bucket needs {' and '.join(names)} in the environment "
                           "(the same keys the Pulumi provider uses)")
    return values[0], values[1]


def copy_everywhere(stack: str, source: str | None, endpoints: Mapping[str, str], workers: int,
                    environ: Mapping[str, str]) -> list[str]:
    from training.node.datasync import sync
    from training.ckpt.storage import location

    spec = load_stack_spec(stack)
    source = source or spec.training.dataset_source
    if not source:
        raise DatasetError("no source: set training.datasetSource in the stack file or pass --source URL")
    plans = targets(spec, endpoints)
    keys = {cloud: operator_keys(cloud, environ) for cloud, _, _ in plans}  # all checked before copying
    lines = []
    for cloud, url, env in plans:
        result = sync(location(source), location(url, env, keys[cloud]), workers)
        lines.append(f"{cloud}: {url}: {result.copied} of {result.total} files copied in {result.seconds:.1f} s, "
                     f"all {result.total} verified by size")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make dataset", description=__doc__.splitlines()[0])
    parser.add_argument("--stack", default="dev")
    parser.add_argument("--source", help="copy from here instead of training.datasetSource")
    parser.add_argument("--endpoint", action="append", default=[], metavar="CLOUD=URL",
                        help="another S3-compatible endpoint for one cloud's bucket (a VPC endpoint, a test server)")
    parser.add_argument("--workers", type=int, default=16, help="files copied at once")
    args = parser.parse_args(argv)
    try:
        endpoints = dict(item.split("=", 1) for item in args.endpoint)
    except ValueError:
        print("error: --endpoint takes CLOUD=URL, e.g. alicloud=https://s3.oss-cn-hangzhou.aliyuncs.com",
              file=sys.stderr)
        return 2
    try:
        for line in copy_everywhere(args.stack, args.source, endpoints, args.workers, os.environ):
            print(line)
    except (SpecError, StackFileError, DatasetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"error: the copy stopped: {exc} (run it again: finished files are kept)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
