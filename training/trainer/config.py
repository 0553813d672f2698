"""Training configuration: one typed dataclass, read from defaults < a YAML/JSON file
(--config) < the environment the node bootstrap and the Kubernetes Job set < command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, NoReturn, get_args
from urllib.parse import urlsplit

import yaml

from training import contract


Workload = Literal["tiny", "resnet50", "gpt-tiny"]
Sharding = Literal["none", "fsdp"]
Precision = Literal["fp32", "bf16", "fp16"]
Launcher = Literal["auto", "torchrun", "accelerate", "horovod"]
CHOICES = {"workload": get_args(Workload), "sharding": get_args(Sharding), "precision": get_args(Precision), "launcher": get_args(Launcher)}


@dataclass(frozen=True)
class TrainConfig:
    # what to train
    workload: Workload = "tiny"  # synthetic and CPU-friendly, ResNet-50 on an image folder, or a small GPT
    sharding: Sharding = "none"  # none: every rank holds the whole model (DDP); fsdp: FSDP2 shards it over the ranks
    data_dir: str = ""  # image-folder root for resnet50 (class sub-folders of images)
    image_size: int = 224  # resnet50 input resolution
    steps: int = 200  # optimizer steps in total (across restarts)
    batch_size: int = 32  # per rank
    lr: float = 0.01  # peak learning rate
    weight_decay: float = 0.0001  # AdamW weight decay
    warmup_steps: int = 10  # linear warm-up, then cosine decay to 0 at `steps`
    seed: int = 1234  # everything random derives from it (init, shuffling, augmentation)
    # tiny workload shape (the benchmark raises width to reach a given state size)
    tiny_dim: int = 32
    tiny_width: int = 64
    tiny_samples: int = 4096
    # gpt-tiny: a decoder-only transformer built in code, on synthetic token sequences
    gpt_vocab: int = 64  # tokens in the vocabulary
    gpt_dim: int = 32  # model width (a multiple of gpt_heads)
    gpt_layers: int = 2  # decoder blocks (each one FSDP unit)
    gpt_heads: int = 4  # attention heads
    gpt_context: int = 16  # tokens per sequence
    # numerics and memory
    precision: Precision = "fp32"  # bf16: autocast; fp16: autocast + GradScaler (CUDA only)
    grad_checkpointing: bool = False  # recompute activations in the backward pass (resnet50)
    channels_last: bool = True  # NHWC memory format for convolutions (resnet50)
    num_workers: int = 0  # DataLoader worker processes
    # checkpoints
    checkpoint_every: int | Literal["auto"] = 500  # steps, or auto (training/goodput.py); also on SIGTERM / SIGINT
    mtbf_s: float = 0.0  # auto: mean seconds between interruptions of this run (0: unknown, 6 h assumed)
    notice_s: float = 0.0  # auto: seconds of reclaim notice
    checkpoint_dir: str = "out/checkpoints"  # local dir (NVMe), or a URL: then a local cache is used
    checkpoint_url: str = ""  # object storage for checkpoints (s3://, oss://, cosn://, file://)
    keep: int = 3  # newest checkpoints kept locally and in the bucket
    upload_deadline_s: float = 90.0  # on exit, how long to wait for pending uploads
    allow_config_change: bool = False  # resume a checkpoint trained with other result-shaping settings
    # operations
    launcher: Launcher = "auto"  # auto: detected from the environment the launcher sets
    log_every: int = 10  # steps between log lines / metric pushes
    metrics_port: int = 0  # Prometheus endpoint on local rank 0; 0 = off
    node_hourly_usd: float = 0.0  # the node's price, for the cost-so-far metric
    throttle_ms: int = 0  # sleep per step: lets a person interrupt `make train-local` by hand

    def local_and_remote(self) -> tuple[str, str]:
        """(local checkpoint dir, remote URL or '')."""
        if "://" in self.checkpoint_dir and not self.checkpoint_dir.startswith("file://"):
            return str(Path("out") / "checkpoint-cache"), self.checkpoint_dir
        local = self.checkpoint_dir.removeprefix("file://")
        return local, self.checkpoint_url


ENV = contract.CONFIG_FIELDS  # environment variable -> field (training/contract.py: the node env and the Job)
FIELD_ENV = {name: var for var, name in ENV.items()}

# The smallest value each number takes (and whether it may equal it): one line naming the
# setting otherwise, before anything starts (a batch size of 0 would divide by zero later).
BOUNDS: dict[str, tuple[float, bool]] = {
    "image_size": (1, True), "steps": (1, True), "batch_size": (1, True), "lr": (0, False), "weight_decay": (0, True),
    "warmup_steps": (0, True), "tiny_dim": (1, True), "tiny_width": (1, True), "tiny_samples": (1, True), "gpt_vocab": (2, True),
    "gpt_dim": (1, True), "gpt_layers": (1, True), "gpt_heads": (1, True), "gpt_context": (1, True),
    "num_workers": (0, True), "mtbf_s": (0, True), "notice_s": (0, True), "keep": (1, True),
    "upload_deadline_s": (0, True), "log_every": (1, True), "metrics_port": (0, True), "node_hourly_usd": (0, True),
    "throttle_ms": (0, True)}


def field_help() -> dict[str, str]:
    """Each field's meaning: its comment in TrainConfig (the one place it is written)."""
    import inspect

    found = {}
    for line in inspect.getsource(TrainConfig).splitlines():
        m = re.match(r"^    (\w+): [^=]+= .*?  # (.*)$", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def _coerce(name: str, value: Any) -> Any:
    kind = {f.name: f.type for f in fields(TrainConfig)}[name]
    if name == "checkpoint_every":
        return "auto" if str(value) == "auto" else int(value)
    if kind in ("bool", bool):
        return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
    if kind in ("int", int):
        return int(value)
    if kind in ("float", float):
        return float(value)
    return str(value)


STORES = ("s3", "oss", "cosn", "file")  # the schemes training/ckpt/storage.py writes to


def storage_problem(value: str, empty_ok: bool) -> str:
    """Why a checkpoint folder or URL cannot be used ('' when it can): an empty value would be the
    current directory (the checkout, for make train-local), a scheme the storage does not write
    would fail at the first save, and `s3://` alone names no bucket."""
    if not value.strip():
        return "" if empty_ok else ("is empty, which would be the current directory: name a folder (e.g. "
                                    "out/checkpoints) or a bucket URL (s3://<bucket>/<path>)")
    parts = urlsplit(value)
    scheme = parts.scheme.lower()  # S3://bucket/p is s3:// (urlsplit and training/ckpt/storage.py read it so)
    if not scheme:  # a folder: ':' further on is a file name's (run-2026-01-01T10:00, out/run:3)
        first = value.split("/", 1)[0]
        return (f"holds ':' but is not a URL (scheme://bucket/path): for a folder write ./{value}" if ":" in first
                else "")
    folder = "" if "://" in value else f" (for a folder write ./{value})"
    if scheme not in STORES:
        return (f"{scheme}:// is not a storage the trainer writes; use {', '.join(s + '://' for s in STORES)} or a "
                f"path{folder}")
    if folder:
        return f"is not a URL: write {scheme}://<bucket>/<path>{folder}"
    if scheme != "file":
        return "" if parts.netloc else f"names no bucket; write {scheme}://<bucket>/<path>"
    if parts.netloc not in ("", "localhost"):
        return (f"names the host {parts.netloc!r}, which a file:// URL cannot reach (file://{parts.netloc}/... is "
                "not a folder here): write file:///<absolute path>, three slashes")
    return "" if parts.path.strip("/") else "names no folder; write file:///<absolute path>"


def _check_places(parser: argparse.ArgumentParser, cfg: TrainConfig, origin: dict[str, str]) -> None:
    """The checkpoint folder and URL: usable (storage_problem), and the local folder creatable."""
    for name in ("checkpoint_dir", "checkpoint_url"):
        why = storage_problem(getattr(cfg, name), empty_ok=name == "checkpoint_url")
        if why:
            _refuse(parser, f"{origin.get(name, '--' + name.replace('_', '-'))}={getattr(cfg, name)!r}: {why}")
    local, _ = cfg.local_and_remote()
    blocking = next((p for p in [Path(local), *Path(local).parents] if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        _refuse(parser, f"{origin.get('checkpoint_dir', '--checkpoint-dir')}={cfg.checkpoint_dir!r}: {blocking} is a "
                "file, not a folder: name a folder (it is created if missing)")
    nearest = next(p for p in [Path(local).absolute(), *Path(local).absolute().parents] if p.exists())
    if not os.access(nearest, os.W_OK | os.X_OK):
        _refuse(parser, f"{origin.get('checkpoint_dir', '--checkpoint-dir')}={cfg.checkpoint_dir!r}: {nearest} cannot "
                "be written: name a folder you can write (it is created if missing)")


def _refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """A bad value: one line naming it (the usage text would bury it in every rank's log)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not the usage text in every rank's log
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def parser() -> argparse.ArgumentParser:
    described = field_help()
    parser = _Parser(prog="python -m training.trainer.train", usage="%(prog)s [options]", allow_abbrev=False,
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     description="gpu-training-stack trainer. Each setting comes from, lowest first: its default, "
                     "--config, the\ntrainer-contract variable named with it (the stack sets them on every node "
                     "and Job), the flag.",
                     epilog="Exit codes: 0 done or stopped cleanly (checkpoint committed); 1 a fault (a checkpoint "
                     "that could not\nbe written included); 2 a usage error or a refusal (one line says which); "
                     "75 a peer node was stopped.")
    parser.add_argument("--config", help="YAML or JSON file with the settings below (by field name, e.g. batch_size)")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        var = FIELD_ENV.get(f.name)
        choices = CHOICES.get(f.name)
        text = described.get(f.name, "") + (f" ({' | '.join(choices)})" if choices else "")
        text += f" [default: {f.default}" + (f"; env {var}]" if var else "]")
        text = text.replace("%", "%%")
        if f.type in ("bool", bool):
            parser.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=text)
        else:
            parser.add_argument(flag, dest=f.name, default=None, help=text, metavar=f.name.upper())
    return parser


def parse(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> TrainConfig:
    parser = globals()["parser"]()
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    config_file = args.pop("config")
    if config_file:
        try:
            text = Path(config_file).read_text(encoding="utf-8")
            loaded = json.loads(text) if config_file.endswith(".json") else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            _refuse(parser, f"--config {config_file}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        if loaded is not None and not isinstance(loaded, dict):
            _refuse(parser, f"--config {config_file}: expected a mapping of settings")
        unknown = set(loaded or {}) - {f.name for f in fields(TrainConfig)}
        if unknown:
            _refuse(parser, f"{config_file}: unknown settings {sorted(unknown)}")
        values.update(loaded or {})
    env = os.environ if environ is None else environ
    origin = {name: f"{config_file}: {name}" for name in values}
    for var, name in ENV.items():
        if env.get(var):
            values[name], origin[name] = env[var], f"the environment variable {var}"
    for name, value in args.items():
        if value is not None:
            values[name], origin[name] = value, "--" + name.replace("_", "-")
    coerced = {}
    for name, value in values.items():
        try:
            coerced[name] = _coerce(name, value)
        except ValueError:
            kind = {f.name: f.type for f in fields(TrainConfig)}[name]
            _refuse(parser, f"{origin[name]}={value!r}: expected {'a whole number' if kind in ('int', int) else 'a number' if kind in ('float', float) else 'a whole number or auto'}")
    for problem in contract.problems(dict(env)):
        _refuse(parser, problem)
    cfg = TrainConfig(**coerced)
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            _refuse(parser, f"{origin[name]}={getattr(cfg, name)!r}: use one of {', '.join(allowed)}")
    if cfg.checkpoint_every != "auto" and cfg.checkpoint_every <= 0:
        _refuse(parser, f"{origin['checkpoint_every']}={cfg.checkpoint_every}: a positive number of steps, or auto")
    for name, (least, inclusive) in BOUNDS.items():
        value = getattr(cfg, name)
        if value < least or (value == least and not inclusive) or value != value:  # NaN too
            _refuse(parser, f"{origin.get(name, name)}={value!r}: must be {'at least' if inclusive else 'more than'} "
                    f"{least:g}")
    if cfg.metrics_port > 65535:
        _refuse(parser, f"{origin['metrics_port']}={cfg.metrics_port}: a TCP port (0 = off, at most 65535)")
    _check_places(parser, cfg, origin)
    if cfg.workload == "gpt-tiny" and cfg.gpt_dim % cfg.gpt_heads:
        _refuse(parser, f"--gpt-dim {cfg.gpt_dim} is not a multiple of --gpt-heads {cfg.gpt_heads}")
    if cfg.workload == "resnet50" and not cfg.data_dir:
        _refuse(parser, "--workload resnet50 needs --data-dir (an image folder: <dir>/<class>/<image>)")
    return cfg


def as_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


if __name__ == "__main__":  # the entrypoint's check of the options before any launcher starts
    import sys

    parse(sys.argv[1:])
    sys.exit(0)
