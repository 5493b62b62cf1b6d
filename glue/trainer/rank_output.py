"""Where a trainer rank's output goes: the run's `logs/trainer_<rank>.log` on the driver's folder, written by the rank
itself when its node sees that folder (TrainerGroup names the file in the line that says a rank died)."""
from __future__ import annotations

import os
import sys


def write_output_to(path: str, first_line: str) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2, so C++ and megatron output too) go to `path`,
    appended, line by line, when its folder is visible on this node (a shared file system); otherwise they stay where
    Ray put them (the node's Ray worker logs). Then `first_line` and this process's pid are printed there."""
    if os.path.isdir(os.path.dirname(path)):
        _redirect(path)
    print(f"{first_line}, pid {os.getpid()}", flush=True)


def _redirect(path: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
