"""What a warm start (training/node/warm.py) will fork, and what it leaves to a cold start: the
settings a process reads as it loads, a CUDA driver loaded before a fork, the request's shape."""

from __future__ import annotations

import os
import random
import re
import socket
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

LOAD_TIME_PREFIXES = ("PYTHON", "LD_", "TORCH", "PYTORCH", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_",
                      "MALLOC_", "CUBLAS_", "CUDNN_")
RUN_TIME = ("TORCHELASTIC_", "TORCH_NCCL_", "OMP_NUM_THREADS", "PYTHON_EXEC")  # torchrun's, per worker or its own
MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def load_time(env: dict[str, str]) -> dict[str, str]:
    """The variables a process reads as it loads, which a fork cannot change afterwards."""
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES) and not k.startswith(RUN_TIME)}


def differs(mine: dict[str, str], theirs: dict[str, str]) -> str:
    """Why a worker with environment `theirs` cannot be forked from a process loaded with `mine`."""
    ours, wanted = load_time(mine), load_time(theirs)
    names = sorted(k for k in ours.keys() | wanted.keys() if ours.get(k) != wanted.get(k))
    if names:
        return f"{', '.join(names[:5])} differ{'s' if len(names) == 1 else ''} from the warm process's"
    if "OMP_NUM_THREADS" in mine and "OMP_NUM_THREADS" not in theirs:
        return "OMP_NUM_THREADS is set for the warm process and not for the worker"
    return ""


def cuda_loaded(maps: str = "/proc/self/maps") -> str:
    """Why a fork would break CUDA in the children, or ''."""
    try:
        text = Path(maps).read_text()
    except OSError:
        text = ""
    if "libcuda.so" in text:
        return "the CUDA driver was loaded while preloading (a forked worker could not use it)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch's CUDA state was initialised while preloading"
    return ""


class Request(BaseModel):
    """What warm_client.py sends: the worker's arguments after `python -u`, environment, folder,
    CPU affinity (torchrun's --numa-binding runs PYTHON_EXEC under numactl)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    args: list[str] = Field(min_length=1)
    env: dict[str, str]
    cwd: str
    cpus: list[int]


def unserved(request: Request, cpus: list[int]) -> str:
    """Why this request is not one to fork, or ''."""
    if sorted(request.cpus) != cpus:
        return "its CPU affinity differs from the warm process's (numactl, --numa-binding)"
    if request.args[0] == "-m":
        if len(request.args) < 2 or not MODULE.fullmatch(request.args[1]):
            return f"{request.args[:2]} is not `-m MODULE`"
        return ""
    if not Path(request.cwd, request.args[0]).is_file():  # a file, not a pipe or a device (/dev/stdin)
        return f"{request.args[0]!r} is not a file"
    return ""


def namespace(pid: int, kind: str = "mnt") -> str:
    """A process's namespace of `kind` (mnt, pid: which container it is in), or ''."""
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return ""


def settle() -> None:
    """What a fresh worker would have that the fork did not give."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    random.seed()


def client_gone(conn: socket.socket) -> bool:
    """Whether the client has closed its end (it gave up waiting)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
