"""What Linux says about this process's memory (/proc/self/smaps), for tests."""

from __future__ import annotations

from pathlib import Path


def vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address` ("hg": advised
    for huge pages)."""
    current: tuple[int, int] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = (lo, hi)
        elif head == "VmFlags:" and current and current[0] <= address < current[1]:
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")
