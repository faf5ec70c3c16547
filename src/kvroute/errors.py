"""Errors that mean "the user asked for something wrong", shown as one line, not a traceback,
and the decoding errors that bytes from outside can cause."""

import msgspec


class UserError(Exception):
    """A bad flag, input file, URL or configuration. The CLI prints the message and exits 2."""


#: What msgspec raises for bytes it cannot decode: its DecodeError (ValidationError included),
#: and UnicodeDecodeError for a string that is not valid UTF-8 (msgspec 0.19+ lets that one
#: through as is). Catch both wherever outside bytes (requests, event batches, responses,
#: trace files) are decoded.
UNDECODABLE: tuple[type[Exception], ...] = (msgspec.DecodeError, UnicodeDecodeError)
