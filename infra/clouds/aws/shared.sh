# shellcheck shell=bash
# AWS's shared file system clients on a node: sourced (never run) by cloudinit/scripts/gts-shared.sh,
# which calls shared_client_<kernel type> for a mount type that is not NFS (the profile's
# shared_fs_kinds mount_type, the node's GTS_SHARED_FS).

shared_client_efs() {
  # AWS's EFS mount helper: `-o tls` (NFS inside TLS to the mount target), `iam` (the mount is
  # signed with the node's role) and `accesspoint=` — the file system policy refuses any other
  # mount (EFS user guide, efs-mount-helper and encryption-in-transit). Amazon Linux ships it;
  # elsewhere it comes from the image or an apt mirror that carries it (github.com/aws/efs-utils).
  command -v mount.efs >/dev/null 2>&1 && return 0
  if command -v yum >/dev/null 2>&1; then
    yum install -y -q amazon-efs-utils
  elif ! { apt_get update -q && apt_get install -y -q amazon-efs-utils; }; then
    log "amazon-efs-utils (mount.efs) is missing and not installable here; EFS mounts only with TLS through it"
    exit 2
  fi
}

shared_client_lustre() {
  modinfo lustre >/dev/null 2>&1 && return 0
  # AWS's Lustre client for Ubuntu 22.04, built for the running kernel
  # (docs.aws.amazon.com/fsx/latest/LustreGuide/install-lustre-client.html).
  local key=/usr/share/keyrings/fsx-lustre-client.gpg
  curl -fsSL https://fsx-lustre-client-repo-public-keys.s3.amazonaws.com/fsx-ubuntu-public-key.asc \
    | gpg --dearmor --yes -o "$key"
  echo "deb [signed-by=$key] https://fsx-lustre-client-repo.s3.amazonaws.com/ubuntu jammy main" \
    > /etc/apt/sources.list.d/fsxlustreclientrepo.list
  apt_update && apt_get install -y -q "lustre-client-modules-$(uname -r)"
}
