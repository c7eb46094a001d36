"""Imported at start-up by every Python process the tests launch (its folder is on their ``PYTHONPATH``).

Ranks of one script share one stdout file. Line buffering hands each printed line to the kernel in one write, so
lines of two ranks never interleave inside a line, and a line is out as soon as it is printed (a test may read it
while the process runs). ``PYTHONUNBUFFERED`` would write a line's words and its newline separately.
"""

import sys

for _stream in (sys.stdout, sys.stderr):
    if _stream is not None and hasattr(_stream, "reconfigure"):
        _stream.reconfigure(line_buffering=True)
