"""Errors that mean "the user asked for something wrong", shown as one line, not a traceback."""


class UserError(Exception):
    """A bad flag, input file, URL or configuration. The CLI prints the message and exits 2."""
