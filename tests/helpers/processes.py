"""The live processes of a process group, read from /proc (zombies excluded): what a test checks to
prove that a server tree was started, or is gone."""

from __future__ import annotations

import os


def pids_in_group(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry))
    return out
