"""matplotlib for kvroute's plots: files only, never a display (servers and CI have none).

Imported lazily by the functions that draw, so commands that plot nothing never pay for
matplotlib's import.
"""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the Agg (file) backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
