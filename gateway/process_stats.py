"""What the kvgate process itself holds: asyncio tasks, open file descriptors, resident memory.

Shown under `process` in `/admin/state`, so that a soak run (tests/faults/soak.py) or an
operator can tell a leak from load: every request in flight holds a task and a socket or two,
and all of them must be gone once the traffic is. Read on demand only (an admin call), never on
the request path.
"""

from __future__ import annotations

import asyncio
import os
import resource
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_FD_DIR = Path("/proc/self/fd")
_STATUS = Path("/proc/self/status")


@dataclass(frozen=True, slots=True)
class ProcessStats:
    # Which process answered: with `workers` > 1, each is a kvgate of its own.
    pid: int
    asyncio_tasks: int
    # None where the platform has no /proc (the figures are Linux's).
    open_fds: int | None
    rss_bytes: int | None
    peak_rss_bytes: int
    threads: int | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _status_field(text: str, name: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(name + ":"):
            parts = line.split()
            if len(parts) < 2:
                return None
            value = int(parts[1])
            return value * 1024 if len(parts) > 2 and parts[2] == "kB" else value
    return None


def process_stats() -> ProcessStats:
    """The figures now; call on the event loop (counts the running loop's tasks)."""
    try:
        fds: int | None = len(os.listdir(_FD_DIR))
    except OSError:
        fds = None
    try:
        status = _STATUS.read_text()
    except OSError:
        status = ""
    # ru_maxrss is in KiB on Linux.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return ProcessStats(
        pid=os.getpid(),
        asyncio_tasks=len(asyncio.all_tasks()),
        open_fds=fds,
        rss_bytes=_status_field(status, "VmRSS"),
        peak_rss_bytes=peak,
        threads=_status_field(status, "Threads"),
    )
