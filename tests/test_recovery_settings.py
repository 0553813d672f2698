"""The settings of recovery after a lost node (training/contract.py's RECOVERY_VARS): checked
with the rest of the contract, and the entrypoint's defaults are the contract's (issue 46: torch's
own 5 s x 3 keep-alive made the survivors' world form 15 s after a loss)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.training_helpers import ROOT
from training import contract


def test_the_entrypoint_s_defaults_are_the_contract_s() -> None:
    script = (ROOT / "training/node/entrypoint.sh").read_text()
    found = {name: int(value) for name, value in re.findall(r"\$\{([A-Z_]+):-(\d+)\}", script)
             if name in contract.RECOVERY_DEFAULTS}
    assert found == {name: contract.RECOVERY_DEFAULTS[name] for name in found}, found
    assert {"RDZV_KEEPALIVE_S", "RDZV_KEEPALIVE_MISSES"} <= set(found), found
    assert found["RDZV_KEEPALIVE_S"] * found["RDZV_KEEPALIVE_MISSES"] >= 10  # a loaded node's agent and clock skew
    # the last call: torch's 30 s, the peer tier's 3 s when PEER_EVERY > 0
    assert "last_call_timeout=${RDZV_LAST_CALL_S:-$last_call}" in script
    assert f"last_call={contract.RECOVERY_DEFAULTS['RDZV_LAST_CALL_S']}\n" in script
    assert f'if [ "${{PEER_EVERY:-0}}" -gt 0 ]; then last_call={contract.LAST_CALL_PEER_S}; fi' in script
    assert "keep_alive_interval=${RDZV_KEEPALIVE_S" in script and "keep_alive_max_attempt=${RDZV_KEEPALIVE_MISSES" in script
    # torch reads these rendezvous settings by these names (dynamic_rendezvous.create_handler)
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    source = open(dynamic_rendezvous.__file__, encoding="utf-8").read()
    for name in ('"keep_alive_interval"', '"keep_alive_max_attempt"', '"last_call"'):
        assert name in source, name


@pytest.mark.parametrize("name,value", [("RDZV_KEEPALIVE_S", "0"), ("RDZV_KEEPALIVE_MISSES", "1"), ("PEER_EVERY", "-5"),
                                        ("PEER_PORT", "70000"), ("RDZV_LAST_CALL_S", "soon")])
def test_a_bad_recovery_setting_stops_the_node_with_one_line(name: str, value: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), name: value}
    proc = subprocess.run([sys.executable, "-m", "training.contract", "check"], env=env, capture_output=True, text=True,
                          timeout=60)
    least = contract.RECOVERY_LEAST[name]
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"trainer contract: {name}={value!r}: a whole number of at least {least} (default "
        f"{contract.RECOVERY_DEFAULTS[name]})"], proc.stderr


def test_unset_settings_take_the_defaults() -> None:
    assert contract.recovery("PEER_EVERY", {}) == 0 and contract.recovery("RDZV_KEEPALIVE_S", {}) == 2
    assert contract.recovery("PEER_EVERY", {"PEER_EVERY": "25"}) == 25


@pytest.mark.parametrize("name,value,line", [
    ("HANG_TIMEOUT_S", "a minute", "a number from 1 to 86400"), ("HANG_TIMEOUT_S", "nan", "a number from 1 to 86400"),
    ("HANG_TIMEOUT_S", "-5", "a number from 1 to 86400"), ("STRAGGLER_FACTOR", "abc", "a number from 1.01 to 100"),
    ("STRAGGLER_FACTOR", "0.5", "a number from 1.01 to 100"), ("HANG_RESTARTS", "0", "a whole number of at least 1"),
    ("STRAGGLER_WINDOW_STEPS", "-50", "a whole number of at least 0"), ("HANG_REPLACE", "yes", "true or false"),
    ("STRAGGLER_REPLACE", "$(reboot)", "true or false")])
def test_a_bad_watch_setting_stops_the_node_with_one_line(name: str, value: str, line: str) -> None:
    """Unchecked, STRAGGLER_FACTOR=abc crashed every trainer at its first step and HANG_TIMEOUT_S=nan
    left a watchdog that never fires: the contract check refuses them before the launch."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), name: value}
    proc = subprocess.run([sys.executable, "-m", "training.contract", "check"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [f"trainer contract: {name}={value!r}: {line}"], proc.stderr


def test_the_watch_settings_a_user_means_pass() -> None:
    ok = {"HANG_TIMEOUT_S": "90", "STRAGGLER_FACTOR": "1.5", "HANG_RESTARTS": "5", "STRAGGLER_WINDOW_STEPS": "0",
          "HANG_REPLACE": "False", "STRAGGLER_REPLACE": "TRUE"}
    assert contract._watch_problems(ok) == [] and contract._watch_problems({}) == []
