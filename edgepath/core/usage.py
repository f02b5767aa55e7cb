"""What a stage's process used, for its record: its wall time and peak resident memory."""

from __future__ import annotations

import resource
import time


def peak_rss_bytes(usage: resource.struct_rusage | None = None) -> int:
    """The peak resident set size in ``usage`` (default: this process's own so far), in
    bytes: Linux reports ``ru_maxrss`` in KiB."""
    return (usage or resource.getrusage(resource.RUSAGE_SELF)).ru_maxrss * 1024


def cost(started: float) -> dict[str, float | int]:
    """A stage's cost for its record, ``started`` its ``time.monotonic()`` at the start:
    ``wall_time_s``, and ``peak_rss_bytes``, the largest resident set of the stage's
    process or of any child it ran and waited for (engine workers, llama.cpp's tools);
    children that ran at once are not summed."""
    return {"wall_time_s": round(time.monotonic() - started, 1),
            "peak_rss_bytes": max(peak_rss_bytes(), peak_rss_bytes(resource.getrusage(resource.RUSAGE_CHILDREN)))}
