"""What the Trainer calls of one strategy share: the handoff folder it writes (claimed once per folder asked
for, :mod:`~stagesafe.stages.ownership`), that folder's writer (made once the ranks agree where the folder is,
:mod:`~stagesafe.stages.location`), the count of calls, how the last one ended (for the collectives that follow,
:mod:`~stagesafe.stages.collective_guard`), and the failure of the last write, until a write commits or the user
acknowledges it, the boundary of the call under way and the report of the last one's. No Lightning here: the
strategy passes what it knows of the Trainer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from stagesafe.boundary_report import BoundaryReport
from stagesafe.errors import InvalidArgumentError
from stagesafe.stages.boundary import StageBoundary
from stagesafe.stages.channel import Ending, JobChannel, agree_on_ending
from stagesafe.stages.collective_guard import CollectiveGuard
from stagesafe.stages.history import HandoffTarget, history_of
from stagesafe.stages.location import Location, agree_on_location
from stagesafe.stages.ownership import claim_folder
from stagesafe.stages.writer import HandoffWriter

__all__ = ["FAILURE_GRACE", "CallSeries"]

FAILURE_GRACE = 60.0  # seconds a rank whose call failed waits for the others before it keeps its own weights


class CallSeries:
    """The calls of one strategy, in order: where their handoff goes, who writes it, and how the last ended.

    ``storage_options``, ``resume_from`` and ``overwrite``: the strategy's arguments of those names
    (``overwrite``: ``overwrite_handoff``)."""

    def __init__(
        self,
        *,
        storage_options: Mapping[str, Any] | None,
        resume_from: str | None,
        overwrite: bool,
    ) -> None:
        self.storage_options = storage_options
        self.resume_from = resume_from
        self.overwrite = overwrite
        self.calls = 0  # Trainer calls entered
        self.writer: HandoffWriter | None = None
        self.location: tuple[str, Location] | None = None
        self.guard = CollectiveGuard()  # how the last calls ended, for the collectives that follow
        self._claimed: dict[str, str] = {}  # the folder asked for -> the one this run writes (see ownership)
        self.boundary: StageBoundary | None = None  # the boundary of the call under way, between setup and teardown
        self.last_report: BoundaryReport | None = None  # the last call's boundary's (None before the first ended)

    def target(self, asked: str, *, named: bool, on_versioned: Callable[[str, str], None]) -> HandoffTarget:
        """The folder this run writes for ``asked``: claimed at its first call, every rank together (``named``: the
        user named it; ``on_versioned(asked, taken)``: a default folder gave way to a versioned one)."""
        if asked not in self._claimed:
            uri = claim_folder(asked, self.storage_options, named=named, resume_from=self.resume_from,
                               overwrite=self.overwrite)
            if uri != asked:
                on_versioned(asked, uri)
            self._claimed[asked] = uri
        return HandoffTarget(uri=self._claimed[asked], storage_options=self.storage_options)

    def writer_for(
        self,
        target: HandoffTarget,
        module: nn.Module | None,
        *,
        world_size: int,
        meta: bool,
        timeout: float,
        on_commit: Callable[..., None],
    ) -> HandoffWriter:
        """The writer of ``target``, made at its first call once the ranks agree on the folder (collectives: every
        rank calls it at the same point). ``meta``: every rank must see the folder, or this is refused."""
        if self.location is not None and self.location[0] == target.uri and self.writer is not None:
            return self.writer
        if self.writer is not None and self.writer.pending:
            self.writer.join()
        self.wait_device(module)  # the module's writer of another strategy too: collectives follow
        location = agree_on_location(target)
        if location.writers < world_size and meta:
            raise InvalidArgumentError(
                "between_stages='meta' reads the handoff on every rank, but not every rank sees the handoff folder "
                f"of rank 0 (each rank's folder: {list(location.folders)}); pass a handoff_uri that every rank "
                "sees (shared storage or an object store), or use between_stages='cpu'"
            )
        self.location = (target.uri, location)
        channel = JobChannel.of_job(f"stagesafe/{location.writer_id}", timeout=timeout)
        self.writer = HandoffWriter(channel, target.uri, storage_options=target.storage_options,
                                    writers=location.writers, timeout=timeout, on_commit=on_commit)
        return self.writer

    def writers(self, module: nn.Module | None) -> list[HandoffWriter]:
        """This series' writer, and the writer of ``module``'s last handoff if another strategy's."""
        writers = [self.writer] if self.writer is not None else []
        history = history_of(module) if module is not None else None
        other = history.writer if history is not None else None
        if other is not None and other is not self.writer:
            writers.append(other)
        return writers

    def wait_device(self, module: nn.Module | None) -> None:
        """Return once no writer needs the device: a collective may follow."""
        for writer in self.writers(module):
            writer.wait_device()

    def collective(self, module: nn.Module | None) -> contextlib.AbstractContextManager[None]:
        """:class:`~stagesafe.stages.collective_guard.CollectiveGuard` around one collective of the strategy's."""
        writer, calls = self.writer, self.calls
        meeting = (lambda: writer.channel.sub(f"call-{calls}/met")) if writer is not None else None
        return self.guard.around(self.writers(module), meeting)

    def call_ended(self, *, failed: bool) -> Ending:
        """Did every rank reach the end of this call (the job's key-value store; a rank whose call ``failed``
        waits :data:`FAILURE_GRACE` at most)? The collectives that follow a call some rank left elsewhere meet
        first."""
        assert self.writer is not None
        grace = min(FAILURE_GRACE, self.writer.timeout)
        ending = agree_on_ending(self.writer.channel.sub(f"call-{self.calls}"), failed=failed, grace=grace)
        self.guard.call_ended(ending)  # after a failure the next call meets first; its group may be broken
        return ending

    def call_returned(self, module: nn.Module | None) -> None:
        """The Trainer call is returning: its teardown's CUDA calls no longer wait for the writers' copies, and
        the optimizer it gave back may wait for its state's copy off the device."""
        for writer in self.writers(module):
            writer.call_returned()
        history = history_of(module) if module is not None else None
        if history is not None and history.kept is not None:
            history.kept.call_returned()

    def join(self, module: nn.Module | None) -> None:
        """Return once the last write is committed or failed (its failure: :meth:`failure`)."""
        for writer in self.writers(module):
            writer.call_returned()
            writer.join()

    def failure(self, module: nn.Module | None) -> tuple[str, BaseException] | None:
        """The failure of the last joined write, while no write since has committed and it is not acknowledged
        (this series' writer; before its first call, the writer of the module's last handoff): its URL, error."""
        writers = self.writers(module)
        return writers[0].failed if writers else None

    def acknowledge(self, module: nn.Module | None) -> tuple[str, BaseException] | None:
        """Forget the last write's failure (on this rank); returns what it was."""
        failed = self.failure(module)
        for writer in self.writers(module):
            writer.failed = None
        return failed
