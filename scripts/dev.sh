#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv (idempotent), then runs the demo or the tests.
#   scripts/dev.sh demo    # validate -> fit -> test -> predict on one module, CPU, 2 processes
#   scripts/dev.sh test    # the whole test suite (what CI runs)
#   scripts/dev.sh test-fast   # the edit loop: the tests that start no Trainer or DeepSpeed job
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.stagesafe-installed

setup() {
    local want
    want=$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)
    if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]]; then return; fi
    echo "setting up $VENV (first run: a few minutes)" >&2
    [[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first, pinned: the CPU build of the tested version (another version pulls a multi-GB CUDA build)
    "$VENV/bin/python" -m pip install -q "$(grep '^torch==' constraints.txt)"
    "$VENV/bin/python" -m pip install -q -c constraints.txt -e ".[test,s3,progress]"
    echo "$want" > "$STAMP"
}

export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
# DeepSpeed JIT-builds its CPU comm op once per environment; a folder per venv keeps two checkouts from
# rebuilding each other's (the build is keyed by the source path)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/$VENV/torch_extensions}
# and one ninja: the venv's (ninja's logs differ between versions, and a build by another ninja is redone)
export PATH="$PWD/$VENV/bin:$PATH"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
case "${1:-}" in
    demo) setup; exec "$VENV/bin/python" examples/stage_sequence.py "${@:2}" ;;
    # two workers, a module each at a time: most tests wait on 2-rank jobs, which leave a core idle
    test) setup; exec "$VENV/bin/python" -m pytest -q -n "${STAGESAFE_TEST_WORKERS:-2}" --dist loadfile "${@:2}" ;;
    test-fast) setup; exec "$VENV/bin/python" -m pytest -q -n "${STAGESAFE_TEST_WORKERS:-2}" -m "not slow" "${@:2}" ;;
    setup) setup ;;
    *) echo "usage: scripts/dev.sh {demo|test|test-fast|setup} [args...]" >&2; exit 2 ;;
esac
