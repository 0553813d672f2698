"""The background save starts writing while the loop still copies the state (issue 44: the copy
off the time to durable): each storage is written only once its copy is in, nothing is hashed
until every copy is (the hash threads would take the loop's cores), a copy that fails commits
nothing, and the hashing writer never holds memory that may change after a write returns."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch

from training.ckpt import digest, staging
from training.ckpt.manager import MODEL_FILE, CheckpointManager, Topology, rng_name, step_dir
from training.ckpt.staging import CopyFailed, HashingWriter, Staged, Stager, save_hashed

TOPO = Topology(rank=0, local_rank=0, world_size=1, node=0, nnodes=1, local_world_size=1)
WAIT_S = 60  # an event that never comes fails the test (no duration is asserted)


def _pieces(data: bytes, piece: int) -> str:
    return str(blake3.blake3(b"".join(blake3.blake3(data[i:i + piece]).digest()
                                      for i in range(0, len(data), piece))).hexdigest())


def _state(value: float) -> dict[str, Any]:
    return {"a": torch.full((300, 300), value), "b": torch.full((7,), value), "step": int(value),
            "c": [torch.full((200, 50), -value)]}


def test_each_storage_is_written_only_once_its_copy_is_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer starts first and must wait: the copy is held until it does. A writer that did
    not wait would never signal, and its file would hold the buffers' old values."""
    monkeypatch.setattr(digest, "PIECE", 1 << 16)  # pieces that straddle storages and records
    stager = Stager()
    stager.stage(_state(1.0))  # the buffers hold step 1's values
    staged, copies = stager.plan(_state(2.0))
    copying = Staged(staged, copying=True)
    waiting, hashed_early = threading.Event(), []
    wait, piece = Staged.wait, staging._piece_digest

    def spy_wait(self: Staged, span: int | None = None) -> None:
        if span is not None:
            waiting.set()
        wait(self, span)

    def spy_piece(parts: list[memoryview]) -> bytes:
        hashed_early.append(not copying.all_in.is_set())
        return piece(parts)

    monkeypatch.setattr(Staged, "wait", spy_wait)
    monkeypatch.setattr(staging, "_piece_digest", spy_piece)
    result: dict[str, Any] = {}
    writer = threading.Thread(target=lambda: result.update(saved=save_hashed(staged, tmp_path / "m.pt", copying)),
                              daemon=True)
    writer.start()
    try:
        assert waiting.wait(WAIT_S), "the writer never waited for a copy"
    finally:
        Stager.fill(copies, copying)  # the writer is never left waiting
    writer.join(WAIT_S)
    size, hexdigest = result["saved"]
    data = (tmp_path / "m.pt").read_bytes()
    assert size == len(data) and hexdigest == _pieces(data, 1 << 16)
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert torch.equal(loaded["a"], torch.full((300, 300), 2.0)) and torch.equal(loaded["c"][0], torch.full((200, 50), -2.0))
    assert hashed_early and not any(hashed_early), "a piece was hashed while the loop still copied"


def test_a_copy_that_fails_commits_nothing_and_the_next_save_does(tmp_path: Path) -> None:
    mgr = CheckpointManager(str(tmp_path), None, TOPO)
    try:
        bad = {**_state(1.0), "d": torch.empty(5, device="meta")}  # its copy raises, after "a"'s and "b"'s
        with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
            mgr.save(1, bad, {"x": torch.ones(1)}, lambda: None)
        assert mgr.local_steps() == [] and "copy of the state failed" in mgr.write_error
        assert not list(tmp_path.glob("step-*")), "no partial step is left"
        mgr.save(2, _state(2.0), {"x": torch.ones(1)}, lambda: None)
        assert mgr.local_steps() == [2] and not mgr.write_error
        saved, _ = mgr.load(2)
        assert torch.equal(saved["a"], torch.full((300, 300), 2.0))
    finally:
        mgr.close()
    assert (tmp_path / step_dir(2) / MODEL_FILE).is_file()


def test_a_failed_copy_ends_a_writer_that_waits_for_it(tmp_path: Path) -> None:
    stager = Stager()
    staged, copies = stager.plan(_state(3.0))
    copying = Staged(staged, copying=True)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            save_hashed(staged, tmp_path / "m.pt", copying)
        except CopyFailed as exc:
            errors.append(exc)

    writer = threading.Thread(target=write, daemon=True)  # a regression fails the test, never holds the exit
    writer.start()
    broken = [*copies[:1], (copies[1][0], torch.empty(copies[1][1].shape, device="meta"))]
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        Stager.fill(broken, copying)
    writer.join(WAIT_S)
    assert not writer.is_alive() and errors and "copy of the state failed" in str(errors[0])
    assert not (tmp_path / "m.pt").exists() and not (tmp_path / "m.pt.part").exists()


def test_a_write_from_memory_that_changes_afterwards_is_hashed_as_written(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes outside the state's storages (torch's records) may be reused once write returns:
    they are copied; a writer that held a view of them would hash the later bytes."""
    monkeypatch.setattr(digest, "PIECE", 64)
    scratch = bytearray(b"x" * 40)
    written = b""
    with (tmp_path / "f").open("wb") as fh, HashingWriter(fh) as writer:
        for fill in (b"a", b"b", b"c"):
            scratch[:] = fill * 40
            writer.write(scratch)
            written += bytes(scratch)
        scratch[:] = b"z" * 40  # changed before any piece past the first is hashed
        writer.write(b"")  # an empty write adds no piece
        fh.flush()
        hexdigest = writer.hexdigest()
    assert (tmp_path / "f").read_bytes() == written and hexdigest == _pieces(written, 64)


def test_an_empty_write_at_a_piece_boundary_adds_no_piece(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "PIECE", 64)
    with (tmp_path / "f").open("wb") as fh, HashingWriter(fh) as writer:
        writer.write(b"q" * 128)
        writer.write(b"")
        fh.flush()
        hexdigest = writer.hexdigest()
    assert hexdigest == _pieces(b"q" * 128, 64)


def test_the_state_s_own_storages_are_hashed_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A storage of the state is not copied by the writer (that was up to two pieces a storage):
    every write of its bytes is found in the state's spans."""
    monkeypatch.setattr(digest, "PIECE", 1 << 16)
    state = Stager().stage(_state(4.0))
    found: list[int | None] = []
    holding = Staged.holding

    def spy(self: Staged, view: memoryview) -> int | None:
        found.append(span := holding(self, view))
        return span

    monkeypatch.setattr(Staged, "holding", spy)
    save_hashed(state, tmp_path / "m.pt")
    spans = {k for k in found if k is not None}
    assert len(spans) == 3, f"each of the three storages is written from its own memory: {found}"


def test_a_storage_s_pieces_are_hashed_while_it_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once every copy is in, the pieces a storage's write completes are handed to the hash
    threads before the write starts, not after it returns: the write of a large storage (one
    pwrite) and the hashing of its pieces overlap, instead of leaving its hashes to the end. The
    digest is still the file's."""
    monkeypatch.setattr(digest, "PIECE", 1 << 12)
    state = Stager().stage({"a": torch.arange(5000, dtype=torch.float32), "step": 1})
    storage = state["a"].untyped_storage()
    handed_at_write: list[int] = []

    class Watching:
        def __init__(self, fh: Any) -> None:
            self.fh, self.writer = fh, None  # type: Any, HashingWriter | None

        def write(self, data: Any) -> int:
            view = memoryview(data)
            if self.writer is not None and torch.frombuffer(view, dtype=torch.uint8).data_ptr() == storage.data_ptr():
                handed_at_write.append(len(self.writer._digests))
            return int(self.fh.write(data))

        def flush(self) -> None:
            self.fh.flush()

    with (tmp_path / "m.pt").open("wb") as fh:
        watching = Watching(fh)
        with HashingWriter(watching, Staged(state)) as writer:  # type: ignore[arg-type]
            watching.writer = writer
            with staging._serialiser_options(aligned=False):
                torch.save(state, writer)  # type: ignore[arg-type]
            fh.flush()
            hexdigest = writer.hexdigest()
    data = (tmp_path / "m.pt").read_bytes()
    assert hexdigest == _pieces(data, 1 << 12)
    end = data.index(state["a"].numpy().tobytes()) + storage.nbytes()  # the storage's end in the file
    assert handed_at_write == [end // (1 << 12)], "every piece the storage's bytes complete is hashing as it is written"


def test_the_writer_waits_for_the_very_storage_it_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy but one is in; the writer must stop at that one's storage and write its new
    bytes once it is copied. A writer that waited on the wrong storage would write its old ones."""
    stager = Stager()
    stager.stage(_state(1.0))
    staged, copies = stager.plan(_state(5.0))
    copying = Staged(staged, copying=True)
    held = next(k for k, (buffer, _) in enumerate(copies) if buffer.shape == (200, 50))
    span = copying._index[copies[held][0].untyped_storage().data_ptr()]
    reached = threading.Event()
    wait = Staged.wait

    def spy_wait(self: Staged, which: int | None = None) -> None:
        if which == span:
            reached.set()
        wait(self, which)

    monkeypatch.setattr(Staged, "wait", spy_wait)
    result: dict[str, Any] = {}
    writer = threading.Thread(target=lambda: result.update(saved=save_hashed(staged, tmp_path / "m.pt", copying)),
                              daemon=True)
    writer.start()
    try:
        for k, (buffer, source) in enumerate(copies):
            if k != held:
                buffer.copy_(source)
                copying.arrived(buffer)
        assert reached.wait(WAIT_S), "the writer never waited for the held copy"
        assert not (tmp_path / "m.pt").exists()
        copies[held][0].copy_(copies[held][1])
        copying.arrived(copies[held][0])
        copying.complete()
        writer.join(WAIT_S)
    finally:
        if writer.is_alive():  # a failed assertion must not leave it waiting
            copying.failed(AssertionError("test over"))
    assert "saved" in result
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert torch.equal(loaded["c"][0], torch.full((200, 50), -5.0)) and torch.equal(loaded["a"], torch.full((300, 300), 5.0))


def test_only_a_storage_s_own_buffer_lets_its_write_go() -> None:
    staged, _ = Stager().plan(_state(1.0))
    copying = Staged(staged, copying=True)
    for other in (torch.empty(4096), torch.empty(300, 300), torch.empty(0)):
        copying.arrived(other)
    assert not any(event.is_set() for event in copying._in) and not copying.all_in.is_set()


def test_a_storage_never_written_from_its_memory_is_refused(tmp_path: Path) -> None:
    """A storage of the state being copied that the file does not take from its own memory
    cannot be vouched for: no file, CopyFailed."""
    staged, copies = Stager().plan(_state(6.0))
    copying = Staged(staged, copying=True)
    Stager.fill(copies, copying)
    with pytest.raises(CopyFailed, match="not written from their own memory"):
        save_hashed({"a": staged["a"]}, tmp_path / "m.pt", copying)
    assert not list(tmp_path.iterdir())


def test_a_large_write_from_changing_memory_is_hashed_before_it_returns(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A write of a piece or more that is not the state's (a large pickle): its whole pieces are
    hashed in place before write returns, the rest copied; changing it afterwards changes nothing."""
    monkeypatch.setattr(digest, "PIECE", 64)
    big = bytearray(bytes(range(150)))
    written = b"head-of-ten"
    with (tmp_path / "f").open("wb") as fh, HashingWriter(fh) as writer:
        writer.write(b"head-of-ten")
        writer.write(big)
        written += bytes(big)
        big[:] = b"\0" * 150
        writer.write(b"tail")
        written += b"tail"
        fh.flush()
        hexdigest = writer.hexdigest()
    assert (tmp_path / "f").read_bytes() == written and hexdigest == _pieces(written, 64)


def test_an_interrupt_before_the_copy_ends_the_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt between starting the writer and the copy: the writer must not wait
    forever for a copy that never comes (it holds the next save, and the exit)."""
    made: list[Staged] = []
    init = Staged.__init__

    def spy(self: Staged, state: Any, copying: bool = False) -> None:
        init(self, state, copying)
        made.append(self)

    monkeypatch.setattr(Staged, "__init__", spy)
    mgr = CheckpointManager(str(tmp_path), None, TOPO)
    try:
        def interrupted(copies: Any, staged: Any = None) -> None:
            raise KeyboardInterrupt

        with monkeypatch.context() as patch:
            patch.setattr(Stager, "fill", staticmethod(interrupted))
            with pytest.raises(KeyboardInterrupt):
                mgr.save(1, _state(1.0), {"x": torch.ones(1)}, lambda: None)
        waiter = threading.Thread(target=mgr.wait_commit, daemon=True)
        waiter.start()
        waiter.join(WAIT_S)
        assert not waiter.is_alive(), "the writer still waits for the copy"
        assert mgr.local_steps() == []
        mgr.save(2, _state(2.0), {"x": torch.ones(1)}, lambda: None)
        assert mgr.local_steps() == [2]
    finally:
        for staged in made:  # a writer left waiting would hold close() forever: the test fails instead
            if not staged.all_in.is_set():
                staged.failed(AssertionError("test over"))
        mgr.close()


def test_the_loop_leaves_its_rng_file_s_fsync_to_the_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Local rank 0's RNG file is fsync'd by the background writer before the manifest is (off
    the loop's wait, still durable before the commit)."""
    synced: list[tuple[str, str]] = []
    fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), threading.current_thread().name))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    mgr = CheckpointManager(str(tmp_path), None, TOPO)
    try:
        mgr.save(1, _state(1.0), {"x": torch.ones(1)}, lambda: None)
        mgr.wait_commit()
    finally:
        mgr.close()
    names = [name for name, _ in synced]
    rng = names.index(rng_name(0))
    assert synced[rng][1] == "checkpoint-write" and rng < names.index("manifest-node000.json")
    assert not [name for name, thread in synced if name.startswith("rng") and thread != "checkpoint-write"]
    assert mgr.local_steps() == [1]


@pytest.mark.parametrize("before", [0, 10])
def test_a_large_write_ending_on_or_off_a_piece_boundary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         before: int) -> None:
    """The in-place path at the edges: 128 bytes from offset 0 end on a boundary (nothing left to
    copy), 118 after 10 bytes too; either way the bytes changed afterwards change nothing."""
    monkeypatch.setattr(digest, "PIECE", 64)
    big = bytearray(bytes(range(128 - before)))
    written = b"h" * before + bytes(big)
    with (tmp_path / "f").open("wb") as fh, HashingWriter(fh) as writer:
        if before:
            writer.write(b"h" * before)
        writer.write(big)
        big[:] = b"\1" * len(big)
        writer.write(b"end")
        written += b"end"
        fh.flush()
        hexdigest = writer.hexdigest()
    assert hexdigest == _pieces(written, 64)


def test_a_storage_written_in_part_from_elsewhere_is_refused() -> None:
    """verify counts a storage's bytes, not its writes: all of them from its own memory, once."""
    staged, copies = Stager().plan(_state(7.0))
    copying = Staged(staged, copying=True)
    Stager.fill(copies, copying)
    sizes = [end - start for start, end in zip(copying._starts, copying._ends)]
    copying.written[:] = sizes
    copying.verify()
    copying.written[0] -= 1
    with pytest.raises(CopyFailed):
        copying.verify()
    copying.written[0] += 2
    with pytest.raises(CopyFailed):
        copying.verify()


def test_a_writer_that_cannot_start_leaves_no_thread_to_wait_for() -> None:
    from training.ckpt.manager import WriterSlot

    class NoThread(threading.Thread):
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    slot = WriterSlot()
    with pytest.raises(RuntimeError, match="can't start"):
        slot.start(NoThread(target=lambda: None))
    slot.wait()  # not "cannot join thread before it is started"
    assert not slot.busy
