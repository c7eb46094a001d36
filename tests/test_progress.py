"""progress.py: a bar on stderr when it is a terminal (a real pseudo-terminal here) unless turned off, on stderr
elsewhere when asked for, and the bar cleared when it closes.

(Its decimal units, and quiet under pytest's captured stderr: tests/test_cli.py; a load's bar: tests/test_read.py.)
"""

from __future__ import annotations

import fcntl
import os
import struct
import sys
import termios

import pytest

from stagesafe.progress import bytes_bar


@pytest.fixture
def terminal(monkeypatch):
    """A function that puts stderr on a pseudo-terminal of 100 columns (in the test: pytest sets its own stderr
    between a fixture and the test) and returns a function giving what the terminal has shown since."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new one has 0 columns
    stderr = os.fdopen(slave, "w")
    os.set_blocking(master, False)

    def shown() -> str:
        stderr.flush()
        out = b""
        while True:
            try:
                out += os.read(master, 65536)
            except BlockingIOError:
                return out.decode()

    def open_terminal():
        monkeypatch.setattr(sys, "stderr", stderr)
        return shown

    yield open_terminal
    stderr.close()
    os.close(master)


def test_on_a_terminal_a_bar_is_shown_unless_turned_off_and_cleared_when_it_closes(terminal):
    terminal = terminal()
    assert sys.stderr.isatty()
    assert bytes_bar(False, 2_000_000, "consolidating") is None
    assert terminal() == ""
    bar = bytes_bar(None, 2_000_000, "consolidating")
    bar.update(1_000_000)
    bar.refresh()
    assert "consolidating:  50%" in terminal()
    bar.close()
    cleared = terminal()
    assert cleared.strip() == "" and cleared.endswith("\r")  # the line blanked: nothing is left of the bar


def test_off_a_terminal_a_bar_asked_for_is_written_to_stderr(tmp_path, monkeypatch, capsys):
    with open(tmp_path / "log", "w") as log:
        monkeypatch.setattr(sys, "stderr", log)
        bar = bytes_bar(True, 10, "loading")
        bar.update(10)
        bar.close()
    assert "loading:   0%" in (tmp_path / "log").read_text() and capsys.readouterr().out == ""
