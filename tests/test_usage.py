"""A stage's cost as its record carries it (``core.usage``)."""

import subprocess
import sys
import time

from edgepath.core import usage


def test_a_stage_s_peak_counts_the_child_processes_it_ran():
    started = time.monotonic()
    own = usage.peak_rss_bytes()
    child = 512 * 2**20 + own  # larger than this process has been so far
    subprocess.run([sys.executable, "-c", f"b = bytearray({child}); b[::4096] = b'x' * len(b[::4096])"], check=True)
    cost = usage.cost(started)
    assert cost["peak_rss_bytes"] >= child > own
    assert cost["wall_time_s"] >= 0 and cost["wall_time_s"] <= time.monotonic() - started + 0.1
