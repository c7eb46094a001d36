"""Fuzzing the readers with hostile files (tests/_fuzz.py): a few derandomized examples of each target, each
target in a process of its own, so that a crash or a hang fails this test instead of taking pytest down.
``benchmarks/fuzz_hostile.py`` runs the same targets for as long as it is given; docs/reliability.md has the
counts of the last long run."""

from __future__ import annotations

import json

import pytest
from _hostile import run_python

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# Examples per target: a few seconds each on one core; the same examples on every run (derandomized).
EXAMPLES = {"header": 300, "handoff": 40, "rank_files": 60, "pickles": 600}


@pytest.mark.parametrize("target", list(EXAMPLES))
def test_hostile_files_never_crash_hang_or_escape_and_raise_only_the_projects_errors(target):
    code = (
        "import json, logging, sys\n"
        "import _fuzz\n"
        "logging.getLogger('stagesafe').setLevel(logging.ERROR)\n"
        "counts = _fuzz.run(sys.argv[1], examples=int(sys.argv[2]), derandomize=True)\n"
        "print('COUNTS ' + json.dumps(counts))\n"
    )
    result = run_python(code, target, str(EXAMPLES[target]), timeout=500)
    assert result.returncode == 0, (result.returncode, result.stdout[-3000:], result.stderr[-6000:])
    line = next(line for line in result.stdout.splitlines() if line.startswith("COUNTS "))
    counts = json.loads(line[len("COUNTS ") :])
    assert sum(counts.values()) == EXAMPLES[target]
    assert len(counts) == 2, counts  # both outcomes occur: read (or loaded, consolidated) and refused


def test_the_pickle_payloads_are_live():
    """Each payload the ``pickles`` target splices in runs code under Python's own pickle (it creates its marker),
    so the target's "nothing ran" is not vacuous."""
    code = (
        "import os, pickle, sys, tempfile\n"
        "import _fuzz\n"
        "dead = []\n"
        "for name, payload in _fuzz.PAYLOADS.items():\n"
        "    marker = os.path.join(tempfile.mkdtemp(), 'ran')\n"
        "    try:\n"
        "        pickle.loads(b'\\x80\\x02' + payload(marker) + b'.')\n"
        "    except Exception:\n"
        "        pass\n"
        "    if not os.path.exists(marker):\n"
        "        dead.append(name)\n"
        "print('DEAD', dead)\n"
    )
    result = run_python(code, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DEAD []" in result.stdout, result.stdout
