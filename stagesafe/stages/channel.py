"""Ranks agreeing through the job's key-value store, never through a collective.

A background write and the Trainer share the ranks' devices. A collective (NCCL) that one rank enters while
another rank's main thread waits for that first rank's writer, whose device copies queue behind the
collective, deadlocks both. So everything a write needs to agree on (each rank's shards, the commit, the
outcome, whether a failed stage may still gather) goes through ``torch.distributed``'s key-value store, which
any thread may use at any time, and every wait ends after a bounded time with an error naming the ranks that
did not answer. How a rank's part ended travels as data (:class:`Outcome`, one encoding for every post), and
the failures the ranks report become ``DistributedStageError.failures``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from stagesafe.errors import DistributedStageError, describe

__all__ = ["JobChannel", "Outcome", "Ending", "agree_on_ending", "quoted", "failures"]

_POLL_FIRST = 0.002  # seconds between looks at the store, growing to _POLL_MAX
_POLL_MAX = 0.05
_MAX_SHOWN = 400  # characters of a posted value quoted in an error


class JobChannel:
    """Keys under one prefix in the job's key-value store, for one rank of ``world``.

    Outside a distributed job (one process) the store is an in-process ``HashStore``: the same code runs,
    and no key ever waits for another process.
    """

    def __init__(self, store: Any, *, rank: int, world: int, prefix: str, timeout: float) -> None:
        self._store = store
        self.rank = rank
        self.world = world
        self.prefix = prefix.rstrip("/")
        self.timeout = float(timeout)

    @classmethod
    def of_job(cls, prefix: str, *, timeout: float) -> "JobChannel":
        """The channel of the running job (its default process group's store), or a private one."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()  # torch has no public getter of the group's store
            return cls(store, rank=dist.get_rank(), world=dist.get_world_size(), prefix=prefix, timeout=timeout)
        return cls(dist.HashStore(), rank=0, world=1, prefix=prefix, timeout=timeout)

    def sub(self, name: str) -> "JobChannel":
        """A channel for the keys under ``prefix/name``."""
        return JobChannel(self._store, rank=self.rank, world=self.world, prefix=self._key(name), timeout=self.timeout)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def post(self, name: str, value: str) -> None:
        self._store.set(self._key(name), value)

    def get(self, name: str) -> str:
        return self._store.get(self._key(name)).decode()

    def post_outcome(self, name: str, outcome: "Outcome") -> None:
        self.post(name, outcome.encode())

    def outcome(self, name: str) -> "Outcome":
        """The :class:`Outcome` posted under ``name`` (set: :meth:`wait` for it first)."""
        return Outcome.decode(self.get(name))

    def has(self, name: str) -> bool:
        return bool(self._store.check([self._key(name)]))

    def decide(self, name: str, proposal: str) -> str:
        """The value of ``name`` once set: the first rank to propose wins, every rank reads the same answer."""
        key = self._key(name)
        answer = self._store.compare_set(key, "", proposal)
        return answer.decode() if isinstance(answer, bytes) else str(answer)

    def wait(self, names: Iterable[str], *, what: str, timeout: float | None = None) -> None:
        """Poll until every key is set (never the store's blocking ``wait``: the job shares one connection
        across threads, and a thread blocked in it would stall the Trainer's own use of the store)."""
        keys = [self._key(n) for n in names]
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        pause = _POLL_FIRST
        while not self._store.check(keys):
            if time.monotonic() > deadline:
                missing = [k.rsplit("/", 1)[-1] for k in keys if not self._store.check([k])]
                raise DistributedStageError(
                    f"{what}: no word after {limit:.0f} s from {_ranks_named(missing)}. Such a rank failed, was "
                    "killed or is stuck in an earlier step; its own log says why. The committed handoff, if any, "
                    "is unchanged by this step"
                )
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)

    def exchange(self, name: str, value: str, *, what: str, ranks: Iterable[int] | None = None) -> dict[int, str]:
        """Post this rank's ``value`` under ``name/<rank>`` and return every listed rank's (default: all)."""
        ranks = list(range(self.world)) if ranks is None else list(ranks)
        sub = self.sub(name)
        sub.post(str(self.rank), value)
        sub.wait([str(r) for r in ranks], what=what)
        return {r: sub.get(str(r)) for r in ranks}


def _ranks_named(missing: list[str]) -> str:
    ranks = [m for m in missing if m.isdigit()]
    if ranks and len(ranks) == len(missing):
        return "rank " + ", ".join(ranks) if len(ranks) == 1 else "ranks " + ", ".join(ranks)
    return "the other ranks (keys " + ", ".join(missing[:3]) + ")"


def quoted(value: str) -> str:
    """A posted value for an error message, bounded in length."""
    return value if len(value) <= _MAX_SHOWN else value[:_MAX_SHOWN] + "..."


@dataclass(frozen=True)
class Outcome:
    """How one rank's part of a step ended, as the ranks post it: ``error`` is the failure's text
    (:func:`stagesafe.errors.describe`), None where it went well; ``value`` is what a rank that succeeded reports (JSON data).

    On the store it is JSON, ``{"status": "ok", "value": ...}`` or ``{"status": "failed", "error": "..."}``:
    :meth:`encode` and :meth:`decode` are the one encoding of every outcome a rank posts.
    """

    error: str | None = None
    value: Any = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def of(cls, error: BaseException | None, value: Any = None) -> "Outcome":
        """The outcome of a step that raised ``error`` (None: it went well and gave ``value``)."""
        return cls(value=value) if error is None else cls(error=describe(error))

    def encode(self) -> str:
        if self.ok:
            return json.dumps({"status": "ok", "value": self.value})
        return json.dumps({"status": "failed", "error": self.error})

    @classmethod
    def decode(cls, text: str) -> "Outcome":
        try:
            posted = json.loads(text)
        except ValueError:
            posted = None
        status = posted.get("status") if isinstance(posted, dict) else None
        if status == "ok":
            return cls(value=posted.get("value"))
        if status == "failed":
            return cls(error=str(posted.get("error")))
        raise DistributedStageError(
            f"a rank posted {quoted(text)!r} where an outcome belongs: do all ranks run the same stagesafe version?"
        )


def failures(outcomes: Mapping[int, Outcome]) -> dict[int, str]:
    """The ranks whose outcome is a failure, with its text (bounded): ``DistributedStageError.failures``."""
    return {r: quoted(o.error) for r, o in sorted(outcomes.items()) if o.error is not None}


@dataclass(frozen=True)
class Ending:
    """How a Trainer call ended across the ranks."""

    gather: bool  # every rank reached its end: weights may be gathered (collectives are safe)
    failed: tuple[int, ...]  # ranks whose call failed
    absent: tuple[int, ...]  # ranks that had not reached the end when the ranks decided

    @property
    def broken(self) -> bool:
        """Some rank was elsewhere: it may still be inside the call, in a collective that will time out."""
        return not self.gather


def agree_on_ending(channel: JobChannel, *, failed: bool, grace: float) -> Ending:
    """At the end of a Trainer call, before anything that gathers: did every rank get here?

    A rank whose call failed waits ``grace`` seconds for the others (if they failed too, all are here and
    may still gather the weights); a rank whose call ended normally waits the full timeout, as the collective
    it replaces would. The first rank to decide decides for all (the store's compare-and-set), so every
    rank gathers, or none does.
    """
    wait = grace if failed else channel.timeout
    sub = channel.sub("ended")
    sub.post_outcome(str(channel.rank), Outcome(error="its Trainer call failed") if failed else Outcome())
    everyone = [str(r) for r in range(channel.world)]
    try:
        sub.wait(everyone, what="the end of the Trainer call", timeout=wait)
        here = True
    except DistributedStageError:
        here = False
    gather = channel.decide("gather", "yes" if here else "no") == "yes"
    posted = {r: sub.outcome(str(r)) for r in range(channel.world) if sub.has(str(r))}
    absent = tuple(r for r in range(channel.world) if r not in posted)
    return Ending(gather=gather, failed=tuple(failures(posted)), absent=absent)
