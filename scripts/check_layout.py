#!/usr/bin/env python3
"""Check the engine's layout rules (docs/architecture.md, "Map: which file owns which rule").

  python3 scripts/check_layout.py [engine/src]

1. No glob import of a parent (`use super::*`) outside test modules.
2. A type's inherent `impl` blocks are in the file that defines the type; a trait impl is in the
   file of the type or of the trait.
3. Within each folder, the files other than mod.rs import each other (`super::<file>::`) without
   a cycle: they form layers.

Test modules (from a file's first `#[cfg(test)]` or `#[cfg(all(test, ..))]` on) are not checked. Prints each violation and
exits 1 if there is any.
"""

import collections
import pathlib
import re
import sys

ITEM = re.compile(r"^\s*(?:pub(?:\([\w:]+\))? )?(?:struct|enum|trait|union|type) (\w+)", re.M)
IMPL = re.compile(r"^\s*impl\b(?:<[^{]*?>)?\s+(?:([\w:]+)(?:<[^{]*?>)?\s+for\s+)?(?:[\w:]+::)?(\w+)[^{;]*\{", re.M)


def source(path):
    text = path.read_text()
    test = re.search(r"^#\[cfg\((?:all\()?test\b", text, re.M)
    return text if test is None else text[: test.start()]


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


def main(root):
    root = pathlib.Path(root)
    files = sorted(root.rglob("*.rs"))
    texts = {f: source(f) for f in files}
    defined = collections.defaultdict(set)
    for f, text in texts.items():
        for name in ITEM.findall(text):
            defined[name].add(f)
    problems = []
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
    for folder in sorted({f.parent for f in files if f.name == "mod.rs"}):
        siblings = {f.stem: f for f in files if f.parent == folder and f.name != "mod.rs"}
        deps = {name: set() for name in siblings}
        for name, f in siblings.items():
            for used in re.findall(r"\bsuper::(\w+)::", texts[f]):
                if used in siblings and used != name:
                    deps[name].add(used)
        for comp in cycles(deps):
            problems.append(f"{folder.relative_to(root)}/: files import each other in a cycle: {', '.join(comp)}")
    for p in problems:
        print(p)
    print(f"layout: {len(files)} files, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "engine/src"))
