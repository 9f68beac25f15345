"""Other people's text on an admin's terminal (issue 39): a rank's Tell message, a job's reason or its log can
carry control sequences; the CLI shows them escaped, never as sequences the terminal acts on."""

import io

import pytest

from cli import terminal

pytestmark = pytest.mark.inproc  # the tier (tests/conftest.py)

ATTACK = "done\x1b]0;pwned\x07\x1b[2J\x1b[1A\x9b31mforged line\x00"


def test_control_sequences_are_shown_escaped_and_text_kept():
    shown = terminal.escape(ATTACK + "\nnext\tcolumn\r")
    assert "\x1b" not in shown and "\x07" not in shown and "\x9b" not in shown and "\x00" not in shown
    assert shown == "done\\x1b]0;pwned\\x07\\x1b[2J\\x1b[1A\\x9b31mforged line\\x00\nnext\tcolumn\r"
    assert terminal.escape("héllo 日本 ✓") == "héllo 日本 ✓"


def test_a_logs_bytes_are_escaped_whole_characters_only():
    data = ATTACK.encode() + "héllo\n".encode() + b"\xff\xfe"
    shown = terminal.escape_bytes(data)
    assert b"\x1b" not in shown and b"\xc2\x9b" not in shown and b"\x07" not in shown
    assert shown.endswith("héllo\n".encode() + b"\xff\xfe")  # UTF-8 and stray bytes otherwise untouched


def test_everything_printed_through_the_cli_stream_is_escaped():
    out = io.StringIO()
    print("event:", ATTACK, file=terminal.Escaped(out))
    assert "\x1b" not in out.getvalue() and out.getvalue().startswith("event: done\\x1b")
