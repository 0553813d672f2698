"""The end of a reservation (RESERVATION_END): the trainer, on a fake clock that moves 60 s per
step, stops with an emergency checkpoint that is in the bucket before the cloud starts taking
the nodes (end - RESERVATION_NOTICE_S), so nothing trained is lost: the run resumes from the very
step it stopped at and ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.conftest import TRAIN_ARGS as ARGS
from tests.training_helpers import MotoServer, launch, storage_env
from training import contract
from training.reservation import Deadline, parse_end

END = "2026-12-24T08:00:00Z"
NOTICE_S = 1800  # EC2 Capacity Blocks: the cloud starts terminating 30 minutes before the end
STEP_S = 60  # the fake clock's minutes per step


def test_the_run_commits_its_last_step_before_the_nodes_go_and_loses_none(
        reference: tuple[str, Path], moto: MotoServer, tmp_path: Path) -> None:
    digest, _ = reference
    end = parse_end(END)
    assert end is not None
    upload_s = 90  # the trainer's --upload-deadline-s default
    stop_at = end - NOTICE_S - upload_s
    # the clock reaches stop_at at step 35 (its first read is after step 1)
    env = {**storage_env(moto.url), contract.RESERVATION_END.name: END, contract.RESERVATION_NOTICE_S.name: str(NOTICE_S),
           "GTS_TEST_CLOCK_START": str(stop_at - 34 * STEP_S), "GTS_TEST_CLOCK_STEP_S": str(STEP_S)}
    url = f"s3://{moto.bucket}/reservation-run"
    (tmp_path / "a").mkdir()
    run = launch([*ARGS, "--checkpoint-dir", url], tmp_path / "a", env)
    run.finish()
    line = run.wait_for(r"stopped by RESERVATION_END at step \d+ after an emergency checkpoint")
    stopped = int(re.search(r"at step (\d+)", line).group(1))  # type: ignore[union-attr]
    assert stopped == 35
    # durable: in the bucket, committed, before the process ended (the nodes go after this)
    assert f"reservation-run/step-{stopped:08d}/manifest-node000.json" in moto.keys("reservation-run/")
    run.wait_for(rf"uploaded step-{stopped:08d} ")
    # a new node in the next place: nothing of the last run on its disk; 0 steps lost
    (tmp_path / "b").mkdir()
    again = launch([*ARGS, "--checkpoint-dir", url], tmp_path / "b", storage_env(moto.url))
    assert again.finish() == 0, again.output[-3000:]
    again.wait_for(rf"resumed from step {stopped} ")
    assert again.final()[2] == digest


def test_the_deadline_and_its_bad_values() -> None:
    assert Deadline(None, 1800, 90).due() is False
    past = datetime(2020, 1, 1, tzinfo=timezone.utc).timestamp()
    assert Deadline(past, 1800, 90).due() is True
    with pytest.raises(ValueError, match=r"RESERVATION_END='2026-12-24T08:00:00' has no offset: write it in UTC"):
        parse_end("2026-12-24T08:00:00")
    assert contract.problems({contract.RESERVATION_END.name: "tomorrow", contract.RESERVATION_NOTICE_S.name: "-5"}) == [
        "RESERVATION_END='tomorrow': an ISO 8601 time with its offset, e.g. 2026-12-24T08:00:00Z",
        "RESERVATION_NOTICE_S='-5': whole seconds, e.g. 1800"]
