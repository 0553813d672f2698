"""Shell and systemd units without what they do not run: comments (a quote-aware cut) and unit
descriptions. The scans that read the node's code share these (tests/test_node_settings.py, the
name scan of tests/test_cloud_profiles.py)."""

from __future__ import annotations


def shell_code(text: str) -> str:
    """Shell without its comments: a `#` that starts a word outside quotes ends its line (`${#x}`,
    `$#`, a `#` inside a word or in quotes do not; a quote may span lines, `\\` escapes outside
    single quotes)."""
    out, quote, escaped = [], "", False
    for line in text.splitlines():
        cut = len(line)
        for i, ch in enumerate(line):
            if escaped:
                escaped = False
            elif ch == "\\" and quote != "'":
                escaped = True
            elif quote:
                quote = "" if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "#" and (i == 0 or line[i - 1] in " \t;|&(") and line[i - 1:i] != "$":
                cut = i
                break
        escaped = False  # a `\\` at the end of a line joins it to the next, nothing more
        out.append(line[:cut])
    return "\n".join(out)


def unit_code(text: str) -> str:
    """A unit's lines that systemd runs or expands: its comments and descriptions blanked (the
    lines keep their numbers)."""
    return "\n".join("" if line.lstrip().startswith(("#", ";", "Description=")) else line
                     for line in text.splitlines())
