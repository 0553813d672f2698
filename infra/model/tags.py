"""Tags every taggable resource carries (owner, cost-center, env, plus the stack's own)."""

from __future__ import annotations

from infra.model.spec import StackSpec


def stack_tags(spec: StackSpec, **extra: str) -> dict[str, str]:
    tags = {**spec.tags, "managed-by": "gpu-training-stack"}
    tags.update(extra)
    return tags
