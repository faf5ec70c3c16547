"""Subcommands of the ``kvroute`` CLI, one module each (see ``kvroute.cli``)."""
