"""Log filters shared by kvroute's HTTP servers (the emulator's workers and the router).

aiohttp logs an ERROR with a traceback for every request it cannot parse (a bad request line,
header or chunk framing) and then answers it with a 4xx. Those are the client's mistakes:
logged one by one they read like server faults, and any client could flood the log with them.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError


class QuietClientErrors(logging.Filter):
    """Drops aiohttp's ERROR-with-traceback for each malformed request it answers with a
    4xx; failures of the handlers themselves still log."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 0) < 500)


QUIET_CLIENT_ERRORS = QuietClientErrors()


def quiet_aiohttp_client_errors() -> None:
    """Install :data:`QUIET_CLIENT_ERRORS` on aiohttp's server logger (idempotent)."""
    logging.getLogger("aiohttp.server").addFilter(QUIET_CLIENT_ERRORS)
