"""Restoring a replicated model and its optimizers from a loaded checkpoint with as few copies as
the layout allows (issue 34: resume at read speed): the reference trainer's resume
(training/trainer/train.py) and the library's `Checkpointer.resume(assign=True)`."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn


def _import_dtensor() -> type:
    """DTensor, while another thread is still importing its module (the import waits for it)."""
    from torch.distributed.tensor import DTensor

    return DTensor


def holds_dtensors(obj: object) -> bool:
    """True for a model whose parameters are DTensors (FSDP2's `fully_shard`, tensor parallel)
    or an optimizer over such parameters: state no single rank holds whole. Without importing
    torch.distributed.tensor: no DTensor exists before it is."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return False
    dtensor: type = getattr(module, "DTensor", None) or _import_dtensor()
    if isinstance(obj, nn.Module):
        return any(isinstance(p, dtensor) for p in obj.parameters())
    if isinstance(obj, torch.optim.Optimizer):
        return any(isinstance(p, dtensor) for group in obj.param_groups for p in group["params"])
    return False


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
               and (saved[k].device == v.device or v.is_meta) for k, v in model.state_dict().items())
    if tied or not same or not empty:
        _give_memory(model, optimizers, "cpu")  # a model on meta holds nothing to copy into
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


def materialize(model: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device | str = "cpu") -> bool:
    """A model built on the meta device that no checkpoint filled: memory on `device`, values
    from each module's own `reset_parameters` (what its constructor would have drawn), the
    optimizers pointed at the new parameters. False (nothing done) when no parameter is on meta."""
    if not _give_memory(model, optimizers, device):
        return False
    with torch.no_grad():
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    return True


def _give_memory(model: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device | str) -> bool:
    """A model with parameters or buffers on the meta device: memory on `device` (values not
    set), the optimizers pointed at the new parameters. False when nothing is on meta."""
    before = dict(model.named_parameters())
    if not any(p.is_meta for p in before.values()) and not any(b.is_meta for b in model.buffers()):
        return False
    if len(before) != len(list(model.named_parameters(remove_duplicate=False))):
        # torch's to_empty gives each module its own copy of a shared parameter: the tie would be lost
        raise ValueError("a model with tied (shared) parameters is on the meta device: give it memory "
                         "(model.to_empty(device=...)) and tie its parameters again before resume")
    model.to_empty(device=device)
    after = {id(before[name]): param for name, param in model.named_parameters()}
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [after.get(id(param), param) for param in group["params"]]
    return True
