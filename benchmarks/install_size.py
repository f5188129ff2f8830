"""What ``make quickstart`` installs: a fresh venv with jaxpt's core and the prepare extra, its size on disk and the
time pip took.

    python benchmarks/install_size.py [--python python3] [--extra prepare] [--keep DIR]

Creates a new virtual environment in a temporary folder, installs this checkout (``pip install .``, plus
``[EXTRA]`` when given: ``--extra dev`` measures the test set), prints the venv's size (MiB, ``du``-style: the sum
of file sizes) with its ten largest packages, and removes it unless ``--keep`` names a folder. Needs the package
index (it downloads what pip's cache lacks); the time depends on the network and the cache.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def tree_bytes(path: pathlib.Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--python", default=sys.executable, help="the interpreter of the venv (default: this one)")
    p.add_argument("--extra", default="prepare", help="extras to install beside the core (default prepare, what the "
                   "quickstart installs; dev: the test set; '': the core alone)")
    p.add_argument("--keep", help="build the venv in this folder and keep it")
    args = p.parse_args(argv)
    root = pathlib.Path(args.keep or tempfile.mkdtemp(prefix="jaxpt-venv-"))
    try:
        subprocess.run([args.python, "-m", "venv", str(root)], check=True)
        py = root / "bin" / "python"
        subprocess.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
        target = f"{REPO}[{args.extra}]" if args.extra else str(REPO)
        t0 = time.perf_counter()
        subprocess.run([py, "-m", "pip", "install", "-q", target], check=True)
        seconds = time.perf_counter() - t0
        site = next(root.glob("lib/python*/site-packages"))
        sizes = sorted(((tree_bytes(d), d.name) for d in site.iterdir() if d.is_dir()), reverse=True)
        print(f"venv {'jaxpt' + (f'[{args.extra}]' if args.extra else '')}: {tree_bytes(root) / 2 ** 20:,.0f} MiB, "
              f"pip install {seconds:.0f} s")
        for size, name in sizes[:10]:
            print(f"  {name:<32} {size / 2 ** 20:8,.0f} MiB")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
