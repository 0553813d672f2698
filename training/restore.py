"""Restoring a replicated model and its optimizers from a loaded checkpoint with as few copies as
the layout allows (issue 34: resume at read speed): the reference trainer's resume
(training/trainer/train.py) and the library's `Checkpointer.resume(assign=True)`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def restore_model(model: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
                  saved: dict[str, Any], empty: bool) -> bool:
    """The saved parameters into `model`. A model built without values (`empty`: meta, then
    to_empty on the CPU) takes the loaded tensors themselves: no copy of the weights; the
    optimizer, built over the empty ones, is pointed at them before its state is loaded. Not for
    a model whose modules share a parameter (assigning would give each its own) or whose saved
    values have other types, layouts or devices: those are copied. True when the model took them."""
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
    before = dict(model.named_parameters())
    tied = len(before) != len(list(model.named_parameters(remove_duplicate=False)))
    same = all(isinstance(saved.get(k), torch.Tensor) and saved[k].dtype == v.dtype and saved[k].stride() == v.stride()
               and saved[k].device == v.device for k, v in model.state_dict().items())
    if tied or not same or not empty:
        model.load_state_dict(saved)  # a copy: ties kept, values cast to the model's types and layout
        return False
    model.load_state_dict(saved, assign=True)  # checks names and shapes as a copy does
    loaded = {id(before[name]): param for name, param in model.named_parameters()}
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [loaded.get(id(param), param) for param in group["params"]]
    return True


def own_moments(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's state in storages of its own. A mapped checkpoint (training/
    checkpoint_load.py) gives every tensor a slice of one mapping: once the model has copied its
    weights, moments that are still such slices would keep the weights' part of the mapping (a
    third of an AdamW state) resident for the whole run. A read checkpoint's tensors own their
    storage already; so do tensors the optimizer moved to a GPU."""
    for values in optimizer.state.values():
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > value.nbytes:
                values[key] = value.clone()
