#!/usr/bin/env python3
"""Build the default calibration corpus for `dejavu calibrate` from text already installed on a
machine that has Python 3 (and, where present, Debian's package documentation):

- source code: modules of the Python standard library (code, comments and docstrings);
- technical prose: README and changelog files of installed Debian packages (/usr/share/doc);
- reference prose: the help text of standard-library modules as `pydoc` renders it.

Documents are chosen deterministically (sorted paths, every k-th file) so that the corpus is the
same on machines with the same packages. None of it is the evaluation text of the project.

Usage: calibration_text.py [MAX_CHARS]   (default 120000). Writes documents to stdout, separated by
a line holding only the ASCII record separator (0x1e), each preceded by a `# source:` line.
"""
import gzip
import io
import os
import pydoc
import sys
import sysconfig

SEP = "\n\x1e\n"


def stdlib_sources(budget):
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(
        os.path.join(root, f)
        for f in os.listdir(root)
        if f.endswith(".py") and not f.startswith("_")
    )
    step = max(1, len(files) // 40)
    out, used = [], 0
    for path in files[::step]:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError):
            continue
        # A window from the middle of the module: past the license header and imports.
        start = len(text) // 3
        piece = text[start : start + 4000]
        out.append(("python stdlib " + os.path.basename(path), piece))
        used += len(piece)
        if used >= budget:
            break
    return out


def debian_docs(budget):
    root = "/usr/share/doc"
    if not os.path.isdir(root):
        return []
    out, used = [], 0
    for pkg in sorted(os.listdir(root)):
        d = os.path.join(root, pkg)
        if not os.path.isdir(d):
            continue
        for name in sorted(os.listdir(d)):
            low = name.lower()
            if not (low.startswith("readme") or low.startswith("changelog") or low.startswith("news")):
                continue
            path = os.path.join(d, name)
            try:
                if name.endswith(".gz"):
                    with gzip.open(path, "rt", encoding="utf-8") as fh:
                        text = fh.read(6000)
                else:
                    with open(path, encoding="utf-8") as fh:
                        text = fh.read(6000)
            except (OSError, UnicodeDecodeError, EOFError):
                continue
            if len(text) < 800:
                continue
            out.append(("debian doc " + pkg + "/" + name, text[:3000]))
            used += min(len(text), 3000)
            break
        if used >= budget:
            break
    return out


def pydoc_text(budget):
    out, used = [], 0
    for mod in ["json", "pathlib", "itertools", "functools", "collections", "datetime",
                "argparse", "subprocess", "threading", "unittest", "logging", "re"]:
        try:
            text = pydoc.render_doc(mod, renderer=pydoc.plaintext)
        except Exception:  # noqa: BLE001 - a module may be missing on a minimal install
            continue
        piece = text[:3000]
        out.append(("pydoc " + mod, piece))
        used += len(piece)
        if used >= budget:
            break
    return out


def main():
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 120000
    docs = stdlib_sources(total * 4 // 10) + debian_docs(total * 3 // 10)
    docs += pydoc_text(total - sum(len(t) for _, t in docs))
    out = io.StringIO()
    for source, text in docs:
        out.write("# source: " + source + "\n" + text.strip() + SEP)
    sys.stdout.write(out.getvalue())


if __name__ == "__main__":
    main()
