#!/usr/bin/env python3
"""Pick the disks for NVMe scratch from `lsblk --json`: local NVMe instance storage first, else
attached data disks; never the root disk, never a disk with partitions, mounts or a
filesystem that is not ours. Prints one /dev path per line.

    gts-disks.py                      # runs lsblk itself
    gts-disks.py --lsblk-json FILE    # a recorded `lsblk --json -b -o NAME,TYPE,SIZE,MODEL,MOUNTPOINT,FSTYPE,LABEL`
"""

import argparse
import json
import subprocess
import sys

LSBLK = ["lsblk", "--json", "-b", "-o", "NAME,TYPE,SIZE,MODEL,MOUNTPOINT,FSTYPE,LABEL"]
INSTANCE_STORE = ("Instance Storage",)  # "Amazon EC2 NVMe Instance Storage"
OUR_LABEL = "gts-scratch"
SYSTEM_MOUNTS = ("/", "/boot", "/boot/efi", "[SWAP]", "/usr", "/var")


def walk(dev):
    yield dev
    for child in dev.get("children") or []:
        yield from walk(child)


def is_root_disk(disk):
    return any((d.get("mountpoint") or "") in SYSTEM_MOUNTS for d in walk(disk))


def is_free(disk):
    """Unpartitioned and unmounted, with no filesystem or only our own (a re-run)."""
    children = disk.get("children") or []
    if any(c.get("type") == "part" for c in children):
        return False
    if any(d.get("mountpoint") for d in walk(disk) if d is not disk):
        return False
    if disk.get("mountpoint"):
        return False
    fs, label = disk.get("fstype"), disk.get("label")
    if fs in (None, "", "linux_raid_member"):
        return True
    return label == OUR_LABEL


def select(tree, min_gb=0):
    disks = [d for d in tree.get("blockdevices", []) if d.get("type") == "disk"]
    usable = [d for d in disks if not is_root_disk(d) and is_free(d)
              and int(d.get("size") or 0) >= min_gb * 10**9]
    local = [d for d in usable if any(m in (d.get("model") or "") for m in INSTANCE_STORE)]
    chosen = local or usable
    return sorted("/dev/" + d["name"] for d in chosen)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lsblk-json", help="read this recorded lsblk output instead of running lsblk")
    parser.add_argument("--min-gb", type=int, default=0, help="ignore disks smaller than this")
    args = parser.parse_args(argv)
    if args.lsblk_json:
        with open(args.lsblk_json, encoding="utf-8") as fh:
            tree = json.load(fh)
    else:
        tree = json.loads(subprocess.run(LSBLK, check=True, capture_output=True, text=True).stdout)
    for path in select(tree, args.min_gb):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
