#!/usr/bin/env python3
"""Turn a spot interruption notice into a checkpoint.

Polls the cloud's metadata service (every 5 s by default). When a notice appears it logs it,
exposes it as a node-exporter textfile metric, and sends SIGTERM to the training container
(or process) once, so the trainer finishes its step, writes its emergency checkpoint and
uploads it inside the notice's lead time.

    gts-spot-watch.py --cloud aws --action docker:gts-trainer
    gts-spot-watch.py --cloud tencentcloud --action crictl:trainer   # Kubernetes nodes
    gts-spot-watch.py --cloud alicloud --action pid:1234 --metadata-url http://127.0.0.1:8080 --once
"""

import argparse
import datetime as dt
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

ENDPOINTS = {
    "aws": ("http://169.254.169.254", "/latest/meta-data/spot/instance-action"),
    "alicloud": ("http://100.100.100.200", "/latest/meta-data/instance/spot/termination-time"),
    "tencentcloud": ("http://metadata.tencentyun.com", "/latest/meta-data/spot/termination-time"),
}
TOKEN_HEADERS = {  # cloud: (ttl header for PUT /latest/api/token, header carrying the token)
    "aws": ("X-aws-ec2-metadata-token-ttl-seconds", "X-aws-ec2-metadata-token"),
    "alicloud": ("X-aliyun-ecs-metadata-token-ttl-seconds", "X-aliyun-ecs-metadata-token"),
}
BEIJING = dt.timezone(dt.timedelta(hours=8))
log = logging.getLogger("gts-spot-watch")


class Metadata:
    def __init__(self, cloud, base_url, timeout=2.0):
        self.cloud = cloud
        self.base = (base_url or ENDPOINTS[cloud][0]).rstrip("/")
        self.path = ENDPOINTS[cloud][1]
        self.timeout = timeout
        self.token = None

    def _token(self):
        ttl_header, _ = TOKEN_HEADERS[self.cloud]
        req = urllib.request.Request(self.base + "/latest/api/token", method="PUT", headers={ttl_header: "21600"})
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return resp.read().decode().strip()

    def notice(self):
        """The notice body, or None while there is none (404)."""
        headers = {}
        if self.cloud in TOKEN_HEADERS:
            if self.token is None:
                self.token = self._token()
            headers[TOKEN_HEADERS[self.cloud][1]] = self.token
        req = urllib.request.Request(self.base + self.path, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read().decode().strip() or None
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return None
            if err.code == 401:
                self.token = None  # expired: fetch a new one next time
                return None
            raise


def deadline(cloud, body):
    """When the instance goes, as a UTC datetime (None if the body cannot be read)."""
    try:
        if cloud == "aws":
            stamp = json.loads(body)["time"]
            return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
        if cloud == "alicloud":
            return dt.datetime.strptime(body, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
        return dt.datetime.strptime(body, "%Y-%m-%d %H:%M:%S").replace(tzinfo=BEIJING).astimezone(dt.timezone.utc)
    except (ValueError, KeyError, TypeError):
        return None


def write_metric(directory, cloud, when):
    if not directory:
        return
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, ".gts_spot.prom.tmp")
    seconds = when.timestamp() if when else time.time()
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write("# HELP gts_spot_interruption_notice 1 once the cloud announced this spot node's reclaim.\n")
        fh.write("# TYPE gts_spot_interruption_notice gauge\n")
        fh.write(f'gts_spot_interruption_notice{{cloud="{cloud}"}} 1\n')
        fh.write("# HELP gts_spot_interruption_time_seconds When the node goes (unix time).\n")
        fh.write("# TYPE gts_spot_interruption_time_seconds gauge\n")
        fh.write(f'gts_spot_interruption_time_seconds{{cloud="{cloud}"}} {seconds:.0f}\n')
    os.replace(tmp, os.path.join(directory, "gts_spot.prom"))


def act(action):
    kind, _, target = action.partition(":")
    if kind == "pid":
        os.kill(int(target), signal.SIGTERM)
    elif kind == "docker":
        subprocess.run(["docker", "kill", "--signal", "TERM", target], check=True)
    elif kind == "crictl":
        ids = subprocess.run(["crictl", "ps", "-q", "--label", f"io.kubernetes.container.name={target}"],
                             check=True, capture_output=True, text=True).stdout.split()
        for cid in ids:  # crictl stop sends SIGTERM, then waits for the grace period
            subprocess.Popen(["crictl", "stop", "--timeout", "110", cid])
    else:
        raise ValueError(f"unknown action {action!r}: use pid:N, docker:NAME or crictl:NAME")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cloud", choices=sorted(ENDPOINTS), required=True)
    parser.add_argument("--action", required=True, help="pid:N | docker:CONTAINER | crictl:CONTAINER_NAME")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between polls")
    parser.add_argument("--metadata-url", default=os.environ.get("GTS_METADATA_URL"), help="override, for tests")
    parser.add_argument("--textfile-dir", default="/var/lib/node_exporter/textfile")
    parser.add_argument("--once", action="store_true", help="exit after acting on a notice")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    meta = Metadata(args.cloud, args.metadata_url)
    acted = False
    log.info("watching %s%s every %.0f s", meta.base, meta.path, args.interval)
    while True:
        try:
            body = meta.notice()
        except (urllib.error.URLError, OSError) as exc:
            log.warning("metadata service unreachable: %s", exc)
            body = None
        if body and not acted:
            when = deadline(args.cloud, body)
            log.warning("spot interruption notice: %s (node goes at %s); stopping the trainer", body, when)
            write_metric(args.textfile_dir, args.cloud, when)
            act(args.action)
            acted = True
            if args.once:
                return 0
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
