"""Where the tests find the repository and their data, wherever a test file sits below tests/."""

from pathlib import Path

#: The tests folder (on ``sys.path`` for every test: its conftest.py is there).
TESTS = Path(__file__).resolve().parent
#: The repository's root.
ROOT = TESTS.parent
#: Recorded inputs and golden outputs (tests/data).
DATA = TESTS / "data"
