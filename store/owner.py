"""Who holds an embedded store: its lock, and the owner file a long-running process leaves.

chDB runs the ClickHouse engine inside one process, which locks the store directory; a second
process cannot open it. ClickHouse's own lock file says only the holder's pid, so a kvtrace
process that keeps the store open (`serve`, `collector`, `dashboard`, `alerts`) also writes an
owner file naming its command and URL: then a refused `kvtrace db status` can say which service
to stop, or to use instead. A file whose process is gone is stale and ignored.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from kvtrace.store.dsn import Dsn

OWNER_FILE = "kvtrace-owner.json"
LOCK_FILE = "status"  # ClickHouse's: flock-ed by the engine that has the directory open, with its pid


class Owner(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    command: str  # as a user would type it, e.g. "kvtrace serve"
    url: str = ""  # where it serves, "" when it serves nothing
    started_ns: int = 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def read_owner(directory: str | Path) -> Owner | None:
    """The owner file's process, if that process still runs."""
    try:
        owner = msgspec.json.decode((Path(directory) / OWNER_FILE).read_bytes(), type=Owner)
    except (OSError, msgspec.DecodeError):
        return None
    return owner if alive(owner.pid) else None


def lock_holder(directory: str | Path) -> int | None:
    """The pid of the process whose engine has the store directory open, None when none has.

    Asked only after an open failed: taking the lock even for a moment could make a process
    starting at that instant fail in turn."""
    path = Path(directory) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        text = os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "PID" and value.strip().isdigit():
            return int(value.strip())
    return 0  # locked, by a process that did not say which


def in_use_message(directory: str | Path, pid: int, owner: Owner | None) -> str:
    """One line: whose the store is and the ways out."""
    who = f"pid {pid}" if pid else "pid unknown"
    use = "stop it"
    if owner is not None and owner.pid == pid:
        who += f", `{owner.command}`" + (f" on {owner.url}" if owner.url else "")
        if owner.url:
            use = "stop it, or use that process's dashboard/collector"
    return (f"the embedded store at {directory} is in use by another process ({who}); {use}, "
            "or point --dsn at a ClickHouse server")


@contextlib.contextmanager
def owning(dsn: Dsn, command: str, url: str = "") -> Iterator[None]:
    """Leave an owner file in an embedded store's directory while the block runs (a server's
    store, or an in-memory one, has none to leave). Removed at the end only if still this
    process's: a later owner's file is not ours to delete."""
    if not dsn.embedded or dsn.path == ":memory:":
        yield
        return
    directory = Path(dsn.path)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / OWNER_FILE
    me = Owner(pid=os.getpid(), command=command, url=url, started_ns=time.time_ns())
    tmp = path.with_name(f".{OWNER_FILE}.{me.pid}")
    tmp.write_bytes(msgspec.json.encode(me))
    tmp.replace(path)
    try:
        yield
    finally:
        with contextlib.suppress(OSError, msgspec.DecodeError):
            if msgspec.json.decode(path.read_bytes(), type=Owner).pid == me.pid:
                path.unlink()
