# shellcheck shell=bash
# Tencent Cloud's shared file system clients on a node: sourced (never run) by
# cloudinit/scripts/gts-shared.sh for a mount type that is not NFS. CFS mounts over NFS (the
# generic client), so there is none here: another type is refused.
