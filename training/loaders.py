"""A DataLoader as checkpointed state: where the loop is in the data, and the loader's randomness.

A loop written the usual way (a `DistributedSampler` with shuffling, a `DataLoader`, dropout)
does not resume exactly by restoring the model and the RNG alone: creating a DataLoader
iterator draws its base seed from the global RNG, so the resumed run — which creates its
iterator after the RNG was restored — draws one number more than the uninterrupted run, and
every later dropout mask differs; and the batches the interrupted epoch already consumed
must be skipped.

`LoaderState` fixes both for any loader passed to the Checkpointer (`loader=loader`): per rank it
records the sampler's epoch, how many batches the current iterator yielded and the RNG state
the iterator drew its seed from. On resume the sampler's epoch is set back; the first iterator
the loop creates draws the same seed, skips the consumed batches (without loading them when
the loader has no workers), and the global RNG is then put back where the checkpoint left it.
torchdata's `StatefulDataLoader` is checkpointed through its own `state_dict` (position and
worker state), with the same RNG rule.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

log = logging.getLogger("gts.loaders")


# CPython releases whose os.fork can leave the child hung before it runs a line (gh-112275: a
# thread creating a Python thread state at the fork, as gloo's and NCCL's threads do when they
# free a finished collective, leaves the child a lock it takes before re-initialising it), by
# minor version: the first fixed release. 3.12 and later were never affected.
FORK_HANG_FIXED = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}


FORK_HANG_FIX = "pass multiprocessing_context='forkserver' to the DataLoader"


def fork_hang_warning(loader: DataLoader[Any], version: tuple[int, int, int] | None = None,
                      fix: str = FORK_HANG_FIX) -> str | None:
    """Why this loader's worker processes may hang as they start, and the fix, on a CPython
    with gh-112275: it starts them by fork (its own context, else the process's default)."""
    major, minor, micro = version or sys.version_info[:3]
    fixed = FORK_HANG_FIXED.get((major, minor))
    context = loader.multiprocessing_context
    method = context.get_start_method() if context is not None else multiprocessing.get_start_method(allow_none=True)
    method = method or multiprocessing.get_all_start_methods()[0]  # the platform's default, unfixed
    if loader.num_workers == 0 or fixed is None or micro >= fixed or method != "fork":
        return None
    return (f"Python {major}.{minor}.{micro} can hang a DataLoader worker as it is forked after a collective "
            f"(CPython issue gh-112275, fixed in {major}.{minor}.{fixed}): upgrade Python, or {fix}")


_WARNED: set[str] = set()


def warn_fork_hang(name: str, loader: DataLoader[Any], fix: str = FORK_HANG_FIX) -> None:
    """fork_hang_warning logged once a process for each loader name, where a process group exists
    (the collectives' threads that trigger the hang are the group's)."""
    if name in _WARNED or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if (warning := fork_hang_warning(loader, fix=fix)) is not None:
        _WARNED.add(name)
        log.warning("loader %r: %s", name, warning)


class LoaderMisuse(Exception):
    """The loop does not continue where the checkpoint says the loader was (one line: the fix)."""


def _sampler_of(loader: DataLoader[Any]) -> Any:
    sampler = loader.sampler
    if loader.batch_sampler is not None and hasattr(loader.batch_sampler, "sampler"):
        sampler = loader.batch_sampler.sampler
    return sampler


def _epoch_of(loader: DataLoader[Any]) -> int | None:
    epoch = getattr(_sampler_of(loader), "epoch", None)
    return int(epoch) if isinstance(epoch, int) else None


def _stateful(loader: DataLoader[Any]) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class LoaderState:
    """One rank's view of one DataLoader: `state_dict()` / `load_state_dict()` for the per-rank
    checkpoint file, and `after_resume(rng)` for the RNG rule above."""

    def __init__(self, name: str, loader: DataLoader[Any], set_rng: Any):
        self.name, self.loader, self._set_rng = name, loader, set_rng
        warn_fork_hang(name, loader)
        # torchdata's StatefulDataLoader is replayed like a DataLoader: its own state_dict restores
        # the position but re-seeds each worker at the epoch's start, so the augmentation workers
        # draw after a resume would differ (read only from checkpoints written before).
        self.stateful = False
        self._iterator: Any = None
        self._pre_seed: torch.Tensor | None = None  # the RNG state the current iterator drew its seed from
        self._pre_sampler: torch.Tensor | None = None  # the sampler's own generator then (torchdata's has one)
        self._pending: dict[str, Any] | None = None  # a restored position, applied at the next iterator
        self._rng_after: dict[str, Any] | None = None  # the checkpoint's RNG, put back after that iterator
        self.epoch = 0  # the epoch the restored position is in (ckpt.epoch)
        self._iterators = 0  # iterators (epochs) begun since the start or the restore
        sampler = _sampler_of(loader)
        if loader.generator is None:  # its own stream: the seed draw never moves the global RNG
            loader.generator = torch.Generator().manual_seed(torch.initial_seed())
            if isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None:
                sampler.generator = loader.generator
        original = loader._get_iterator

        def tracked() -> Any:
            return self._new_iterator(original)
        loader._get_iterator = tracked  # type: ignore[method-assign]

    def _seed_source(self) -> torch.Generator:
        return self.loader.generator if self.loader.generator is not None else torch.default_generator

    def _sampler_generator(self) -> torch.Generator | None:
        generator = getattr(_sampler_of(self.loader), "generator", None)
        return generator if isinstance(generator, torch.Generator) and generator is not self.loader.generator else None

    def _new_iterator(self, original: Any) -> Any:
        pending, self._pending = self._pending, None
        epoch = _epoch_of(self.loader)
        if pending is not None and not self.stateful and pending["epoch"] is not None and epoch is not None \
                and epoch != pending["epoch"]:
            raise LoaderMisuse(
                f"loader {self.name!r} was in epoch {pending['epoch']} (batch {pending['batches']}) at the checkpoint, "
                f"but the loop started epoch {epoch}: start the epoch loop at ckpt.epoch "
                f"(for epoch in range(ckpt.epoch, epochs): sampler.set_epoch(epoch) ...)")
        if pending is not None and not self.stateful and pending.get("seed_state") is not None:
            self._seed_source().set_state(pending["seed_state"])
        own = self._sampler_generator()
        if pending is not None and own is not None and pending.get("sampler_state") is not None:
            own.set_state(pending["sampler_state"])
        self._pre_seed = self._seed_source().get_state()
        self._pre_sampler = own.get_state() if own is not None else None
        self._iterators += 1
        iterator = original()
        self._iterator = iterator
        if pending is not None and not self.stateful and pending["batches"]:
            self._skip(iterator, int(pending["batches"]))
        if self._rng_after is not None:
            rng, self._rng_after = self._rng_after, None
            self._set_rng(rng)  # the seed draw and the skipped batches leave no trace on the global RNG
        return iterator

    def _skip(self, iterator: Any, batches: int) -> None:
        if (self.loader.num_workers == 0 and hasattr(iterator, "_sampler_iter")
                and not isinstance(self.loader.dataset, IterableDataset)):
            for _ in range(batches):  # indices only: no batch is loaded
                next(iterator._sampler_iter)
            iterator._num_yielded += batches
        else:  # workers: consumed as the first run did, so each worker's RNG stream is where it was
            for _ in range(batches):
                next(iterator)
        log.info("loader %r: skipped the %d batch(es) epoch %s had consumed", self.name, batches, self.epoch)

    # -- checkpointed state ------------------------------------------------------------------
    def current_epoch(self) -> int:
        """The epoch the loop is in: the sampler's (set_epoch), else the loader's iterators
        counted from the restored epoch (a plain shuffling loader, torchdata's loader)."""
        epoch = _epoch_of(self.loader)
        if epoch is not None and callable(getattr(_sampler_of(self.loader), "set_epoch", None)):
            return epoch
        return self.epoch + max(self._iterators - 1, 0)

    def state_dict(self) -> dict[str, Any]:
        batches = int(getattr(self._iterator, "_num_yielded", 0)) if self._iterator is not None else 0
        return {"epoch": self.current_epoch(), "batches": batches, "seed_state": self._pre_seed,
                "sampler_state": self._pre_sampler}

    def load_state_dict(self, state: dict[str, Any], rng: dict[str, Any] | None) -> None:
        epoch = state.get("epoch")
        self.epoch = int(epoch) if epoch is not None else 0
        self._iterators = 0
        sampler = _sampler_of(self.loader)
        if epoch is not None and callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(int(epoch))
        if "stateful" in state and _stateful(self.loader):  # written before: its own state (epoch start seeds)
            self.stateful = True
            self.loader.load_state_dict(state["stateful"])  # type: ignore[attr-defined]
        self._pending = dict(state)
        self._rng_after = rng
