"""The ``gpipe`` command that ``pip install gpipe`` puts on PATH.

The wheel built by ``scripts/wheel`` carries the gpipe CLI (a release build of
``pipeline-examples``' ``gpipe``, linked for glibc 2.28 like the native module) as
``gpipe/_bin/gpipe``; the ``gpipe`` console script runs :func:`main`, which replaces itself
with that binary, so the CLI keeps its process id, its signals (Ctrl-C) and its exit status.
A package built from source (``pip install ./gpipe-py`` or the sdist) has no bundled CLI:
the command then says where to get one.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import NoReturn, Optional

__all__ = ["bundled_binary", "main"]


def bundled_binary() -> Optional[Path]:
    """The gpipe CLI bundled in this package, or ``None`` where the package was built from
    source (only the wheel made by ``scripts/wheel`` bundles it)."""
    path = Path(__file__).resolve().parent / "_bin" / "gpipe"
    return path if path.is_file() else None


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"gpipe: error: {message}\n")
    sys.exit(2)


def main() -> NoReturn:
    """Runs the bundled gpipe CLI with this command's arguments, in this process."""
    binary = bundled_binary()
    if binary is None:
        _fail(
            "this gpipe package was built from source and carries no gpipe CLI; install the "
            "wheel instead (scripts/wheel, then pip install target/wheels/gpipe-*-manylinux_2_28_x86_64.whl), or "
            "build the CLI with cargo (cargo build --release -p pipeline-examples gives "
            "target/release/gpipe)"
        )
    if not os.access(binary, os.X_OK):
        _fail(
            f"the bundled CLI {binary} is not executable (the installer dropped its file mode); "
            "reinstall the wheel with pip, or run chmod +x on that file"
        )
    # Python ignores SIGPIPE and SIGXFSZ, and an ignored signal stays ignored across exec:
    # give the CLI the dispositions it would have if started directly.
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        os.execv(binary, ["gpipe", *sys.argv[1:]])
    except OSError as e:
        _fail(f"could not start the bundled CLI {binary}: {e.strerror or e}")


if __name__ == "__main__":
    main()
