"""The docs quote the code rather than copy a rule: each ```rust block in docs/*.md that names
its source (`Type::function` in `crates/...rs`, in the paragraph before it) must stand in that
file verbatim, so a change of the rule that forgets the docs fails here."""

import re
from pathlib import Path

from support.paths import ROOT

QUOTE = re.compile(r"`(crates/[\w./-]+\.rs)`[^`]*?(?:`[^`]*`[^`]*?)*?\n\n```rust\n(.*?)```", re.S)


def quotes() -> list[tuple[str, Path, str]]:
    found = []
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for m in QUOTE.finditer(doc.read_text()):
            found.append((doc.name, ROOT / m.group(1), m.group(2)))
    return found


def test_the_kv_aware_rule_in_the_docs_is_the_code():
    found = quotes()
    assert any(path.name == "kv_aware.rs" for _, path, _ in found)  # the kv-aware cost is quoted
    for doc, path, text in found:
        assert text in path.read_text(), f"{doc} quotes {path.relative_to(ROOT)}, which no longer says:\n{text}"
