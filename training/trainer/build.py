"""What a training run is made of: its dataset, its model (initialised from the seed, or on the
meta device without values when a checkpoint will fill them) and its learning-rate schedule."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from training.trainer import config as config_mod
from training.trainer.data import ImageFolder, SyntheticClassification, SyntheticTokens
from training.trainer.models import ResNet50, TinyGPT, TinyNet


def build_data(cfg: config_mod.TrainConfig) -> SyntheticClassification | ImageFolder | SyntheticTokens:
    """The dataset (its randomness comes from its own generators, never torch's global one)."""
    if cfg.workload == "gpt-tiny":
        return SyntheticTokens(cfg.tiny_samples, cfg.gpt_vocab, cfg.gpt_context, cfg.seed)
    if cfg.workload == "tiny":
        return SyntheticClassification(cfg.tiny_samples, cfg.tiny_dim, 10, cfg.seed)
    return ImageFolder(cfg.data_dir, cfg.image_size, cfg.seed)


def build_model(cfg: config_mod.TrainConfig, classes: int, device: torch.device | str = "cpu") -> nn.Module:
    """The model, its weights initialised from cfg.seed (identical on every rank). On the meta
    device it has shapes and no values (no initialisation: the resume path fills it)."""
    if str(device) == "meta":
        with torch.device("meta"):
            return build_model(cfg, classes)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    if cfg.workload == "gpt-tiny":
        return TinyGPT(cfg.gpt_vocab, cfg.gpt_dim, cfg.gpt_layers, cfg.gpt_heads, cfg.gpt_context)
    if cfg.workload == "tiny":
        return TinyNet(cfg.tiny_dim, cfg.tiny_width)
    model = ResNet50(classes, cfg.grad_checkpointing)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return model


def fully_restored(model: nn.Module) -> bool:
    """True when the model's state_dict holds every parameter and buffer: loading a checkpoint
    then sets every value, so the model may be built without initialising them."""
    named = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    return named <= set(model.state_dict())


def lr_lambda(cfg: config_mod.TrainConfig) -> Any:
    import math

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


# The settings that shape the result: resuming a checkpoint under other values is refused
# (--allow-config-change resumes anyway). The world size may change (elastic runs).
SHAPING = ("workload", "steps", "batch_size", "lr", "weight_decay", "warmup_steps", "seed", "image_size",
           "tiny_dim", "tiny_width", "tiny_samples", "precision", "gpt_vocab", "gpt_dim", "gpt_layers", "gpt_heads",
           "gpt_context")


def params_sha256(model: nn.Module) -> str:
    """sha256 of a replicated model's state, as full_params_sha256 hashes a sharded one's."""
    from training.ckpt.sharded import state_sha256

    return state_sha256(model.state_dict())


def config_drift(saved: dict[str, Any], cfg: config_mod.TrainConfig) -> list[str]:
    now = config_mod.as_dict(cfg)
    return [f"{k}={saved[k]!r} -> {now[k]!r}" for k in SHAPING if k in saved and saved[k] != now[k]]


def too_small(cfg: config_mod.TrainConfig, samples: int, world: int) -> str | None:
    """Why the data cannot fill one step on every rank (the loop would never take a step)."""
    global_batch = cfg.batch_size * world
    if samples >= global_batch:
        return None
    return (f"refused: the dataset has {samples} samples, fewer than one global batch (--batch-size "
            f"{cfg.batch_size} x {world} processes = {global_batch}): lower --batch-size or give it more data")


def refusal(cfg: config_mod.TrainConfig, step: int, state: dict[str, Any], rank: int) -> str | None:
    """Why the run must not go on from checkpoint `step` (complete, or its settings changed), or None."""
    if cfg.steps <= step:
        return f"complete: checkpoint step {step} is at or past --steps {cfg.steps}; nothing to run"
    drift = config_drift(state.get("config", {}), cfg)
    if drift and not cfg.allow_config_change:
        return (f"refused: checkpoint step {step} was trained with other settings ({', '.join(drift)}); "
                "resuming would change the result. Restore them, point at a new checkpoint URL, or pass "
                "--allow-config-change")
    if drift and rank == 0:
        logging.getLogger("gts.train").warning("resuming step %d with changed settings (--allow-config-change): %s",
                                               step, ", ".join(drift))
    return None


def final_digest(model: nn.Module, sharded: bool, rank: int) -> str:
    """The final line's params_sha256. Sharded: the full parameters, gathered (every rank takes
    part), so any sharding compares; replicated: rank 0's model."""
    if sharded:
        from training.ckpt.sharded import full_params_sha256

        return full_params_sha256(model)
    return params_sha256(model) if rank == 0 else ""
