"""What ``kvroute serve`` asks of its process before it serves: descriptors enough for its
connection limit (:func:`raise_fd_limit`, :func:`default_max_connections`) and a malloc that
returns large freed buffers to the system (:func:`return_freed_memory_promptly`)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import resource
import sys

#: Descriptors kept out of the connection limit: the listening socket, logs, the tokenizer's
#: files, health checks, retention's refreshes and the KV event sockets (two per worker).
FD_RESERVE = 128


def raise_fd_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (what Go and nginx do at
    start: the soft limit is often 1024 while the hard one allows far more); the soft limit
    in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


def default_max_connections(fd_limit: int | None = None) -> int:
    """Client connections that can never exhaust ``fd_limit`` descriptors (default: the
    process's soft ``RLIMIT_NOFILE``): each client connection with a request in flight holds a
    second descriptor, its connection to the worker, and :data:`FD_RESERVE` stay for the
    rest. ``(1024 - 128) // 2 = 448`` under ``ulimit -n 1024``."""
    if fd_limit is None:
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if fd_limit == resource.RLIM_INFINITY:
        fd_limit = 1 << 20
    return max(16, (fd_limit - FD_RESERVE) // 2)


def return_freed_memory_promptly() -> None:
    """Make glibc's malloc give large freed blocks back to the system (serving only).

    glibc raises its mmap threshold each time a large block is freed, so after one 50 MB
    request every later 1 MB buffer comes from the heap, where fragmentation keeps it in the
    RSS long after it is freed (the router stayed at ~800 MB). A fixed 128 KiB threshold keeps
    large buffers in their own mappings, returned when freed. Elsewhere than glibc: no-op."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 128 * 1024)
    mallopt(m_trim_threshold, 1024 * 1024)
