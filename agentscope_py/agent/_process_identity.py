"""Who holds a session's lock or ticket, as far as a process on the same host can tell whether it
is dead (the stores' session queues: `_sqlite_session_queue`, `_redis_session_queue`).

A lease alone makes a SIGKILLed holder block its session for the whole lease. A process on the
same host can know better: `this_process` is ``<host>/<pid>/<start>`` — the host being the
kernel's boot id and this process's pid namespace (two containers on one kernel share the boot id
but not the pids), ``<start>`` the process's start time in clock ticks since boot (field 22 of
``/proc/<pid>/stat``), so a pid reused by a later process is not taken for the holder. `dead`
answers True only when that is certain: the owner is of this host, and its pid is gone, a zombie,
or another process's. Anywhere else (another host or namespace, no ``/proc``, an owner recorded
without one) it answers False, and the lease stands.
"""

from __future__ import annotations

import os

__all__ = ["dead", "this_process"]

_known: tuple[int, str] | None = None
"""This process's identity, computed once per pid (a forked child computes its own)."""


def _host() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return f"{boot}:{namespace}" if boot else None


def _started(pid: int) -> str | None:
    """The start time of process ``pid``, or None if it is gone or a zombie (dead, not reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except FileNotFoundError:
        # Gone, or hidden (``/proc`` mounted ``hidepid``): only the kernel's answer to a null
        # signal tells them apart.
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        raise PermissionError(f"process {pid} exists, but its /proc entry cannot be read") from None
    # After the command name (in parentheses, which may hold anything): state is field 3,
    # starttime field 22.
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def this_process() -> str:
    """This process's identity (``""`` where it cannot be known: then nobody declares it dead)."""
    global _known
    pid = os.getpid()
    if _known is None or _known[0] != pid:
        host = _host()
        try:
            started = _started(pid) if host is not None else None
        except (OSError, ValueError, IndexError):
            started = None
        _known = (pid, "" if host is None or started is None else f"{host}/{pid}/{started}")
    return _known[1]


def dead(owner: str) -> bool:
    """Whether the process ``owner`` (a `this_process` of some process) is certainly dead."""
    parts = owner.split("/")
    mine = this_process()
    if len(parts) != 3 or not parts[1].isdigit() or not mine:
        return False
    host, pid, started = parts
    here, my_pid, my_start = mine.split("/")
    if host != here:
        return False
    if pid == my_pid:
        return started != my_start  # an earlier process with this pid: that one is gone
    try:
        return _started(int(pid)) != started
    except (OSError, ValueError, IndexError):
        return False  # unreadable: not known to be dead
