"""The upstream warnings that stagesafe's pinned versions print at every optimizer step and that no user can act on,
left out by message and module; ``STAGESAFE_UPSTREAM_WARNINGS=1`` in the environment shows them again.

torch 2.13 deprecates ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, which DeepSpeed 0.19 calls inside
every ZeRO step: a 16-step fit on 2 ranks printed 132 lines of the pair ``FutureWarning: `torch.distributed.
all_gather_into_tensor` is deprecated ...`` / ``return func(*args, **kwargs)``. Only those two messages, raised
from torch.distributed's or DeepSpeed's own modules, are filtered; any other warning (a ``FutureWarning`` of the
same modules, the same text warned from the user's code) is shown as before.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["SHOW_VARIABLE", "PER_STEP", "quiet_per_step_warnings"]

SHOW_VARIABLE = "STAGESAFE_UPSTREAM_WARNINGS"  # "1": show them

# (message, module): both regular expressions, matched from the start, as Python's warning filters match them
PER_STEP = (
    (
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        r"(torch\.distributed|deepspeed)\.",
    ),
)


def quiet_per_step_warnings() -> bool:
    """Filter the warnings of :data:`PER_STEP` in this process (again: a filter already there moves to the front),
    unless the environment's :data:`SHOW_VARIABLE` is ``1``. Returns whether they are filtered."""
    if os.environ.get(SHOW_VARIABLE, "").strip() == "1":
        return False
    for message, module in PER_STEP:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning, module=module)
    return True
