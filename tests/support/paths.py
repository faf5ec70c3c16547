"""Where the tests find the repository and their data, wherever a test file sits below tests/."""

from pathlib import Path

#: The tests folder.
TESTS = Path(__file__).resolve().parent.parent
#: The repository's root.
ROOT = TESTS.parent
#: Recorded inputs and golden outputs (tests/data).
DATA = TESTS / "data"
