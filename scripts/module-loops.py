#!/usr/bin/env python3
"""List module import loops in the Rust crates and the Python package; exit 1 if any.

Rust: every file under `crates/*/src` is a module (`a/mod.rs` and `a.rs` are `a`); an edge
A -> B for each `crate::B...` or `super::...` path in A outside its `#[cfg(test)]` module
(tests may reach anywhere), and for a parent's bare `child::...` paths; B resolved to the
longest module path that exists. Declaring a child (`mod x;`) is no edge, naming it is: a
parent that uses its child and a child that uses its parent's items are a loop too.
Python: every module under `src/kvroute`, an edge for each `import`/`from ... import` of
another module of the package (function-local imports included: a deferred import is still
a loop). A loop is a strongly connected component of more than one module.

Usage: scripts/module-loops.py [--edges]   (--edges also prints every edge)
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATH_RE = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
USE_GROUP_RE = re.compile(r"\b(crate|super)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^;]*?)\}", re.S)


def rust_modules(src: Path) -> dict[tuple[str, ...], Path]:
    """Module path -> file, for one crate's `src`."""
    mods: dict[tuple[str, ...], Path] = {}
    for f in src.rglob("*.rs"):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts in (["lib"], ["main"]):
            parts = []
        elif parts[-1] == "mod":
            parts = parts[:-1]
        mods[tuple(parts)] = f
    return mods


def strip_tests(text: str) -> str:
    """The file without its `#[cfg(test)] mod ... { ... }` blocks and comments."""
    text = re.sub(r"//[^\n]*", "", text)
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*(;|\{)", text):
        if m.start() < i:
            continue
        out.append(text[i : m.start()])
        if m.group(3) == ";":
            i = m.end()
            continue
        depth, j = 1, m.end()
        while depth and j < len(text):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def resolve(mods, parts: tuple[str, ...]) -> tuple[str, ...] | None:
    for n in range(len(parts), 0, -1):
        if parts[:n] in mods:
            return parts[:n]
    return None


def rust_edges(src: Path) -> dict[tuple[str, ...], set[tuple[str, ...]]]:
    mods = rust_modules(src)
    edges: dict[tuple[str, ...], set[tuple[str, ...]]] = {m: set() for m in mods}
    for mod, f in mods.items():
        if mod and mod[-1] == "tests":
            continue
        text = strip_tests(f.read_text())
        paths: list[tuple[str, list[str]]] = []
        for m in USE_GROUP_RE.finditer(text):
            base = [p for p in m.group(2).split("::") if p]
            for item in re.split(r",", m.group(3)):
                item = item.strip().split(" as ")[0].strip("{} \n")
                if item and item != "self":
                    paths.append((m.group(1), base + [p for p in item.split("::") if p]))
                elif item == "self":
                    paths.append((m.group(1), base))
        for m in PATH_RE.finditer(text):
            paths.append((m.group(1), [p for p in m.group(2).split("::") if p]))
        # `super` is relative to the module's parent (a file's own module is `mod`).
        for root, rel in paths:
            if root == "crate":
                full = tuple(rel)
            else:
                base = list(mod[:-1])
                while rel and rel[0] == "super":
                    base, rel = base[:-1], rel[1:]
                full = tuple(base + rel)
            target = resolve(mods, full)
            # Naming an ancestor only reaches what the ancestor itself defines (its children
            # declaring this module is no import), so count it like any other edge.
            if target is not None and target != mod:
                edges[mod].add(target)
        # A parent naming its own child (`use child::X`, `pub use child::X`).
        for other in mods:
            if len(other) == len(mod) + 1 and other[: len(mod)] == mod:
                if re.search(rf"(?<![:\w]){other[-1]}::", text):
                    edges[mod].add(other)
    return edges


def python_edges(pkg: Path) -> dict[str, set[str]]:
    names: dict[str, Path] = {}
    for f in pkg.rglob("*.py"):
        parts = list(f.relative_to(pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = f
    edges: dict[str, set[str]] = {n: set() for n in names}
    for name, f in names.items():
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")
                    base = base if is_pkg else base[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in names:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + "."):
                    edges[name].add(t)
    return edges


def loops(edges):
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    show = "--edges" in sys.argv
    found = 0
    for src in sorted(ROOT.glob("crates/*/src")):
        edges = rust_edges(src)
        crate = src.parent.name
        if show:
            for a in sorted(edges):
                for b in sorted(edges[a]):
                    print(f"{crate}: {'::'.join(a) or 'lib'} -> {'::'.join(b) or 'lib'}")
        for comp in loops(edges):
            found += 1
            print(f"LOOP {crate}: " + ", ".join("::".join(m) or "lib" for m in comp))
    edges = python_edges(ROOT / "src" / "kvroute")
    if show:
        for a in sorted(edges):
            for b in sorted(edges[a]):
                print(f"python: {a} -> {b}")
    for comp in loops(edges):
        found += 1
        print("LOOP python: " + ", ".join(comp))
    print(f"{found} module loop(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
