#!/usr/bin/env python3
"""Check the engine's layout rules (docs/architecture.md, "Map: which file owns which rule").

  python3 scripts/check_layout.py [engine/src] [--write-allowed]

1. No glob import of a parent (`use super::*`) outside test modules.
2. A type's inherent `impl` blocks are in the file that defines the type; a trait impl is in the
   file of the type or of the trait.
3. Within each folder, the files, mod.rs among them, import each other without a cycle: they form
   layers. A file that uses an item of mod.rs (`use super::SegmentLog`) imports mod.rs, and mod.rs
   imports every file whose items it names (`write::put_many`, `pub use self::read::StoredValue`).
4. No function is longer than 70 lines.
5. No struct field is visible outside its file (`pub(super)`, `pub(crate)`, `pub(in ..)`): a type's
   state is read and changed through the methods of its own file. (A type of the public API may
   have `pub` fields: options and reports are plain data.)

Rules 3 to 5 are new to code that predates them: what breaks them today is listed, with its size,
in scripts/layout-allowed.txt, and the check fails on anything not listed there, on anything that
grew, and on a listed entry that shrank or went (so the list only ever gets shorter and stays
true). `--write-allowed` rewrites the list from the tree. Test modules (from a file's first
`#[cfg(test)]` or `#[cfg(all(test, ..))]` on) are not checked. Prints each violation and exits 1
if there is any.
"""

import collections
import pathlib
import re
import sys

ITEM = re.compile(r"^\s*(?:pub(?:\([\w:]+\))? )?(?:struct|enum|trait|union|type) (\w+)", re.M)
IMPL = re.compile(r"^\s*impl\b(?:<[^{]*?>)?\s+(?:([\w:]+)(?:<[^{]*?>)?\s+for\s+)?(?:[\w:]+::)?(\w+)[^{;]*\{", re.M)
FN = re.compile(r"^[ \t]*(?:pub(?:\([^)]*\))? )?(?:(?:const|async|unsafe|extern \"C\") )*fn (\w+)", re.M)
STRUCT = re.compile(r"^[ \t]*(?:pub(?:\([^)]*\))? )?struct (\w+)[^;{(]*([{(])", re.M)
RESTRICTED = re.compile(r"(?:^[ \t]*|[,(]\s*)pub\((?:super|crate|in [^)]*)\)\s+(?:\w+\s*:)?", re.M)
MAX_FN_LINES = 70
ALLOWED = pathlib.Path(__file__).with_name("layout-allowed.txt")


def source(path):
    text = path.read_text()
    test = re.search(r"^#\[cfg\((?:all\()?test\b", text, re.M)
    return text if test is None else text[: test.start()]


def blank_literals(text):
    """`text` with the insides of comments, strings and char literals blanked (newlines kept), so
    that braces are counted only where they are code."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            hashes = re.match(r"r(#*)\"", text[i:]).group(1)
            end = text.find('"' + hashes, i + 2 + len(hashes))
            j = n if end < 0 else end + 1 + len(hashes)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append('"' + re.sub(r"[^\n]", " ", text[i + 1 : j]) + '"')
            i = j + 1
        elif c == "'":
            m = re.match(r"'(?:\\[^']+|[^\\'])'", text[i:])
            if m:
                out.append(" " * len(m.group(0)))
                i += len(m.group(0))
            else:  # a lifetime
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching(code, open_at):
    """The index of the bracket closing the one at `open_at`."""
    pairs = {"{": "}", "(": ")"}
    o, c = code[open_at], pairs[code[open_at]]
    depth = 0
    for j in range(open_at, len(code)):
        if code[j] == o:
            depth += 1
        elif code[j] == c:
            depth -= 1
            if depth == 0:
                return j
    return len(code) - 1


def long_functions(code):
    """(name, lines) of each function with a body longer than MAX_FN_LINES lines."""
    found = []
    for m in FN.finditer(code):
        brace, semi = code.find("{", m.end()), code.find(";", m.end())
        if brace < 0 or (0 <= semi < brace):
            continue  # a declaration without a body
        lines = code.count("\n", m.start(), matching(code, brace)) + 1
        if lines > MAX_FN_LINES:
            found.append((m.group(1), lines))
    return found


def open_fields(code):
    """(struct, count) of each struct with fields visible outside its file."""
    found = []
    for m in STRUCT.finditer(code):
        open_at = m.end() - 1
        body = code[open_at : matching(code, open_at) + 1]
        count = len(RESTRICTED.findall(body))
        if count:
            found.append((m.group(1), count))
    return found


def cycles(deps):
    """Strongly connected components of more than one file (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(deps[v]):
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
                found.append(sorted(comp))

    for v in sorted(deps):
        if v not in index:
            visit(v)
    return found


def super_paths(code):
    """The first segment of every path through `super::`, group imports (`use super::{a::b, C}`)
    taken apart."""
    names = []
    for m in re.finditer(r"\bsuper::", code):
        rest = code[m.end() :]
        if rest.startswith("{"):
            group = rest[1 : matching(rest, 0)]
            depth, part = 0, ""
            for ch in group + ",":
                if ch == "," and depth == 0:
                    names.append(re.match(r"\s*(\w*)", part).group(1))
                    part = ""
                    continue
                depth += ch == "{"
                depth -= ch == "}"
                part += ch
        else:
            w = re.match(r"\w+", rest)
            if w:
                names.append(w.group(0))
    return [n for n in names if n and n != "self"]


def folder_deps(folder, files, codes):
    """Which file of `folder` imports which (mod.rs as "mod")."""
    siblings = {f.stem: f for f in files if f.parent == folder and f.name != "mod.rs"}
    deps = {name: set() for name in siblings}
    deps["mod"] = set()
    for name, f in siblings.items():
        for used in super_paths(codes[f]):
            if used == "super":
                continue
            deps[name].add(used if used in siblings else "mod")
        deps[name].discard(name)
    mod_code = re.sub(r"^\s*(?:pub(?:\([^)]*\))? )?mod \w+;", "", codes[folder / "mod.rs"], flags=re.M)
    for name in siblings:
        if re.search(rf"(?<![\w:])(?:self::)?{name}::", mod_code):
            deps["mod"].add(name)
    return deps


def main(root, write_allowed=False):
    root = pathlib.Path(root)
    files = sorted(root.rglob("*.rs"))
    texts = {f: source(f) for f in files}
    codes = {f: blank_literals(t) for f, t in texts.items()}
    defined = collections.defaultdict(set)
    for f, text in texts.items():
        for name in ITEM.findall(text):
            defined[name].add(f)
    problems = []
    measured = {}  # rules 3 to 5: entry -> size
    for f, text in texts.items():
        rel = f.relative_to(root)
        if re.search(r"^\s*use super::\*;", text, re.M):
            problems.append(f"{rel}: `use super::*` outside a test module")
        for trait, ty in IMPL.findall(text):
            trait = trait.split("::")[-1]
            homes = defined.get(ty)
            if not homes or f in homes:
                continue
            if trait and f in defined.get(trait, ()):
                continue
            what = f"impl {trait} for {ty}" if trait else f"impl {ty}"
            problems.append(f"{rel}: {what}, a type defined in {', '.join(str(h.relative_to(root)) for h in homes)}")
        for name, lines in long_functions(codes[f]):
            measured[f"long-fn {rel} {name}"] = lines
        for name, count in open_fields(codes[f]):
            measured[f"open-fields {rel} {name}"] = count
    for folder in sorted({f.parent for f in files if f.name == "mod.rs"}):
        deps = folder_deps(folder, files, codes)
        rel = folder.relative_to(root)
        for comp in cycles(deps):
            if "mod" not in comp:
                problems.append(f"{rel}/: files import each other in a cycle: {', '.join(comp)}")
            else:
                # The files that import mod.rs and are imported by it, directly or not.
                measured[f"mod-cycle {rel}/"] = len(comp) - 1
    allowed = {}
    if ALLOWED.exists():
        for line in ALLOWED.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                entry, size = line.rsplit(" ", 1)
                allowed[entry] = int(size)
    if write_allowed:
        head = [l for l in ALLOWED.read_text().splitlines() if l.startswith("#")] if ALLOWED.exists() else []
        body = [f"{e} {n}" for e, n in sorted(measured.items())]
        ALLOWED.write_text("\n".join(head + body) + "\n")
        allowed = dict(measured)
    for entry, size in sorted(measured.items()):
        if entry not in allowed:
            problems.append(f"{entry}: {size} (not in {ALLOWED.name}: fix it)")
        elif size > allowed[entry]:
            problems.append(f"{entry}: {size}, up from {allowed[entry]} ({ALLOWED.name})")
        elif size < allowed[entry]:
            problems.append(f"{entry}: {size}, down from {allowed[entry]}: lower it in {ALLOWED.name}")
    for entry in sorted(set(allowed) - set(measured)):
        problems.append(f"{entry}: fixed, take it out of {ALLOWED.name}")
    for p in problems:
        print(p)
    kinds = collections.Counter(e.split(" ", 1)[0] for e in measured)
    fields = sum(n for e, n in measured.items() if e.startswith("open-fields"))
    print(
        f"layout: {len(files)} files, {len(problems)} problems; still allowed: {kinds['long-fn']} functions over "
        f"{MAX_FN_LINES} lines, {fields} fields open outside their file in {kinds['open-fields']} structs, "
        f"{kinds['mod-cycle']} folders whose mod.rs is in a cycle"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    sys.exit(main(args[0] if args else "engine/src", "--write-allowed" in sys.argv))
