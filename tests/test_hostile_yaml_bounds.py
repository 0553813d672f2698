"""Review of issue 48's YAML reader: numbers Python cannot parse as written, work and memory
bounded per node (not per key-path string or per alias expansion), one-line messages for keys
with newlines, and keys that one reading makes equal."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from infra.core import yamlread
from infra.stack.stackfile import StackFileError, read_stack_text
from tests.harness import ROOT
from tests.test_hostile_input_2 import _within

PROJECT = "gpu-training-stack"


def _value(written: str) -> Any:
    text = f"config:\n  {PROJECT}:v: {{x: {written}}}\n"
    read_stack_text(text, "Pulumi.x.yaml", PROJECT)  # the stack reader takes it too
    return yamlread.load(text)["config"][f"{PROJECT}:v"]["x"]


@pytest.mark.parametrize("written,read", [
    ("1" * 5000, "1" * 5000),  # beyond a float too: yaml.v3 keeps the text
    ("18446744073709551615", 18446744073709551615), ("18446744073709551616", 1.8446744073709552e19),
    ("-9223372036854775809", -9.223372036854775809e18), ("0x" + "F" * 17, "0x" + "F" * 17),
    ("!!float 0x10", 16.0), ("!!float 0o7", 7.0), ("!!float 0b1", 1.0), ("!!float 1", 1.0)])
def test_numbers_beyond_64_bits_and_tagged_floats_read_as_yaml_v3(written: str, read: Any) -> None:
    value = _value(written)
    assert value == read and type(value) is type(read)


def _refused(text: str) -> str:
    with pytest.raises(StackFileError) as caught:
        _within(120, lambda: read_stack_text(text, "Pulumi.x.yaml", PROJECT))
    message = str(caught.value)
    assert message.startswith("Pulumi.x.yaml") and "\n" not in message, message
    return message


def test_a_long_key_over_a_long_list_is_refused_within_a_gib() -> None:
    """The key path was a string per value: a 500 KB key over 100,000 values took tens of GB.
    A child process under a 1 GiB address-space limit: a memory guard, nothing is timed."""
    code = textwrap.dedent(f"""\
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from infra.stack.stackfile import StackFileError, read_stack_text
        text = "config:\\n  ? {PROJECT}:" + "k" * 500_000 + "\\n  : [" + "1," * 100_000 + "1]\\n"
        try:
            read_stack_text(text, "Pulumi.x.yaml", "{PROJECT}")
        except StackFileError as exc:
            print(exc)
            sys.exit(2)
        """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stdout.strip()
    assert "more than 100,000 values" in line and "kkk..." in line and len(line) < 400, line[:500]


def test_a_long_scalar_aliased_everywhere_is_refused_at_the_text_bound() -> None:
    """Its tag was resolved again at every alias (a 600 KB scalar aliased 99,000 times took an
    hour) and it would expand to 60 GB: refused under the hang bound; a few aliases read."""
    text = f"config:\n  {PROJECT}:a: &s '" + "9" * 600_000 + f"'\n  {PROJECT}:b: [" + "*s," * 99_000 + "*s]\n"
    assert "b[5]: more than 4 MiB of text once aliases are expanded" in _refused(text)
    few = f"config:\n  {PROJECT}:a: &s '" + "9" * 600_000 + f"'\n  {PROJECT}:b: [*s, *s, *s]\n"
    values = _within(120, lambda: read_stack_text(few, "Pulumi.x.yaml", PROJECT)).values
    assert json.loads(values[f"{PROJECT}:b"]) == ["9" * 600_000] * 3


@pytest.mark.parametrize("key,says", [
    ('"a\\nb"', "'a\\nb'"), ('"' + "z" * 300 + '"', "zzz...")])
def test_a_key_with_a_newline_or_300_characters_stays_one_short_line(key: str, says: str) -> None:
    message = _refused(f"config:\n  {PROJECT}:v: {{{key}: !!binary aGk=}}\n")
    assert says in message and len(message) < 400, message


@pytest.mark.parametrize("pairs,says", [
    ("{1: a, 1.0: b}", "key '1.0' is the same key as '1' once read"),
    ("{true: x, 1: y}", "key '1' is the same key as 'true' once read"),
    ("{0x1: x, 1: y}", "key '1' is the same key as '0x1'")])
def test_keys_one_reading_makes_equal_are_refused_as_duplicates(pairs: str, says: str) -> None:
    assert says in _refused(f"config:\n  {PROJECT}:v: {pairs}\n")


@pytest.mark.parametrize("key,says", [("~", "config key null is not text"), ("1", "config key 1 is not text")])
def test_a_config_key_that_is_not_text_is_named(key: str, says: str) -> None:
    """Found by the fuzz generator: a TypeError (exit 3) before."""
    assert says in _refused(f"config:\n  {key}: 1\n")
