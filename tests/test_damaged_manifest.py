"""A damaged manifest (`{not json`), tried as a user would: the plain loop of examples/ run to
its end, the newest step's manifest overwritten, the loop started again. One line names the
step and the fault, the step before it is resumed, and the run ends where an uninterrupted
run ends (the damaged step written again)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.test_user_code import final_line, start
from tests.training_helpers import BIN, ROOT

EXAMPLE = ROOT / "examples" / "plain_loop.py"


def test_a_damaged_manifest_is_named_and_the_step_before_it_resumed(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    args = [str(BIN / "python"), str(EXAMPLE), "--steps", "40", "--checkpoint-every", "10", "--checkpoint-dir", str(ck)]
    first = start(args, {}, tmp_path)
    assert first.finish() == 0, first.output[-3000:]
    manifest = ck / "step-00000040" / "manifest-node000.json"
    manifest.write_text("{not json")

    again = start(args, {}, tmp_path)
    assert again.finish() == 0, again.output[-3000:]
    named = [line for line in again.lines if "step-00000040/manifest-node000.json" in line]
    assert len(named) == 1, again.output[-3000:]
    assert re.search(r"skipping checkpoint step 40: its manifest step-00000040/manifest-node000\.json on this node is "
                     r"damaged: not JSON \(Expecting property name enclosed in double quotes: line 1 column 2 "
                     r"\(char 1\)\); the step before it is used$", named[0]), named[0]
    again.wait_for(r"resumed from checkpoint step 30$")
    assert final_line(again) == final_line(first)
    assert json.loads(manifest.read_text())["step"] == 40  # written again, whole
