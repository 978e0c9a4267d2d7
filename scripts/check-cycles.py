#!/usr/bin/env python3
"""Checks that no module of a workspace crate imports a module that imports it back.

Why: a cycle between two modules means neither can be understood, tested or
moved without the other; the layering the code map describes (R layer at the
bottom, adapters on top) only holds if imports point one way. This script
builds each crate's module graph from its `src/` files and reports every
cycle, so one cannot come back unnoticed.

Usage:
    python3 scripts/check-cycles.py [--root WORKSPACE_DIR] [-v]
    python3 scripts/check-cycles.py --self-test

Exit status: 0 without cycles, 1 with cycles (or a failed self-test), 2 on
bad input (no workspace Cargo.toml, unreadable file).

What counts as a dependency of module `a` on module `b` (both of one crate):
`use crate::b...` (any nesting of braces), `crate::b::...` anywhere in code,
and `super::b` / `self::b` resolved against `a`'s own path. `crate::x::y` is
a dependency on module `x::y` if it exists, else on the longest prefix that
is a module. The crate root (lib.rs or main.rs) is never a target: a
reference to an item of the root is resolved through the root's `use`
lines (`pub use m::{Item}`, `pub use m::*`) to the module that defines it,
or ignored. Edges between a module and its ancestors or descendants are not
cycles (a parent declares and usually uses its children). Comments, string
and char literals, `#[cfg(test)]` items (e.g. `mod tests { ... }`) and
`#[cfg(test)] mod x;` files are not scanned. `#[path]` attributes and
modules inline in a file are not modelled (an inline module counts as part
of its file).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field

# --------------------------------------------------------------------------
# Lexing: blank out what is not code, keeping offsets and line numbers.
# --------------------------------------------------------------------------

_CHAR_LIT = re.compile(r"'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F_]{1,8}\}|.)|[^\\'\n])'")
_RAW_STR = re.compile(r'(?:br|cr|r)(#*)"')


def _blank(s: str) -> str:
    """`s` with everything but newlines replaced by spaces (keeps offsets)."""
    return re.sub(r"[^\n]", " ", s)


def strip_non_code(src: str) -> str:
    """Replaces comments (line, nested block, doc) and string/char literals
    with spaces, so later regexes see only code; newlines are kept so that
    offsets map to the same line numbers as in the file."""
    out: list[str] = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(_blank(src[i:j]))
            i = j
            continue
        if src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(_blank(src[i:j]))
            i = j
            continue
        prev_ident = i > 0 and (src[i - 1].isalnum() or src[i - 1] == "_")
        if not prev_ident:
            m = _RAW_STR.match(src, i)
            if m:
                end = src.find('"' + m.group(1), m.end())
                j = n if end < 0 else end + 1 + len(m.group(1))
                out.append(_blank(src[i:j]))
                i = j
                continue
        if c == '"':
            # Plain, byte or C string: the prefix letter stays (harmless).
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(_blank(src[i:j]))
            i = j
            continue
        if c == "'":
            m = _CHAR_LIT.match(src, i)
            if m:
                out.append(_blank(m.group(0)))
                i = m.end()
                continue
            # A lifetime or label: code.
        out.append(c)
        i += 1
    return "".join(out)


def _matching_brace(code: str, open_at: int) -> int:
    """Offset just past the `}` matching the `{` at `open_at` (or the end)."""
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(code)


_CFG_TEST = re.compile(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]")
_ATTR = re.compile(r"\s*#\s*\[")
_TEST_MOD_DECL = re.compile(r"\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")


def blank_test_items(code: str) -> tuple[str, set[str]]:
    """Blanks every item marked `#[cfg(test)]` (a `mod tests { ... }`, a test
    helper fn, a `use`), and returns the names of child modules declared as
    `#[cfg(test)] mod name;` (their files are test-only)."""
    test_mods: set[str] = set()
    pos = 0
    while True:
        m = _CFG_TEST.search(code, pos)
        if not m:
            return code, test_mods
        j = m.end()
        # Skip further attributes on the same item.
        while True:
            a = _ATTR.match(code, j)
            if not a:
                break
            depth, k = 0, a.end() - 1
            while k < len(code):
                if code[k] == "[":
                    depth += 1
                elif code[k] == "]":
                    depth -= 1
                    if depth == 0:
                        break
                k += 1
            j = k + 1
        d = _TEST_MOD_DECL.match(code, j)
        if d:
            test_mods.add(d.group(1))
        semi, brace = code.find(";", j), code.find("{", j)
        if brace >= 0 and (semi < 0 or brace < semi):
            end = _matching_brace(code, brace)
        else:
            end = len(code) if semi < 0 else semi + 1
        code = code[: m.start()] + _blank(code[m.start() : end]) + code[end:]
        pos = end


# --------------------------------------------------------------------------
# Paths in code: use trees and qualified paths.
# --------------------------------------------------------------------------

_USE = re.compile(r"(?<![\w$])use\s")
_TOKEN = re.compile(r"\s*(::|\{|\}|,|\*|\w+)")


@dataclass
class Ref:
    """One path found in a file: its segments and the offset of its end."""

    segments: list[str]
    offset: int
    alias: str | None = None  # `as` name in a use tree
    glob: bool = False  # ends in `::*`


def parse_use_tree(code: str, start: int, end: int) -> list[Ref]:
    """Expands the use tree in code[start:end] into one Ref per leaf."""
    toks: list[tuple[str, int]] = []
    pos = start
    while pos < end:
        m = _TOKEN.match(code, pos, end)
        if not m:
            pos += 1  # something we do not model (e.g. a stray char)
            continue
        toks.append((m.group(1), m.start(1)))
        pos = m.end()
    refs: list[Ref] = []

    def tree(i: int, prefix: list[str]) -> int:
        segs = list(prefix)
        last_off = toks[i][1] if i < len(toks) else end
        self_leaf = False  # `a::{self}` names the prefix itself
        while i < len(toks):
            t, off = toks[i]
            if t == "::":
                i += 1
            elif t == "{":
                i += 1
                while i < len(toks) and toks[i][0] != "}":
                    if toks[i][0] == ",":
                        i += 1
                        continue
                    i = tree(i, segs)
                return i + 1
            elif t == "*":
                refs.append(Ref(segs, off, glob=True))
                return i + 1
            elif t in (",", "}"):
                break
            elif t == "as":
                alias = toks[i + 1][0] if i + 1 < len(toks) else None
                if segs:
                    refs.append(Ref(segs, last_off, alias=alias))
                return i + 2
            else:
                if t == "self" and segs:
                    self_leaf = True
                    i += 1
                    last_off = off
                    continue
                segs = segs + [t]
                last_off = off
                i += 1
        if segs and (segs != list(prefix) or self_leaf):
            refs.append(Ref(segs, last_off))
        return i

    i = 0
    while i < len(toks):
        if toks[i][0] == ",":
            i += 1
            continue
        ni = tree(i, [])
        i = ni if ni > i else i + 1
    return refs


_QUALIFIED = re.compile(r"(?<![\w$])(crate|super|self)((?:\s*::\s*\w+)+)")


def find_refs(code: str) -> tuple[list[Ref], list[Ref]]:
    """Returns (use-statement refs, refs in expression/type position)."""
    uses: list[Ref] = []
    spans: list[tuple[int, int]] = []
    for m in _USE.finditer(code):
        semi = code.find(";", m.end())
        if semi < 0:
            continue
        uses.extend(parse_use_tree(code, m.end(), semi))
        spans.append((m.start(), semi))
    others: list[Ref] = []
    for m in _QUALIFIED.finditer(code):
        if any(a <= m.start() < b for a, b in spans):
            continue
        before = code[max(0, m.start() - 8) : m.start()]
        if re.search(r"\bin\s+$", before):
            continue  # pub(in crate::x): a visibility, not a dependency
        segs = [m.group(1)] + [s for s in re.split(r"\s*::\s*", m.group(2)) if s]
        others.append(Ref(segs, m.end()))
    return uses, others


# --------------------------------------------------------------------------
# Crates and their module graphs.
# --------------------------------------------------------------------------

_ITEM_DEF = r"\b(?:struct|enum|union|trait|type|fn|const|static|mod)\s+{name}\b|macro_rules!\s*{name}\b"


@dataclass
class Module:
    path: tuple[str, ...]  # () is the crate root
    file: str  # relative to the workspace
    code: str  # stripped code
    is_dir_module: bool  # mod.rs / lib.rs / main.rs: children live beside it
    test_children: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return "::".join(self.path) or "crate"


@dataclass
class Edge:
    locations: list[str]


def line_of(code: str, offset: int) -> int:
    return code.count("\n", 0, offset) + 1


def module_path_of(rel: str) -> tuple[str, ...] | None:
    """`foo.rs`, `foo/mod.rs` -> (foo,); `foo/bar.rs` -> (foo, bar); the
    root -> (); None for files that are their own crates (src/bin/)."""
    parts = rel.split("/")
    if parts[0] == "bin":
        return None
    if len(parts) == 1 and parts[0] in ("lib.rs", "main.rs"):
        return ()
    if parts[-1] == "mod.rs":
        return tuple(parts[:-1])
    parts[-1] = parts[-1][:-3]
    return tuple(parts)


def load_crate(ws: str, crate_dir: str) -> dict[tuple[str, ...], Module]:
    src = os.path.join(ws, crate_dir, "src")
    mods: dict[tuple[str, ...], Module] = {}
    has_lib = os.path.exists(os.path.join(src, "lib.rs"))
    for dirpath, _dirs, files in os.walk(src):
        for f in sorted(files):
            if not f.endswith(".rs"):
                continue
            full = os.path.join(dirpath, f)
            rel = os.path.relpath(full, src).replace(os.sep, "/")
            if has_lib and rel == "main.rs":
                continue  # a binary that uses the library by its crate name
            mpath = module_path_of(rel)
            if mpath is None:
                continue
            with open(full, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
            code, test_children = blank_test_items(strip_non_code(text))
            mods[mpath] = Module(
                path=mpath,
                file=os.path.relpath(full, ws).replace(os.sep, "/"),
                code=code,
                is_dir_module=f in ("mod.rs",) or mpath == (),
                test_children=test_children,
            )
    # Drop modules that exist only under #[cfg(test)] (and their children).
    test_only = {m.path + (c,) for m in mods.values() for c in m.test_children}
    return {
        p: m for p, m in mods.items() if not any(p[: len(t)] == t for t in test_only)
    }


class Resolver:
    """Turns the segments of a path seen in one module into a module path."""

    def __init__(self, mods: dict[tuple[str, ...], Module]):
        self.mods = mods
        self.root = mods.get(())
        self.root_names: dict[str, tuple[str, ...]] = {}
        self.root_globs: list[tuple[str, ...]] = []
        if self.root is not None:
            uses, _ = find_refs(self.root.code)
            for ref in uses:
                segs = ref.segments
                if segs and segs[0] in ("crate", "self"):
                    segs = segs[1:]
                target = self.longest_module(segs)
                if not target:
                    continue  # an external crate or a root item
                if ref.glob:
                    if tuple(segs) == target:
                        self.root_globs.append(target)
                    continue
                name = ref.alias or segs[-1]
                self.root_names.setdefault(name, target)

    def longest_module(self, segs: list[str]) -> tuple[str, ...]:
        for k in range(len(segs), 0, -1):
            if tuple(segs[:k]) in self.mods:
                return tuple(segs[:k])
        return ()

    def root_item(self, name: str) -> tuple[str, ...] | None:
        """The module defining a name re-exported by the crate root."""
        if name in self.root_names:
            return self.root_names[name]
        pat = re.compile(_ITEM_DEF.format(name=re.escape(name)))
        for g in self.root_globs:
            if pat.search(self.mods[g].code):
                return g
        return None

    def resolve(self, here: Module, segs: list[str]) -> tuple[str, ...] | None:
        """The module `segs` (as written in `here`) refers to, or None when
        it is the crate root, an external crate or not resolvable."""
        if not segs:
            return None
        head = segs[0]
        if head == "crate":
            absolute = segs[1:]
        elif head in ("super", "self"):
            base = list(here.path)
            rest = list(segs)
            if rest[0] == "self":
                rest = rest[1:]
            while rest and rest[0] == "super":
                if not base:
                    return None
                base.pop()
                rest = rest[1:]
            while rest and rest[0] == "self":
                rest = rest[1:]
            absolute = base + rest
        elif here.path == ():
            absolute = segs  # the root names its children directly
        else:
            return None  # an external crate (or a name in local scope)
        target = self.longest_module(absolute)
        if target:
            return target
        if absolute:
            return self.root_item(absolute[0])
        return None


def related(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """Whether one module is an ancestor of (or the same as) the other."""
    k = min(len(a), len(b))
    return a[:k] == b[:k]


def build_graph(
    mods: dict[tuple[str, ...], Module],
) -> dict[tuple[str, ...], dict[tuple[str, ...], Edge]]:
    res = Resolver(mods)
    graph: dict[tuple[str, ...], dict[tuple[str, ...], Edge]] = {
        p: {} for p in mods if p != ()
    }
    for p, m in mods.items():
        if p == ():
            continue
        uses, others = find_refs(m.code)
        for ref in uses + others:
            t = res.resolve(m, ref.segments)
            if t is None or t == () or related(p, t):
                continue
            loc = f"{m.file}:{line_of(m.code, ref.offset)}"
            edge = graph[p].setdefault(t, Edge([]))
            if loc not in edge.locations:
                edge.locations.append(loc)
    for edges in graph.values():
        for edge in edges.values():
            # The first line of a file first, whichever pass found it.
            edge.locations.sort(key=lambda s: (s.rsplit(":", 1)[0], int(s.rsplit(":", 1)[1])))
    return graph


def sccs(graph: dict) -> list[list]:
    """Tarjan's strongly connected components (iterative)."""
    index: dict = {}
    low: dict = {}
    on: set = set()
    stack: list = []
    out: list[list] = []
    counter = 0
    for v0 in sorted(graph):
        if v0 in index:
            continue
        work = [(v0, iter(sorted(graph[v0])))]
        index[v0] = low[v0] = counter
        counter += 1
        stack.append(v0)
        on.add(v0)
        while work:
            v, it = work[-1]
            pushed = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    pushed = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if pushed:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


MAX_CYCLES_PER_SCC = 200


def elementary_cycles(graph: dict, comp: list) -> tuple[list[list], bool]:
    """Every simple cycle inside one component, each starting at its
    smallest module, shortest first; True if the list was cut short."""
    members = set(comp)
    cycles: list[list] = []
    cut = False
    for start in comp:
        # Cycles whose smallest node is `start`: search among larger nodes.
        allowed = {v for v in members if v >= start}
        path = [start]
        stack = [iter(sorted(w for w in graph[start] if w in allowed))]
        on_path = {start}
        while stack:
            if len(cycles) >= MAX_CYCLES_PER_SCC:
                cut = True
                break
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                on_path.discard(path.pop())
                continue
            if nxt == start:
                cycles.append(path + [start])
            elif nxt not in on_path:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(w for w in graph[nxt] if w in allowed)))
    cycles.sort(key=lambda c: (len(c), c))
    return cycles, cut


def workspace_crates(ws: str) -> list[str]:
    with open(os.path.join(ws, "Cargo.toml"), "rb") as fh:
        manifest = tomllib.load(fh)
    members = manifest.get("workspace", {}).get("members", [])
    crates: list[str] = []
    for pattern in members:
        for d in sorted(glob.glob(os.path.join(ws, pattern))):
            if os.path.isdir(os.path.join(d, "src")):
                crates.append(os.path.relpath(d, ws).replace(os.sep, "/"))
    return crates


@dataclass
class Report:
    lines: list[str]
    cycles: int
    modules: int
    crates: int


def check(ws: str, verbose: bool = False) -> Report:
    lines: list[str] = []
    n_cycles = n_mods = 0
    crates = workspace_crates(ws)
    for crate in crates:
        mods = load_crate(ws, crate)
        graph = build_graph(mods)
        n_mods += len(graph)
        name = lambda p: "::".join(p)  # noqa: E731
        if verbose:
            for a in sorted(graph):
                for b in sorted(graph[a]):
                    lines.append(
                        f"  {crate}: {name(a)} -> {name(b)} ({graph[a][b].locations[0]})"
                    )
        for comp in sccs(graph):
            if len(comp) < 2:
                continue
            cycles, cut = elementary_cycles(graph, comp)
            for cyc in cycles:
                n_cycles += 1
                lines.append(f"{crate}: " + " -> ".join(name(p) for p in cyc))
                for a, b in zip(cyc, cyc[1:]):
                    locs = graph[a][b].locations
                    more = f" (+{len(locs) - 1} more)" if len(locs) > 1 else ""
                    lines.append(f"    {name(a)} -> {name(b)}: {locs[0]}{more}")
            if cut:
                lines.append(
                    f"{crate}: ... more cycles among {', '.join(name(p) for p in comp)} "
                    f"(listed the first {MAX_CYCLES_PER_SCC})"
                )
    return Report(lines, n_cycles, n_mods, len(crates))


# --------------------------------------------------------------------------
# Self-test on fixture trees.
# --------------------------------------------------------------------------


def _write_tree(root: str, files: dict[str, str]) -> None:
    for rel, text in files.items():
        full = os.path.join(root, rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as fh:
            fh.write(text)


def _fixture(files: dict[str, str]) -> Report:
    """Runs the check on a one-crate workspace `k` holding `files` (paths
    relative to k/src)."""
    with tempfile.TemporaryDirectory(prefix="check-cycles-") as ws:
        tree = {"Cargo.toml": '[workspace]\nmembers = ["k"]\n'}
        tree.update({f"k/src/{p}": t for p, t in files.items()})
        _write_tree(ws, tree)
        return check(ws)


def self_test() -> int:
    failures: list[str] = []

    def expect(name: str, report: Report, cycles: list[str], modules: int | None = None):
        got = [ln for ln in report.lines if not ln.startswith("    ")]
        want = [f"k: {c}" for c in cycles]
        if got != want:
            failures.append(f"{name}: expected cycles {want}, got {got}")
        if modules is not None and report.modules != modules:
            failures.append(f"{name}: expected {modules} modules, got {report.modules}")

    # A use in one direction, a qualified call in the other: a 2-cycle,
    # reported with the line of each edge.
    r = _fixture(
        {
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "//! a\nuse crate::b::thing;\npub fn f() {}\n",
            "b.rs": "//! b\n\npub fn thing() {\n    crate::a::f();\n}\n",
        }
    )
    expect("two-cycle", r, ["a -> b -> a"], modules=2)
    if "    a -> b: k/src/a.rs:2" not in r.lines or "    b -> a: k/src/b.rs:4" not in r.lines:
        failures.append(f"two-cycle: edge locations missing in {r.lines}")

    # Nested braces, super:: to a sibling, three modules in one cycle.
    r = _fixture(
        {
            "main.rs": "mod x;\nmod y;\nmod z;\n",
            "x.rs": "use crate::{q::{w}, y};\n",
            "y.rs": "use super::z::Z;\n",
            "z.rs": "pub struct Z;\nfn g() { let _ = crate::x::h; }\n",
        }
    )
    expect("three-cycle", r, ["x -> y -> z -> x"])

    # A parent and its child use each other: not a cycle; nor is a
    # grandchild reaching up with super::super.
    r = _fixture(
        {
            "lib.rs": "pub mod p;\n",
            "p/mod.rs": "mod c;\nuse self::c::C;\npub use crate::p::c::D;\npub struct P;\n",
            "p/c.rs": "mod g;\nuse super::P;\npub struct C;\npub struct D;\n",
            "p/c/g.rs": "use super::super::P;\nuse crate::p::c::C;\n",
        }
    )
    expect("parent-child", r, [], modules=3)

    # References in #[cfg(test)] items, comments and strings do not count.
    r = _fixture(
        {
            "lib.rs": "mod a;\nmod b;\n",
            "a.rs": "use crate::b::B;\n",
            "b.rs": (
                "pub struct B;\n"
                "// use crate::a;\n"
                "/* crate::a::f() /* nested */ crate::a::g() */\n"
                "const S: &str = \"crate::a::f()\";\n"
                "const R: &str = r#\"use crate::a;\"#;\n"
                "fn lt<'a>(x: &'a str) -> char { let _ = x; '\"' }\n"
                "#[cfg(test)]\nfn helper() { crate::a::f(); }\n"
                "#[cfg(test)]\nmod tests {\n    use crate::a::f;\n    fn t() { f() }\n}\n"
                "#[cfg(test)]\nmod more;\n"
            ),
            "b/more.rs": "use crate::a::f;\n",
        }
    )
    expect("test-only", r, [], modules=2)

    # An item re-exported by the root resolves to the module defining it,
    # by name and through a glob; a root-defined item is ignored.
    r = _fixture(
        {
            "lib.rs": "mod a;\nmod b;\nmod c;\npub use a::{Thing as Alias};\npub use c::*;\npub fn root_fn() {}\n",
            "a.rs": "pub struct Thing;\nuse crate::root_fn;\nfn f() { crate::b::g(); }\n",
            "b.rs": "use crate::Alias;\npub fn g() {}\n",
            "c.rs": "pub fn from_glob() { crate::b::g(); }\n",
        }
    )
    expect("root-reexport", r, ["a -> b -> a"])
    r = _fixture(
        {
            "lib.rs": "mod b;\nmod c;\npub use c::*;\n",
            "b.rs": "use crate::{from_glob};\npub fn g() {}\n",
            "c.rs": "pub fn from_glob() { crate::b::g(); }\n",
        }
    )
    expect("root-glob", r, ["b -> c -> b"])

    if failures:
        for f in failures:
            print(f"self-test FAILED: {f}", file=sys.stderr)
        return 1
    print("check-cycles self-test: ok (6 fixtures)")
    return 0


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=os.path.dirname(here), help="workspace directory")
    ap.add_argument("--self-test", action="store_true", help="check the checker on fixtures")
    ap.add_argument("-v", "--verbose", action="store_true", help="also list every edge")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    try:
        report = check(args.root, args.verbose)
    except (OSError, tomllib.TOMLDecodeError) as e:
        print(f"check-cycles: {e}", file=sys.stderr)
        return 2
    for ln in report.lines:
        print(ln)
    if report.cycles:
        print(
            f"{report.cycles} import cycle(s) in {report.modules} modules of "
            f"{report.crates} crates: make the imports point one way (move the shared "
            "piece down into a module both can use)"
        )
        return 1
    print(f"no import cycles in {report.modules} modules of {report.crates} crates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
