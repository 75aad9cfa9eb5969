#!/usr/bin/env bash
# The layer check (ARCHITECTURE.md, "Layers"). Fails when
#   1. a crate depends on a crate above it (ivm-core < ivm-engine < ivm-std < ivm-graph
#      < ivm-device < ivm-ccl), or ivm-burn (top level) names an ivm crate but ivm-std;
#   2. ivm-core or ivm-engine uses `std` outside cfg(test|loom): they must build for a
#      target that has no `std`, and `extern crate std` may appear only under such a cfg;
#   3. a crate other than ivm-core keeps a list implementation of its own (a type with both
#      `prev` and `next` link fields);
#   4. inside ivm-std, a module in a layer folder imports from a folder of a higher layer
#      (util < device < model < engine < runtime < doors), or the modules that sit in
#      import cycles (imports between a module and its parent or children included)
#      grow beyond the recorded bound (.ci/layers-cycle-bound; lower it when a change
#      breaks a cycle). Every cycle is printed.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "--- 1. crate dependencies point down"
python3 - <<'EOF'
import re, sys
order = ["ivm-core", "ivm-engine", "ivm-std", "ivm-graph", "ivm-device", "ivm-ccl"]
bad = []
for i, crate in enumerate(order):
    text = open(f"crates/{crate}/Cargo.toml").read()
    # `name = ...` and `name.workspace = true` both name a sibling. Only [dependencies] /
    # [target.*.dependencies] / [features] may name one; a dev-dependency on a higher
    # crate would still be a cycle for tests, so check all.
    for other in order[i + 1:]:
        if re.search(rf'^\s*{re.escape(other)}\s*[.=]', text, re.M) or f'"{other}/' in text:
            bad.append(f"{crate} depends on {other}, a crate above it")
# ivm-burn is a top-level crate over ivm-std's public API: it names no other ivm crate,
# and no ivm crate names it.
burn = open("crates/ivm-burn/Cargo.toml").read()
for other in order + ["ivm"]:
    if other != "ivm-std" and re.search(rf'^\s*{re.escape(other)}\s*[.=]', burn, re.M):
        bad.append(f"ivm-burn depends on {other} (only ivm-std's public API)")
for crate in order:
    if re.search(r'^\s*ivm-burn\s*[.=]', open(f"crates/{crate}/Cargo.toml").read(), re.M):
        bad.append(f"{crate} depends on ivm-burn, a top-level crate")
for b in bad:
    print("layers:", b, file=sys.stderr)
sys.exit(1 if bad else 0)
EOF

echo "--- 2. ivm-core and ivm-engine build without std"
python3 - <<'EOF'
import os, re, sys
bad = []
for crate in ["ivm-core", "ivm-engine"]:
    for root, _, files in os.walk(f"crates/{crate}/src"):
        for f in files:
            if not f.endswith(".rs"):
                continue
            p = os.path.join(root, f)
            lines = open(p).read().splitlines()
            for n, line in enumerate(lines):
                if re.match(r"\s*extern crate std\b", line):
                    prev = lines[n - 1] if n else ""
                    if not re.search(r"cfg\(.*\b(test|loom)\b", prev):
                        bad.append(f"{p}:{n + 1}: `extern crate std` outside cfg(test|loom)")
for b in bad:
    print("layers:", b, file=sys.stderr)
sys.exit(1 if bad else 0)
EOF
cargo build --quiet -p ivm-core -p ivm-engine --target thumbv7em-none-eabihf

echo "--- 3. one list implementation (ivm-core's)"
python3 - <<'EOF'
import os, re, sys
bad = []
for crate in os.listdir("crates"):
    if crate == "ivm-core":
        continue
    for root, _, files in os.walk(f"crates/{crate}/src"):
        for f in files:
            if f.endswith(".rs"):
                p = os.path.join(root, f)
                s = open(p).read()
                field = r"^\s*(pub(\([a-z]+\))?\s+)?{}\s*:"
                if re.search(field.format("prev"), s, re.M) and re.search(field.format("next"), s, re.M):
                    bad.append(f"{p}: a type with `prev` and `next` fields (use ivm_core::list)")
for b in bad:
    print("layers:", b, file=sys.stderr)
sys.exit(1 if bad else 0)
EOF

echo "--- 4. ivm-std: imports point down, the cycles do not grow"
python3 - <<'EOF'
import os, re, sys
src = "crates/ivm-std/src"
layers = ["util", "device", "model", "engine", "runtime", "doors"]
mods = {}
for root, _, files in os.walk(src):
    for f in files:
        if f.endswith(".rs"):
            p = os.path.relpath(os.path.join(root, f), src)
            m = p[:-3]
            if m.endswith("/mod"):
                m = m[:-4]
            if f == "tests.rs" or "tests" in m.split("/")[:-1]:
                continue  # a test module (and its children) may use any layer, as integration tests do
            # Code only: comments and doc comments may name any module, and so may an
            # inline test module (by convention the last item of its file).
            # Any `#[cfg(...test...)]` module (`cfg(test)`, `cfg(all(test, loom))`) is a test.
            lines = open(os.path.join(root, f)).read().splitlines()
            for n, l in enumerate(lines):
                if re.match(r"\s*#\[cfg\(.*\btest\b.*\)\]\s*$", l) and n + 1 < len(lines) and re.match(r"\s*(pub(\([a-z]+\))?\s+)?mod \w+\s*\{", lines[n + 1]):
                    lines = lines[:n]
                    break
            mods[m] = "\n".join(l for l in lines if not l.lstrip().startswith("//"))

def resolve(m, parts):
    """The longest module path that `parts` (after crate:: or super::) names."""
    for k in range(len(parts), 0, -1):
        cand = "/".join(parts[:k])
        if cand in mods:
            return cand
    return None

def paths(code, root):
    """Every path `root::a::b` names, with `use root::{a::b, c::{d, e}}` groups expanded."""
    out = []
    def expand(prefix, text, i):
        # text[i] is just past a `{`; returns the index past the matching `}`.
        item = ""
        while i < len(text):
            c = text[i]
            if c == "{":
                i = expand(prefix + [p for p in item.strip().strip(":").split("::") if p], text, i + 1)
                item = ""
                continue
            if c in ",}":
                parts = [p for p in item.strip().split("::") if p]
                if parts:
                    out.append(prefix + parts)
                item = ""
                if c == "}":
                    return i + 1
            else:
                item += c
            i += 1
        return i
    for mt in re.finditer(r"\b" + root + r"((?:::[a-z_][a-z0-9_]*)*)::(\{)?", code):
        head = [p for p in mt.group(1).split("::") if p]
        if mt.group(2):
            expand(head, code, mt.end())
        else:
            rest = re.match(r"[A-Za-z_][A-Za-z0-9_]*", code[mt.end():])
            out.append(head + ([rest.group(0)] if rest else []))
    return out

# Names the crate root re-exports (`pub use engine::tensor::Tensor;`): `crate::Tensor` is
# an import of the module that defines it.
reexports = {}
for mt in re.finditer(r"^pub use ([a-z_][a-z0-9_:]*)::(\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*);", mods.get("lib", ""), re.M):
    target = mt.group(1).split("::")
    names = [n.strip().split(" as ")[-1] for n in mt.group(2).strip("{}").split(",") if n.strip()]
    for n in names:
        t = resolve("lib", target + [n]) or resolve("lib", target)
        if t:
            reexports[n] = t

graph = {m: set() for m in mods}
for m, code in mods.items():
    for parts in paths(code, "crate"):
        t = resolve(m, parts)
        if t is None and parts and parts[0] in reexports:
            t = reexports[parts[0]]
        # Imports between a module and its own parent or children count too: a cycle
        # through a parent is a cycle.
        if t and t != m:
            graph[m].add(t)
    base = m.rsplit("/", 1)[0] if "/" in m else ""
    for parts in paths(code, "super"):
        t = resolve(m, ([base] if base else []) + parts) or (base or None)
        if t and t != m:
            graph[m].add(t)
    for parts in paths(code, "self"):
        t = resolve(m, ([m] if m != "lib" else []) + parts)
        if t and t != m:
            graph[m].add(t)
if os.environ.get("LAYERS_GRAPH"):
    for m in sorted(graph):
        print(f"  {m} -> {' '.join(sorted(graph[m]))}")

bad = []
def layer(m):
    # A layer is a folder (`src/engine/`): a flat file of the same name is not in it.
    top = m.split("/")[0]
    folder = os.path.isdir(os.path.join(src, top))
    return layers.index(top) if top in layers and folder else None
for m, targets in graph.items():
    for t in targets:
        lm, lt = layer(m), layer(t)
        if lm is not None and (lt is None or lt > lm) and not t.startswith(m.split("/")[0] + "/"):
            bad.append(f"{m} (layer {layers[lm]}) imports {t}, from a layer above it")

# Tarjan's strongly connected components.
index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]
sys.setrecursionlimit(10000)
def visit(v):
    index[v] = low[v] = counter[0]; counter[0] += 1
    stack.append(v); on.add(v)
    for w in graph[v]:
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v:
                break
        sccs.append(sorted(comp))
for v in sorted(graph):
    if v not in index:
        visit(v)
cycles = sorted((c for c in sccs if len(c) > 1), key=len, reverse=True)
in_cycles = sum(len(c) for c in cycles)
bound = int(open(".ci/layers-cycle-bound").read().split()[0])
print(f"ivm-std: {len(mods)} modules; {len(cycles)} import cycle(s), {in_cycles} modules in them (bound {bound})")
for c in cycles:
    print(f"  {len(c)}: " + " ".join(c))
if in_cycles > bound:
    bad.append(f"the modules in import cycles grew to {in_cycles} (bound {bound})")
for b in bad:
    print("layers:", b, file=sys.stderr)
sys.exit(1 if bad else 0)
EOF
echo "layers: ok"
