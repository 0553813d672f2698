"""Training configuration: one typed dataclass, read from defaults < a YAML/JSON file
(--config) < the environment the node bootstrap and the Kubernetes Job set < command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from training import contract


Workload = Literal["tiny", "resnet50"]
Precision = Literal["fp32", "bf16", "fp16"]
Launcher = Literal["auto", "torchrun", "accelerate", "horovod"]
CHOICES = {"workload": get_args(Workload), "precision": get_args(Precision), "launcher": get_args(Launcher)}


@dataclass(frozen=True)
class TrainConfig:
    # what to train
    workload: Workload = "tiny"  # synthetic and CPU-friendly, or ResNet-50 on an image folder
    data_dir: str = ""  # image-folder root for resnet50 (class sub-folders of images)
    image_size: int = 224  # resnet50 input resolution
    steps: int = 200  # optimizer steps in total (across restarts)
    batch_size: int = 32  # per rank
    lr: float = 0.01  # peak learning rate
    weight_decay: float = 0.0001
    warmup_steps: int = 10  # linear warm-up, then cosine decay to 0 at `steps`
    seed: int = 1234  # everything random derives from it (init, shuffling, augmentation)
    # tiny workload shape (the benchmark raises width to reach a given state size)
    tiny_dim: int = 32
    tiny_width: int = 64
    tiny_samples: int = 4096
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


def _refuse(parser: argparse.ArgumentParser, message: str) -> None:
    """A bad value: one line naming it (the usage text would bury it in every rank's log)."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def parse(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> TrainConfig:
    parser = argparse.ArgumentParser(description="gpu-training-stack trainer", allow_abbrev=False)
    parser.add_argument("--config", help="YAML or JSON file with TrainConfig fields")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(flag, dest=f.name, default=None)
    args = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    config_file = args.pop("config")
    if config_file:
        text = Path(config_file).read_text(encoding="utf-8")
        loaded = json.loads(text) if config_file.endswith(".json") else yaml.safe_load(text)
        unknown = set(loaded or {}) - {f.name for f in fields(TrainConfig)}
        if unknown:
            parser.error(f"{config_file}: unknown settings {sorted(unknown)}")
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
    if (cfg.checkpoint_every != "auto" and cfg.checkpoint_every <= 0) or cfg.steps <= 0:
        parser.error("--checkpoint-every (a number of steps, or auto) and --steps must be positive")
    if cfg.workload == "resnet50" and not cfg.data_dir:
        parser.error("--workload resnet50 needs --data-dir (an image folder: <dir>/<class>/<image>)")
    return cfg


def as_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
