"""Freed large blocks leave the process: glibc's mmap threshold stays fixed (gateway.malloc)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from gateway.malloc import return_large_blocks_to_the_system

# Bodies of 8 MiB parsed three at a time, twenty times over, while small objects that live on
# are allocated in between (what a gateway's heap sees): the process's growth in resident MiB.
WORKLOAD = """
import sys
from gateway.malloc import return_large_blocks_to_the_system

def resident_mib():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS")

if sys.argv[1] == "fixed":
    assert return_large_blocks_to_the_system()
before = resident_mib()
kept = []
for _ in range(20):
    bodies = [bytes(8 << 20) for _ in range(3)]
    kept.append("x" * 200_000)
    del bodies
print(resident_mib() - before)
"""

glibc = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator"
)


def growth_mib(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", WORKLOAD, mode], capture_output=True, text=True, timeout=60, check=True
    )
    return int(done.stdout.strip())


@glibc
def test_with_the_threshold_fixed_freed_bodies_do_not_stay_resident() -> None:
    # The control: with glibc's own moving threshold the same work leaves bodies resident.
    assert growth_mib("moving") >= 16
    # The kept strings themselves are 4 MiB.
    assert growth_mib("fixed") <= 8


@glibc
def test_the_threshold_can_be_fixed_in_this_process() -> None:
    assert return_large_blocks_to_the_system() is True
