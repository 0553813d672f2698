"""DCP's metadata is a pickle that a restore reads from a bucket's step folder or from a peer copy
(issue 46 review): it is read with DCP's own classes only, and every file it names must be one of
the folder's shard files. torch's own reader unpickles anything."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict_saver import save

from training.ckpt.manager import CheckpointError
from training.ckpt.sharded import METADATA, _Reader, _Writer


def _saved(folder: Path) -> None:
    state = {"model": {"w": torch.ones(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16), "i": torch.arange(3)},
             "optim": {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(3, 4)}},
                       "param_groups": [{"lr": 0.1, "params": ["w"], "betas": (0.9, 0.99)}]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        save(state, storage_writer=_Writer(str(folder)), no_dist=True)


def test_a_real_save_s_metadata_reads(tmp_path: Path) -> None:
    _saved(tmp_path)
    metadata = _Reader(str(tmp_path)).read_metadata()
    assert "model.w" in metadata.state_dict_metadata and metadata.storage_meta is not None
    assert {str(i.relative_path) for i in metadata.storage_data.values()} == {"__0_0.distcp"}


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_metadata_that_would_run_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / METADATA).write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        _Reader(str(tmp_path)).read_metadata()
    assert not marker.exists()


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "sub/__0_0.distcp", "model.pt"])
def test_metadata_naming_a_file_outside_the_folder_s_shards_is_refused(tmp_path: Path, name: str) -> None:
    _saved(tmp_path)
    with open(tmp_path / METADATA, "rb") as fh:
        metadata = pickle.load(fh)  # the test's own file
    for info in metadata.storage_data.values():
        info.relative_path = name
    (tmp_path / METADATA).write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="not this folder's shards"):
        _Reader(str(tmp_path)).read_metadata()
