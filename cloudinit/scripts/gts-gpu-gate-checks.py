#!/usr/bin/env python3
"""The GPU boot gate's checks (gts-gpu-health.py `gate` loads this file beside it): GPU count and
persistence mode (nvidia-smi), Fabric Manager on NVSwitch types, `dcgmi diag` (on the host, with
its DCGM host engine started and waited for, else in the DCGM exporter's image with an engine of
its own), NVLinks. Each check says whether it failed on this node's GPUs or could not run at all
(a tool or host service missing): only the first condemns a node. Standard library only."""

import os
import re
import subprocess
import time


def _run(cmd, timeout):
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                              timeout=timeout)
        return proc.returncode, proc.stdout
    except FileNotFoundError:
        return 127, f"{cmd[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(cmd)}: no answer in {timeout} s"


# What dcgmi prints when it has no host engine to talk to: the gate's tool is not there, which
# says nothing about the GPUs (DCGM user guide: dcgmi talks to nv-hostengine, which the
# nvidia-dcgm service runs).
NO_ENGINE = re.compile(r"unable to establish a connection|host engine connection invalid|"
                       r"error connecting to host engine|connection to the host engine", re.IGNORECASE)
ENGINE_WAIT_S = 60


def _on_path(tool):
    return any(os.access(os.path.join(d, tool), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep))


def host_engine_ready(wait_s=ENGINE_WAIT_S, sleep=time.sleep):
    """Start the host's nvidia-dcgm service (nv-hostengine) and wait until dcgmi reaches it; False
    when the host has no such service or it never answers (then the exporter image's own engine
    runs the diagnostic)."""
    code, _ = _run(["systemctl", "start", "nvidia-dcgm"], 60)
    if code != 0:
        return False
    deadline = time.monotonic() + wait_s
    while True:
        code, out = _run(["dcgmi", "discovery", "-l"], 30)
        if code == 0 and not NO_ENGINE.search(out):
            return True
        if time.monotonic() >= deadline:
            return False
        sleep(2.0)


def dcgmi_command(level, image, host_engine=None):
    """`dcgmi diag` on the host where its host engine answers (started first: an image that ships
    dcgmi need not enable nvidia-dcgm), else in the DCGM exporter's image (the DCGM it ships, with
    a host engine of its own) — the stack's images carry no DCGM on the host."""
    diag = ["dcgmi", "diag", "-r", str(level)]
    if _on_path("dcgmi") and (host_engine or host_engine_ready)():
        return diag
    return ["docker", "run", "--rm", "--gpus", "all", "--cap-add", "SYS_ADMIN", "--entrypoint", "sh", image,
            "-c", "nv-hostengine && exec " + " ".join(diag)]


def _tool_missing(code, out):
    """A check that could not run (its tool missing or without its service): not a GPU fault."""
    return code in (126, 127) or bool(NO_ENGINE.search(out))


def gate_checks(args):
    """[(check, ok, detail, tool)] in order; the first failures do not stop the others (one run says
    all). `tool` marks a check that could not run at all (nvidia-smi or dcgmi missing, no DCGM
    host engine): that says nothing about this node's GPUs, and another node has the same tools."""
    results = []
    code, out = _run(["nvidia-smi", "--query-gpu=index,persistence_mode", "--format=csv,noheader"], 60)
    rows = [r.split(",") for r in out.strip().splitlines() if r.strip()] if code == 0 else []
    results.append(("gpu_count", code == 0 and len(rows) == args.gpus,
                    f"nvidia-smi sees {len(rows)} GPUs, the type has {args.gpus}" if code == 0 else out.strip(),
                    _tool_missing(code, out)))
    off = [r[0].strip() for r in rows if len(r) > 1 and r[1].strip().lower() != "enabled"]
    if off:  # ParallelCluster's health check turns it on before DCGM; so do we, then look again
        _run(["nvidia-smi", "-pm", "1"], 60)
        code, out = _run(["nvidia-smi", "--query-gpu=index,persistence_mode", "--format=csv,noheader"], 60)
        off = [r.split(",")[0].strip() for r in out.strip().splitlines()
               if r.strip() and r.split(",")[-1].strip().lower() != "enabled"]
    results.append(("persistence_mode", not off, f"persistence mode off on GPUs {','.join(off)}" if off else "on", False))
    if args.nvswitch:
        code, out = _run(["systemctl", "is-active", "nvidia-fabricmanager"], 30)
        results.append(("fabric_manager", out.strip() == "active", f"nvidia-fabricmanager is {out.strip() or code}",
                        False))
    if args.diag_level:
        code, out = _run(dcgmi_command(args.diag_level, args.dcgm_image), args.diag_timeout)
        failed = [line.strip() for line in out.splitlines() if re.search(r"\bFail", line)]
        ok = code == 0 and not failed
        results.append(("dcgm_diag", ok, f"dcgmi diag -r {args.diag_level}: " +
                        ("passed" if ok else (failed[0] if failed else f"exit {code}: {out.strip()[-200:]}")),
                        not ok and not failed and _tool_missing(code, out)))
    if args.nvlinks:
        code, out = _run(["nvidia-smi", "nvlink", "-s"], 60)
        per_gpu, gpu = {}, None
        for line in out.splitlines():
            head = re.match(r"GPU (\d+):", line)
            if head:
                gpu = int(head.group(1))
                per_gpu[gpu] = 0
            elif gpu is not None and re.search(r"Link \d+: [\d.]+ GB/s", line):
                per_gpu[gpu] += 1
        short = {g: n for g, n in per_gpu.items() if n != args.nvlinks}
        ok = code == 0 and len(per_gpu) == args.gpus and not short
        results.append(("nvlink", ok, "all up" if ok else
                        f"NVLinks up per GPU {per_gpu or out.strip()[-120:]}, expected {args.nvlinks} on each of {args.gpus}",
                        _tool_missing(code, out)))
    return results
