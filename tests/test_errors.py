"""The exception family: what callers catch, and what a rank's failure carries."""

from __future__ import annotations

import pickle

import pytest

from stagesafe import errors


def test_every_error_is_a_stagesafe_error_and_a_builtin_a_caller_would_catch():
    for name in errors.__all__:
        cls = getattr(errors, name)
        if not isinstance(cls, type) or cls is errors.StageSafeError:
            continue
        assert issubclass(cls, errors.StageSafeError), name
        assert len(cls.__mro__) > 3, f"{name} derives from no builtin besides Exception"


def test_a_distributed_failure_carries_each_failed_rank_as_data_through_pickling():
    exc = errors.DistributedStageError("writing failed on 2 ranks", failures={1: "OSError: disk full", 3: "x"})
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is errors.DistributedStageError
    assert again.failures == {1: "OSError: disk full", 3: "x"}
    assert str(again) == "writing failed on 2 ranks"
    with pytest.raises(RuntimeError):
        raise again
    assert errors.DistributedStageError("no answer").failures == {}


def test_what_a_failed_rank_reports_is_its_errors_type_and_message():
    assert errors.describe(OSError("disk full on rank 1")) == "OSError: disk full on rank 1"
    assert errors.describe(KeyboardInterrupt()) == "KeyboardInterrupt: "
