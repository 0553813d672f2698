# shellcheck shell=bash
# The node scripts' shared shell: sourced (never run) by gts-driver.sh, gts-runtime.sh,
# gts-shared.sh and gts-fabric.sh from the folder they are in (/usr/local/sbin on a node, the
# checkout's cloudinit/scripts in tests):
#     . "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/gts-lib.sh"
# GTS_LIB_NAME (default: the script's name) prefixes its messages.

GTS_LIB_NAME=${GTS_LIB_NAME:-$(basename "$0" .sh)}

# apt-get that waits for the dpkg lock (unattended-upgrades holds it on a first boot, another
# step may install beside us) instead of failing, keeps the image's changed config files, and
# never asks a question.
apt_get() {
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -o Dpkg::Options::=--force-confold "$@"
}

# `apt-get update`, retried: DPkg::Lock::Timeout does not cover the lists lock `update` takes.
# --error-on=any (apt >= 2.1.16; Ubuntu 22.04 has 2.4): without it an unreachable mirror exits 0,
# the retry never retries and the install fails later with "Unable to locate package".
# GTS_APT_RETRY_S (default 10) is the first pause; each later one is longer.
apt_update() {
  local try
  for try in 1 2 3 4 5 6; do
    if apt_get update -q --error-on=any; then return 0; fi
    echo "$GTS_LIB_NAME: apt-get update failed (try $try); retrying" >&2
    sleep $((try * ${GTS_APT_RETRY_S:-10}))
  done
  return 1
}

# The node's own cloud's fragment of a node script (infra/clouds/<cloud>/<name>: the functions the
# script calls for what differs per cloud, such as its fabric's installs), by path: on a node the
# bundle's /usr/local/lib/gts/clouds/<cloud>/, and where there is no such folder (a checkout) the
# repository's infra/clouds/<cloud>/ — one folder, never both. GTS_CLOUD (node.env) names it.
cloud_fragment() {
  local lib=${GTS_LIB_DIR:-/usr/local/lib/gts}/clouds
  case ${GTS_CLOUD:-} in
    '' | *[!a-z0-9]*) echo "$GTS_LIB_NAME: GTS_CLOUD '${GTS_CLOUD:-}' is not a cloud's name" >&2; return 2 ;;
  esac
  [ -d "$lib" ] || lib=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../../infra/clouds
  if [ ! -r "$lib/$GTS_CLOUD/$1" ]; then
    echo "$GTS_LIB_NAME: no $1 for cloud '$GTS_CLOUD' (looked in $lib)" >&2
    return 2
  fi
  echo "$lib/$GTS_CLOUD/$1"
}
