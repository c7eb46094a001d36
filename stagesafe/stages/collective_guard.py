"""The guard around the strategy's collectives (Lightning's ``barrier``, ``broadcast``, ``reduce``, ``all_gather``,
``reduce_boolean_decision``): none while a writer still needs the device (its copies would queue behind it);
after a call that some rank left elsewhere, the ranks meet through the key-value store first, so that a rank
still inside that call meets a clear timeout instead of a mismatched collective; and a collective that fails
once an earlier call failed on some rank says that the process group is broken, and what to do."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from stagesafe.errors import DistributedStageError
from stagesafe.stages.channel import Ending, JobChannel
from stagesafe.stages.writer import HandoffWriter

__all__ = ["RESTART", "CollectiveGuard"]

RESTART = (
    "Restart the job; it continues from the last committed handoff with "
    "StageSafeDeepSpeedStrategy(resume_from=<the handoff's URL>)"
)


class CollectiveGuard:
    """What the strategy's collectives must know of the calls before them: how the last one ended."""

    def __init__(self) -> None:
        self.last_ending: Ending | None = None  # a call that failed on some rank: meet before the next
        self.failed_ranks: list[int] | None = None  # its failed ranks: later collectives may find the group broken

    def call_ended(self, ending: Ending) -> None:
        """A Trainer call ended as ``ending`` says; one that failed on some rank, or that a rank never reached
        the end of, makes the next collective meet first, and later ones name a broken group."""
        if ending.failed or ending.broken:
            self.last_ending, self.failed_ranks = ending, list(ending.failed or ending.absent)

    @contextlib.contextmanager
    def around(self, writers: Iterable[HandoffWriter], meeting: Callable[[], JobChannel] | None) -> Iterator[None]:
        """Around one collective: ``writers``' device work waited for, the meeting held if one is due
        (``meeting``: the channel the ranks meet on, None before the strategy's first call)."""
        for writer in writers:
            writer.wait_device()
        ending, self.last_ending = self.last_ending, None
        if ending is not None and meeting is not None:
            try:
                meeting().exchange("here", "", what="the next Trainer call")
            except DistributedStageError as exc:
                raise DistributedStageError(
                    f"{exc}. The last Trainer call failed on rank(s) {list(ending.failed) or '?'} while other "
                    "ranks were still inside it; they fail once their collective times out, and the job's process "
                    f"group cannot be used after that. {RESTART}"
                ) from None
        try:
            yield
        except RuntimeError as exc:  # torch.distributed's errors, DistBackendError among them
            if self.failed_ranks is None:
                raise
            raise DistributedStageError(
                f"the job's process group is broken ({type(exc).__name__}: {str(exc)[:300]}): an earlier Trainer "
                f"call failed on rank(s) {self.failed_ranks}, and a collective timed out since, on some rank. "
                f"torch.distributed cannot recover in this process. {RESTART}"
            ) from exc
