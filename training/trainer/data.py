"""Datasets and a sampler that resume exactly.

Every random choice is a pure function of (seed, epoch, sample index) — shuffling, synthetic
samples and augmentation — so a resumed run draws the same batches as an uninterrupted one.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import Dataset, Sampler

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def derived_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (not Python's salted hash)."""
    return zlib.crc32(repr(parts).encode()) * 2654435761 % (1 << 63)


def generator(*parts: int) -> torch.Generator:
    return torch.Generator().manual_seed(derived_seed(*parts))


class SyntheticClassification(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Points labelled by a fixed random linear teacher, with per-epoch input noise."""

    def __init__(self, samples: int, dim: int, classes: int, seed: int):
        self.samples, self.dim, self.seed = samples, dim, seed
        self.teacher = torch.randn(classes, dim, generator=generator(seed, -1))
        self.epoch = 0

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.dim, generator=generator(self.seed, index))
        label = torch.argmax(self.teacher @ x)
        noise = torch.randn(self.dim, generator=generator(self.seed, self.epoch, index)) * 0.05
        return x + noise, label


class SyntheticTokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Token sequences from a fixed random Markov chain (learnable, nothing downloaded): each
    sample is (tokens[:-1], tokens[1:]), a function of (seed, index) only."""

    def __init__(self, samples: int, vocab: int, context: int, seed: int):
        self.samples, self.vocab, self.context, self.seed = samples, vocab, context, seed
        # each token has 4 likely successors: a language a small model can learn in a few steps
        self.successors = torch.randint(0, vocab, (vocab, 4), generator=generator(seed, -3))

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(self.seed, index)
        tokens = torch.empty(self.context + 1, dtype=torch.long)
        tokens[0] = torch.randint(0, self.vocab, (1,), generator=g)
        choice = torch.randint(0, 4, (self.context,), generator=g)
        for i in range(self.context):
            tokens[i + 1] = self.successors[tokens[i], choice[i]]
        return tokens[:-1], tokens[1:]


class ImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """<root>/<class>/<image>; random-resized-crop + flip drawn from (seed, epoch, index)."""

    def __init__(self, root: str, size: int, seed: int):
        base = Path(root)
        self.classes = sorted(p.name for p in base.iterdir() if p.is_dir())
        if not self.classes:
            raise FileNotFoundError(f"{root}: no class folders (expected <root>/<class>/<image>)")
        self.items = [(p, i) for i, c in enumerate(self.classes) for p in sorted((base / c).iterdir())
                      if p.suffix.lower() in IMAGE_EXTENSIONS]
        self.size, self.seed, self.epoch = size, seed, 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image  # only the image workload needs Pillow

        path, label = self.items[index]
        with Image.open(path) as img:
            rgb = img.convert("RGB")
        width, height = rgb.size
        g = generator(self.seed, self.epoch, index)
        area = width * height * (0.08 + 0.92 * torch.rand(1, generator=g).item())
        ratio = math.exp(math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * torch.rand(1, generator=g).item())
        w = max(1, min(width, int(round(math.sqrt(area * ratio)))))
        h = max(1, min(height, int(round(math.sqrt(area / ratio)))))
        left = int(torch.randint(0, width - w + 1, (1,), generator=g))
        top = int(torch.randint(0, height - h + 1, (1,), generator=g))
        crop = rgb.crop((left, top, left + w, top + h)).resize((self.size, self.size))
        pixels = torch.frombuffer(bytearray(crop.tobytes()), dtype=torch.uint8)
        tensor = pixels.view(self.size, self.size, 3).permute(2, 0, 1).float() / 255
        if torch.rand(1, generator=g).item() < 0.5:
            tensor = tensor.flip(-1)
        return (tensor - MEAN) / STD, label


class ResumableSampler(Sampler[int]):
    """DistributedSampler semantics (shuffle per epoch, equal shards, drop the tail) that can
    start part-way into an epoch: `set_epoch(e, start=k)` skips this rank's first k samples."""

    def __init__(self, length: int, replicas: int, rank: int, seed: int):
        self.length, self.replicas, self.rank, self.seed = length, replicas, rank, seed
        self.per_rank = length // replicas
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.length, generator=generator(self.seed, self.epoch, -2)).tolist()
        mine = order[: self.per_rank * self.replicas][self.rank::self.replicas]
        return iter(mine[self.start:])

    def __len__(self) -> int:
        return self.per_rank - self.start
