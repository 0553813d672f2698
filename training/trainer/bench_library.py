"""make bench's library resume (training/trainer/bench_resume.py): the checkpoint library on the
path its docs give a user's own loop, timed from process start to the first step after a resume
from the bucket with an empty local disk.

    python -m training.trainer.bench_library write  --url s3://bench/lib --width 2900
    python -m training.trainer.bench_library resume --url s3://bench/lib --width 2900 [--plain]
    python -m training.trainer.bench_library fresh --width 2900

`resume` is the fast path of docs/trainer-and-library.md: the fetch started first thing, before
torch is imported (training/ckpt/fetch_process.py `prefetch`: a process of its own fetches and
checks the newest step), the Checkpointer made before the model (it takes that fetch and maps
what it fetched while the model is built), the model built on the meta device and given memory
without initial values, `resume(assign=True)`. `--plain` is the
three-line path: the model built and initialised first, then `Checkpointer(model=..., ...)`.
`fresh` is the same loop with no checkpoint and without the library: the model built as the fast
path builds it and zero-filled, AdamW, one step (the floor under any resume of this loop)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    import torch

    x, y = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)), torch.randint(0, 10, (64,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    torch.autograd.backward(loss)
    opt.step()
    return float(loss.detach())


def _model(width: int, meta: bool = False) -> torch.nn.Module:
    """TinyNet, initialised; or `meta`: built on the meta device, then given memory without
    initial values (the fast path's way: the checkpoint fills it)."""
    import torch

    from training.trainer.models import TinyNet

    if not meta:
        return TinyNet(32, width)
    with torch.device("meta"):
        model = TinyNet(32, width)
    return model.to_empty(device="cpu")


def write(url: str, width: int) -> None:
    import torch

    from training.ckpt.checkpointer import Checkpointer

    torch.manual_seed(0)
    model = _model(width)
    opt = torch.optim.AdamW(model.parameters())
    with Checkpointer(url=url, local_dir=tempfile.mkdtemp(prefix="gts-bench-lib-", dir="."), upload_deadline_s=600,
                      model=model, optimizer=opt) as ckpt:
        _step(model, opt)
        ckpt.save(1)


def fresh(width: int) -> int:
    """The loop with nothing to resume, less what a resume need not do: the model built as the
    fast path builds it (on the meta device, then given memory without initial values), that
    memory zero-filled (a resume's loaded values are written once too; no uninitialised values
    in the step), AdamW, one step. Never imports the library."""
    import torch

    model = _model(width, meta=True)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()
    opt = torch.optim.AdamW(model.parameters())
    print(f"step 1 loss {_step(model, opt):.4f}", flush=True)
    return 0


def resume(url: str, width: int, plain: bool) -> int:
    if not plain:
        from training.ckpt.fetch_process import prefetch

        prefetch(url)  # first thing, before torch is imported: the fetch runs in a process of its own
    import torch

    from training.ckpt.checkpointer import Checkpointer

    disk = tempfile.mkdtemp(prefix="gts-bench-lib-", dir=".")  # in the bench's folder for this run, removed with it
    if plain:
        model = _model(width)
        opt = torch.optim.AdamW(model.parameters())
        ckpt = Checkpointer(url=url, local_dir=disk, upload_deadline_s=0, model=model, optimizer=opt)
        step = ckpt.resume()
    else:
        ckpt = Checkpointer(url=url, local_dir=disk, upload_deadline_s=0)  # takes the fetch prefetch started
        model = _model(width, meta=True)
        opt = torch.optim.AdamW(model.parameters())
        step = ckpt.track(model=model, optimizer=opt).resume(assign=True)
    print(f"resumed from step {step}", flush=True)
    print(f"step {step + 1} loss {_step(model, opt):.4f}", flush=True)
    ckpt.close()
    return 0 if step == 1 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.trainer.bench_library")
    parser.add_argument("action", choices=("write", "resume", "fresh"))
    parser.add_argument("--url", help="the checkpoint's store (write and resume)")
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--plain", action="store_true", help="the three-line path (model built first)")
    args = parser.parse_args(argv)
    if args.action == "fresh":
        return fresh(args.width)
    if not args.url:
        parser.error(f"{args.action} needs --url (the checkpoint's store, e.g. s3://bench/lib)")
    if args.action == "write":
        write(args.url, args.width)
        return 0
    return resume(args.url, args.width, args.plain)


if __name__ == "__main__":
    sys.exit(main())
