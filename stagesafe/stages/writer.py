"""The strategy's one background writer of its handoff: its threads, host memory, rank agreement and outcome.

A Trainer call returns as soon as the module holds its weights; the handoff is written afterwards. One write
at a time, owned here from the first byte to the commit. Its state is two futures, as
torch.distributed.checkpoint's ``async_save`` (staging, upload) and torchtitan's ``staging_future`` /
``save_future`` hold theirs, and :class:`WriteState` is read from them (docs/how-it-works.md draws it):

    copied      the write's private copies are off the device (they need it; once the Trainer call has
                returned, the page-locked host memory of the stage is unlocked too)
    committed   the commit, or the failure: every writing rank writes its share of the shards, rank 0
                commits once all have posted (the job's key-value store, never a collective) and posts how
                it went; every other rank reads that word. Host only.

It is joined, on every rank, by: the next Trainer call (its entry raises a failure already known, rank 0
deciding through the key-value store; its end joins the write), ``wait_for_handoff()``, and the
interpreter's exit, which runs before concurrent.futures' own exit hook, so the write can still finish; a
failure there is printed as an error on every rank and the exit status is non-zero. Every wait is bounded by
the strategy's timeout. Threads are daemons: a signal that ends the process ends them too; each has a
``stop()`` that finishes the write and returns with the thread dead, as Lightning's test suite expects of a
daemon thread left running (the write's outcome is kept for whoever joins it, as above).
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # noqa: F401 - its exit hook is registered before ours, so ours runs first
import enum
import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from stagesafe.errors import DistributedStageError, HandoffNotFoundError, describe
from stagesafe.handoff.plan import HandoffPlan
from stagesafe.publishing.commit import Commit, remove_replaced
from stagesafe.handoff.read import is_live_commit
from stagesafe.stages.channel import JobChannel, Outcome, quoted
from stagesafe.stages.shared_write import write_share

__all__ = ["WriteRequest", "HandoffWriter", "WriteState"]

log = logging.getLogger(__name__)

_EXIT_ACK_WAIT = 60.0  # seconds rank 0 stays at exit for the others to read the outcome it posted


@dataclass
class WriteRequest:
    """One handoff to write, into the writer's folder: ``values`` (those of the shards this rank writes, private
    copies of them in the background), ``plan`` (the handoff's plan, made when the stage started), and hooks for
    the device work: ``fill`` completes the private copies in ``values``; ``unlock`` unlocks page-locked host
    memory once the Trainer call has returned (before that it would stall the call's own CUDA calls);
    ``on_failed`` runs on every rank once the write is known to have failed. This rank lets go of ``values``
    once its share is written."""

    values: Mapping[str, torch.Tensor]
    plan: HandoffPlan
    metadata: Mapping[str, Any]
    fill: Callable[[], None] | None = None
    unlock: Callable[[], None] | None = None
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step, for the boundary's report
    on_failed: Callable[[], None] | None = None  # called on every rank when the write is known to have failed
    keep: Callable[[], None] | None = None  # more device work once the private copies are made: the kept state's


class WriteState(str, enum.Enum):
    """Where one write stands on this rank, read from its two futures (docs/how-it-works.md draws them)."""

    COPYING = "copying"  # ``copied`` pending: the private copies come off the device
    WRITING = "writing"  # ``copied`` done, ``committed`` pending: shares written, rank 0 commits, the others wait
    COMMITTED = "committed"  # ``committed`` holds the commit (on ranks other than 0: rank 0's word that it did)
    FAILED = "failed"  # either future holds a failure

    @property
    def settled(self) -> bool:
        """Nothing more will happen to the write: it is committed or failed."""
        return self in (WriteState.COMMITTED, WriteState.FAILED)

    @classmethod
    def of(cls, copied: concurrent.futures.Future, committed: concurrent.futures.Future) -> WriteState:
        """The state a write's two futures say (``copied`` resolves first, ``committed`` after it; each once)."""
        if any(f.done() and f.exception() is not None for f in (copied, committed)):
            return cls.FAILED
        if committed.done():
            return cls.COMMITTED
        return cls.WRITING if copied.done() else cls.COPYING


class _Step(concurrent.futures.Future):
    """A step of a write: a future whose ``wait(timeout)`` says whether it is done, as ``Event.wait`` does."""

    def wait(self, timeout: float | None = None) -> bool:
        return bool(concurrent.futures.wait([self], timeout).done)

    def settle(self, result: Any, error: BaseException | None) -> None:
        if error is not None:
            self.set_exception(error)
        else:
            self.set_result(result)


class _Write:
    """One write on this rank: its two futures (its state), its threads, and the call's return (an input)."""

    def __init__(
        self, request: WriteRequest, writer: HandoffWriter, channel: JobChannel, *, writes_here: bool, writers: int
    ) -> None:
        self.request = request
        self.uri, self.storage_options = writer.uri, writer.storage_options  # the writer's folder
        self.channel = channel
        self.writes_here = writes_here
        self.writers = writers
        self.copied = _Step()  # None once the private copies are off the device, or the error making them
        self.committed = _Step()  # rank 0's Commit (None on other ranks once rank 0 said so), or the failure
        self.returned = threading.Event()  # the Trainer call that started the write has returned
        self.let_go = threading.Event()  # this rank's share is written (or failed): its private copies are gone
        self.threads: list[_WriteThread] = []  # the device work's, then the writing's

    @property
    def state(self) -> WriteState:
        """Read from the futures, never set apart from them. Committed is rank 0's word: another rank's write
        is writing until it has read that word."""
        return WriteState.of(self.copied, self.committed)


class HandoffWriter:
    """Writes the handoffs of one folder, ``uri`` (fsspec's ``storage_options`` for it), in the background, one at
    a time, and joins them on every rank.

    ``writers``: how many ranks write shares (every rank when all see the handoff folder, else only rank 0).
    ``timeout``: seconds any wait for another rank, or for this rank's own threads, may last. ``on_commit``:
    told on rank 0 when a background write has committed (its thread; it must not raise or block).
    """

    def __init__(
        self,
        channel: JobChannel,
        uri: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        writers: int,
        timeout: float,
        on_commit: Callable[[str, Commit, float], None] | None = None,
    ) -> None:
        self._channel = channel
        self.uri, self.storage_options = uri, storage_options
        self._on_commit = on_commit  # rank 0, in the writer's thread: (uri, commit, seconds) once committed
        self.writers = writers
        self.timeout = timeout
        self._count = 0
        self._write: _Write | None = None
        self._alone: tuple[JobChannel, str] | None = None  # rank 0's lone write after a failed call, not yet awaited
        self._last_commit: JobChannel | None = None  # rank 0: the last commit's keys; it exits once all read its word
        self._exit_hook = False
        self.failed: tuple[str, BaseException] | None = None  # the last joined write: URL, failure (until a commit)

    @property
    def rank(self) -> int:
        return self._channel.rank

    @property
    def channel(self) -> JobChannel:
        """This writer's keys in the job's key-value store (the strategy keeps its calls' keys under it)."""
        return self._channel

    @property
    def pending(self) -> bool:
        """A write was started and not yet joined."""
        return self._write is not None

    @property
    def pending_uri(self) -> str | None:
        return self._write.uri if self._write is not None else None

    @property
    def state(self) -> WriteState | None:
        """The state of the write not yet joined, on this rank; None when there is none."""
        return self._write.state if self._write is not None else None

    @property
    def copied(self) -> concurrent.futures.Future | None:
        """The write not yet joined: the future of its private copies off the device (None, or the error making
        them); None when there is none. Waiting on it joins nothing, as ``async_save``'s staging future."""
        return self._write.copied if self._write is not None else None

    @property
    def committed(self) -> concurrent.futures.Future | None:
        """The write not yet joined: the future of its commit (rank 0's :class:`Commit`; None on the other ranks
        once rank 0 said it committed), or its failure; None when there is none. Waiting on it joins nothing:
        the next call's entry, :meth:`join` or the exit still does."""
        return self._write.committed if self._write is not None else None

    # -- starting -----------------------------------------------------------------------------------------
    def start(self, request: WriteRequest) -> None:
        """Start writing ``request`` in the background (every rank calls this, in step). The previous write
        must have been joined."""
        if self._write is not None:
            raise RuntimeError("stagesafe: a handoff write was started before the previous one was joined")
        self._count += 1
        channel = self._channel.sub(f"write-{self._count}")
        write = _Write(request, self, channel, writes_here=self.rank < self.writers, writers=self.writers)
        self._write = write
        self._register_exit_hook()
        _WriteThread(f"stagesafe-handoff-device {write.uri}", self._copy, write, self).start()
        _WriteThread(f"stagesafe-handoff-write {write.uri}", self._write_and_settle, write, self).start()

    def _copy(self, write: _Write) -> None:
        """The device thread: the private copies off the device (resolves ``copied``), then, once the call has
        returned, the kept optimizer state's copy (``keep``) and unlocking host memory."""
        request = write.request
        try:
            start = time.perf_counter()
            if request.fill is not None:
                request.fill()
            request.phases["handoff_write_private_copy"] = time.perf_counter() - start
        except BaseException as exc:  # noqa: BLE001 - a thread reports what ended it, an interrupt too
            write.copied.set_exception(exc)  # the write fails with it; the unlock still runs
        else:
            write.copied.set_result(None)
        if request.keep is not None:  # the optimizer state kept beyond the engine, off the device: not the write's
            write.returned.wait()  # its host memory is made ready from then on, which would stall the call's CUDA calls
            start = time.perf_counter()
            try:
                request.keep()
            except Exception as exc:  # noqa: BLE001 - the write does not depend on it; keep says what it lost
                log.warning("stagesafe: copying the kept optimizer state off the device failed (%s)", exc)
            request.phases["kept_state_copy"] = time.perf_counter() - start
        if request.unlock is not None:
            write.returned.wait()
        try:
            start = time.perf_counter()
            if request.unlock is not None:
                request.unlock()
            request.phases["handoff_write_unlock"] = time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001 - only speed is at stake: the memory stays usable
            log.warning("stagesafe: could not unlock page-locked host memory (%s)", exc)

    def _write_and_settle(self, write: _Write) -> None:
        """The write thread: this rank's share of the shards, then the outcome (resolves ``committed``): rank 0
        commits and posts it, every other rank reads rank 0's word. Then the replaced handoff's files go."""
        request, start = write.request, time.perf_counter()
        commit: Commit | None = None
        error: BaseException | None = None
        try:
            write.copied.result()  # the private copies' failure is the write's
            if write.writes_here:
                commit = write_share(
                    request.values,
                    request.plan,
                    write.uri,
                    write.storage_options,
                    channel=write.channel,
                    writers=write.writers,
                    metadata=request.metadata,
                )
        except BaseException as exc:  # noqa: BLE001 - a thread reports what ended it, an interrupt too
            error = exc  # the joiners raise it
        request.values, request.fill = {}, None  # this rank's share is written: its private copies can go
        write.let_go.set()
        request.phases["handoff_write"] = time.perf_counter() - start
        if self.rank == 0:
            write.committed.settle(commit, error)
            write.channel.post_outcome("outcome", Outcome.of(error))  # the commit's outcome, for every rank
            if error is None:  # every rank gave its share: each is there to read the word, and exit waits for it
                self._last_commit = write.channel  # not the write: its hooks hold the kept state
        else:
            write.committed.settle(None, self._rank_zeros_word(write, error))
        if commit is not None:
            self._after_commit(write, commit, start)

    def _rank_zeros_word(self, write: _Write, error: BaseException | None) -> BaseException | None:
        """On a rank other than 0: wait (bounded) for rank 0's outcome, also after this rank's own ``error``,
        which says most; returns the write's failure on this rank, or None when rank 0 committed."""
        what = f"writing the handoff {write.uri!r}"
        try:
            write.channel.wait(["outcome"], what=f"{what}: rank 0's commit")
            word = write.channel.outcome("outcome")
        except DistributedStageError as exc:  # the wait's own bound: it names what it waited for
            return exc
        except Exception as exc:  # noqa: BLE001 - whatever the transport says (gloo's DistNetworkError, ...):
            return DistributedStageError(  # rank 0, which hosts the job's store, is gone or unreachable
                f"{what}: rank 0 did not answer ({describe(exc)}); it may have died before or during its commit. "
                f"Whether the handoff was committed is unknown: run stagesafe verify {write.uri}, then restart the job "
                "(resume_from=<the handoff's URL>)",
                failures={0: describe(exc)},
            )
        self._say_left(write.channel)  # read: rank 0, which hosts the store, may exit now
        if error is not None or word.ok:
            return error
        return DistributedStageError(
            f"{what} failed on rank 0 ({quoted(word.error)}); nothing was committed: the handoff there before, "
            "if any, is unchanged",
            failures={0: quoted(word.error)},
        )

    def _after_commit(self, write: _Write, commit: Commit, start: float) -> None:
        """Rank 0, committed: say so, then delete the replaced handoff's files."""
        request = write.request
        if self._on_commit is not None:
            try:
                self._on_commit(write.uri, commit, time.perf_counter() - start)
            except Exception as exc:  # noqa: BLE001 - only a message is at stake
                log.warning("stagesafe: could not report the commit of %s (%s)", write.uri, exc)
        removing = time.perf_counter()
        try:
            remove_replaced(commit)
        except Exception as exc:  # noqa: BLE001 - committed: leftovers go with a later save
            log.warning("stagesafe: could not delete the replaced handoff's files (%s)", exc)
        request.phases["handoff_write_remove_replaced"] = time.perf_counter() - removing

    def write_alone(self, write: Callable[[], None]) -> None:
        """After a Trainer call that failed on some rank, when no rank may wait for another inside the call
        (every rank calls this, in step, as it calls :meth:`start`): rank 0 writes the handoff now, alone, and
        posts how it went; a failure is logged (the stage's own error is the one raised). The other ranks only
        note it: :meth:`join` (``wait_for_handoff()``) waits for rank 0's word, so that a reader on any rank
        sees the committed handoff. The exit does not wait: a rank that failed must not stay for one still
        stuck in a collective."""
        self._count += 1
        channel, uri = self._channel.sub(f"write-{self._count}"), self.uri
        if self.rank != 0:
            self._alone = (channel, uri)
            return
        outcome = Outcome(error="interrupted")  # what the others read if an interrupt cuts the write short
        try:
            write()
            outcome = Outcome()
        except Exception as exc:  # noqa: BLE001 - the stage's own failure is raised; this one is logged
            log.error("stagesafe: could not write the handoff %s after the stage failed: %s", uri, exc)
            outcome = Outcome.of(exc)
        finally:
            channel.post_outcome("outcome", outcome)

    def _wait_for_alone(self) -> None:
        """Wait for rank 0's word on its lone write (it first leaves a collective that may last the timeout)."""
        alone, self._alone = self._alone, None
        if alone is None:
            return
        channel, uri = alone
        channel.wait(["outcome"], what=f"rank 0's write of the handoff {uri!r} after the failed call",
                     timeout=2 * self.timeout)
        outcome = channel.outcome("outcome")
        if not outcome.ok:
            log.error("stagesafe: rank 0 could not write the handoff %s after the stage failed: %s", uri,
                      quoted(outcome.error or ""))

    # -- joining ------------------------------------------------------------------------------------------
    def call_returned(self) -> None:
        """The Trainer call that started the write has returned: its host memory may be unlocked now."""
        if self._write is not None:
            self._write.returned.set()

    def wait_device(self) -> None:
        """Return once the write needs the device no more (local; before any collective that uses it)."""
        write = self._write
        if write is None:
            return
        write.returned.set()  # whoever waits has returned from the call
        _bounded(write.threads[0].wait, self.timeout, f"the handoff write's device work ({write.uri})")

    def held_bytes(self) -> int:
        """Host bytes the write still holds on this rank: its private copies, until its share is written."""
        write = self._write
        if write is None or write.let_go.is_set():
            return 0
        values = list(write.request.values.values())
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in values if t.numel()}.values())

    def wait_let_go(self) -> None:
        """Return once the write holds no private copies on this rank (its share is written, or it failed):
        local, bounded by the timeout. For a next stage that would otherwise hold two sets of them."""
        write = self._write
        if write is not None:
            _bounded(write.let_go.wait, 3 * self.timeout, f"writing the handoff {write.uri!r}: this rank's share")

    def check(self, what: str) -> None:
        """At a Trainer call's entry: raise, on every rank, a failure of the last write already known; leave
        a write still running to the end of the call. Rank 0 decides, so every rank acts alike."""
        write = self._write
        if write is None:
            return
        write.returned.set()
        if self.rank == 0:
            write.channel.post("check", write.state.value)
        write.channel.wait(["check"], what=f"{what}: rank 0's word on the last handoff write")
        if WriteState(write.channel.get("check")).settled:
            self.join()

    def finish_threads(self, write: _Write) -> None:
        """Let ``write``'s threads end (local, bounded by the timeout) and join them; its outcome stays in
        ``write.committed`` for :meth:`join`, which raises a failure where the strategy always raises it."""
        write.returned.set()
        what = f"writing the handoff {write.uri!r}"
        device, writing = write.threads
        _bounded(device.wait, self.timeout, f"{what}: the device work")
        # the thread bounds its own waits for other ranks by the timeout: give it that and as long to write,
        # on the other ranks as long again for rank 0's word; then as long to delete the files it replaced
        _bounded(write.committed.wait, (2 if self.rank == 0 else 3) * self.timeout, what)
        _bounded(writing.wait, self.timeout, f"{what}: deleting the files it replaced")

    def join(self) -> Commit | None:
        """Block until the write is committed or failed (every rank calls this); raise a failure on every
        rank (this rank's own, else rank 0's as :class:`DistributedStageError`). Returns rank 0's
        :class:`Commit`."""
        self._wait_for_alone()
        write, self._write = self._write, None
        if write is None:
            return None
        self.finish_threads(write)
        try:
            done = write.committed.result(timeout=0)
        except BaseException as exc:  # noqa: BLE001 - re-raised; after an interrupt too the handoff may never hold
            self.failed = (write.uri, exc)  # said by every later wait until a write commits or the user acknowledges
            if write.request.on_failed is not None:  # these weights: on_failed forgets that it does
                write.request.on_failed()
            raise
        self.failed = None
        return done

    # -- exit ---------------------------------------------------------------------------------------------
    def _register_exit_hook(self) -> None:
        if self._exit_hook:
            return
        self._exit_hook = True
        # A private hook, kept on purpose: threading's exit hooks run, last registered first, before the
        # interpreter joins its threads and before the ``atexit`` ones, and concurrent.futures registers one
        # at import (imported above, so ours runs first) that stops every executor from taking work. The
        # write must finish before that: s3fs runs its calls on asyncio's default executor. ``atexit``, the
        # public hook, runs too late.
        threading._register_atexit(functools.partial(_join_at_exit, weakref.ref(self)))

    def join_at_exit(self) -> None:
        """The interpreter is exiting with a write not joined: finish it. Rank 0, which hosts the job's
        key-value store under Lightning's launcher, then stays until every rank has read the outcome (or
        :data:`_EXIT_ACK_WAIT` seconds have passed)."""
        write = self._write
        if write is None:
            return
        error: Exception | None = None
        try:
            self.join()
        except Exception as exc:  # noqa: BLE001 - raised once the others have read the outcome
            error = exc
        self.stay_until_read(write.channel)
        if error is not None:
            raise error

    def stay_until_read(self, channel: JobChannel | None) -> None:
        """At exit: this rank says it has left ``channel``'s write; rank 0, which hosts the job's key-value store
        under Lightning's launcher, stays until every rank has (or :data:`_EXIT_ACK_WAIT` seconds have passed).
        Also after a joined commit: a script whose ranks all called ``wait_for_handoff()`` ends on rank 0 as soon
        as its own join returns, while another rank's write thread may still be about to read rank 0's word."""
        if channel is None:
            return
        self._say_left(channel)
        if self.rank != 0:
            return
        try:
            channel.wait([f"left/{r}" for r in range(channel.world)], what="exit", timeout=_EXIT_ACK_WAIT)
        except Exception:  # noqa: BLE001 - the others are gone: nobody is waiting for the outcome
            pass

    def stay_after_last_commit(self) -> None:
        """At exit with no write pending: rank 0 stays until every rank has read its word on the last commit
        (see :meth:`stay_until_read`)."""
        if self.rank == 0:
            self.stay_until_read(self._last_commit)

    def _say_left(self, channel: JobChannel) -> None:
        """Tell rank 0 that this rank has read its word on ``channel``'s write and may be left."""
        try:
            channel.post(f"left/{self.rank}", "")
        except Exception:  # noqa: BLE001 - rank 0 left already: it was not waiting
            pass


def _join_at_exit(ref: "weakref.ref[HandoffWriter]") -> None:
    """Before concurrent.futures' own exit hook: finish the write, or fail the process."""
    writer = ref()
    if writer is None:
        return
    if not writer.pending:
        try:
            writer.stay_after_last_commit()
            return
        except KeyboardInterrupt:  # the commit landed; only the wait for the others to read it was cut short
            message, status = (f"interrupted at exit while the other ranks read the outcome of the handoff "
                               f"{writer.uri!r}; {_committed_or_not(writer, writer._last_commit)}"), 130
    else:
        uri, write = writer.pending_uri, writer._write
        channel = None if write is None else write.channel
        try:
            writer.join_at_exit()
            if writer.rank == 0:
                log.info("stagesafe: the handoff %s was committed before the interpreter exited", uri)
            return
        except KeyboardInterrupt:
            message = f"interrupted while the handoff {uri!r} was being written; {_committed_or_not(writer, channel)}"
            status = 130
        except Exception as exc:  # noqa: BLE001 - the process must not end as if all went well
            message, status = f"the handoff write to {uri!r} failed as the interpreter exited: {describe(exc)}", 1
    log.error("stagesafe: rank %d: %s; the process exits with status %d", writer.rank, message, status)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - no stream left to flush; the exit status still says it
            pass
    os._exit(status)  # the exit status is fixed before exit hooks run: only this makes it non-zero


class _WriteThread(threading.Thread):
    """A daemon thread of one write. ``stop()`` finishes the write (every thread of it) and returns with this
    thread dead: what Lightning's test suite calls on a daemon thread a test left running."""

    def __init__(self, name: str, target: Callable[[_Write], None], write: _Write, writer: HandoffWriter) -> None:
        super().__init__(target=target, args=(write,), name=name, daemon=True)
        self._write, self._writer = write, writer
        write.threads.append(self)

    def wait(self, timeout: float) -> bool:
        """Join this thread for at most ``timeout`` seconds; whether it has ended (a thread cannot wait for
        itself: it is then as good as ended)."""
        if self is not threading.current_thread():
            self.join(timeout)
        return not self.is_alive() or self is threading.current_thread()

    def stop(self) -> None:
        self._writer.finish_threads(self._write)
        self.join(self._writer.timeout)


def _committed_or_not(writer: HandoffWriter, channel: JobChannel | None) -> str:
    """What is true of an interrupted write (``channel``'s keys), asked of the handoff in ``writer``'s folder now:
    a commit may have landed just before."""
    if channel is None:
        return "whether it was committed is unknown: run stagesafe verify on it"
    try:
        options = dict(writer.storage_options or {})
        live = is_live_commit(writer.uri, channel.prefix, storage_options=options)
    except HandoffNotFoundError:
        return "it was not committed: the folder holds no handoff"
    except Exception as exc:  # noqa: BLE001 - unreadable: said as such
        return f"whether it was committed could not be read ({describe(exc)}): run stagesafe verify on it"
    if live:
        return "it was committed before the interrupt: the handoff holds this write's weights"
    return "it was not committed: the handoff there holds an earlier write's weights, unchanged"


def _bounded(wait: Callable[[float], bool], timeout: float, what: str) -> None:
    """``wait(timeout)``, which says whether what it waits for is done; raise if it is not."""
    if not wait(timeout):
        raise DistributedStageError(
            f"{what}: not done after {timeout:.0f} s on this rank; storage may be hanging. The committed handoff, "
            "if any, is unchanged by it"
        )
