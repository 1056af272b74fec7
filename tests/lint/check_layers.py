#!/usr/bin/env python3
"""Checks that includes follow the layers (docs/architecture.md).

The layers, lowest first: io, proto, block, copy, job, export, qmp, cli.
A layer's public headers are include/<layer>/vblk/*.h, its private files
src/<layer>/. A file may include its own layer's files and the public
headers of the layers below it; the build enforces the same (each layer is a
library that sees only those), this check says which line breaks it:

  - an upward include: a file includes a header of a layer above its own;
  - a private include: a file includes another layer's src/ header (the
    listed exceptions aside, which the driver registry is to remove).

Usage: check_layers.py [ROOT]  (exit status 1 and one line per finding).
"""
import os
import re
import sys

LAYERS = ["io", "proto", "block", "copy", "job", "export", "qmp", "cli"]
RANK = {name: i for i, name in enumerate(LAYERS)}

# (including file, included header) pairs allowed across the rule, each with
# its reason; none since image creation goes through the driver registry.
EXCEPTIONS = set()

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_of(path):
    """The layer a repository path belongs to, or None (tests, fuzz...)."""
    parts = path.split("/")
    if len(parts) >= 3 and parts[0] in ("src", "include") and parts[1] in RANK:
        return parts[1]
    return None


def resolve(root, path, name, public_roots):
    """Where `#include "name"` in `path` finds its file (repository path),
    searched as the compiler does: next to the file, then the file's own
    private folder, then every public root; None for a system header."""
    here = os.path.dirname(path)
    layer = layer_of(path)
    candidates = [os.path.join(here, name)]
    if layer:
        candidates.append(os.path.join("src", layer, name))
    candidates += [os.path.join(r, name) for r in public_roots]
    # Last, every layer's private folder: found only there, the include
    # compiles only through an include path the layer should not have.
    candidates += [os.path.join("src", other, name) for other in LAYERS]
    for c in candidates:
        c = os.path.normpath(c)
        if os.path.isfile(os.path.join(root, c)):
            return c
    return None


def check(root):
    public_roots = [os.path.join("include", name) for name in LAYERS]
    findings = []
    excepted = set()
    for top in ("src", "include"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if not f.endswith((".cc", ".h")):
                    continue
                path = os.path.relpath(os.path.join(dirpath, f), root)
                mine = layer_of(path)
                if mine is None:
                    findings.append(f"{path}: not in a layer's folder ({', '.join(LAYERS)})")
                    continue
                text = open(os.path.join(root, path), encoding="utf-8", errors="replace").read()
                for m in INCLUDE.finditer(text):
                    line = text.count("\n", 0, m.start()) + 1
                    target = resolve(root, path, m.group(1), public_roots)
                    if target is None:
                        continue
                    theirs = layer_of(target)
                    if theirs is None:
                        findings.append(f"{path}:{line}: includes {target}, outside every layer")
                    elif RANK[theirs] > RANK[mine]:
                        findings.append(f"{path}:{line}: upward include: {mine} includes {target} ({theirs})")
                    elif theirs != mine and target.startswith("src/") and (path, target) in EXCEPTIONS:
                        excepted.add((path, target))
                    elif theirs != mine and target.startswith("src/"):
                        findings.append(f"{path}:{line}: private include: {mine} includes {target}, "
                                        f"private to {theirs} (only include/{theirs}/ is its interface)")
    for path, target in sorted(EXCEPTIONS - excepted):
        findings.append(f"{path}: no longer includes {target}: take it off EXCEPTIONS")
    return findings


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    findings = check(os.path.abspath(root))
    for f in findings:
        print(f)
    if findings:
        print(f"check_layers: {len(findings)} include(s) break the layers", file=sys.stderr)
        return 1
    print("check_layers: every include follows the layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
