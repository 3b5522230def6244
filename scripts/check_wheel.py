#!/usr/bin/env python3
"""Checks a gpipe wheel made by scripts/wheel before anyone installs it.

    scripts/check_wheel.py target/wheels/gpipe-0.1.0-cp39-abi3-manylinux_2_28_x86_64.whl

It fails, naming the file and the reason, unless:
  * the wheel is tagged for CPython >= 3.9's stable ABI (abi3) on manylinux_2_<N> x86_64,
    with N no newer than --glibc (default 2.28);
  * the native module gpipe/_gpipe.abi3.so and the CLI gpipe/_bin/gpipe are both in it (the
    CLI executable), and the console script `gpipe = gpipe._cli:main` is declared;
  * neither asks for a glibc symbol version newer than --glibc, links a shared library outside
    the manylinux set (libc, libm, libpthread, ...), carries an RPATH/RUNPATH, or names an
    ELF interpreter other than the standard /lib64/ld-linux-x86-64.so.2: nothing in the wheel
    needs a file from the machine that built it.
Needs readelf (binutils).
"""

from __future__ import annotations

import argparse
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODULE = "gpipe/_gpipe.abi3.so"
CLI = "gpipe/_bin/gpipe"
ENTRY_POINT = "gpipe = gpipe._cli:main"
# The manylinux policy's libraries that gpipe may link (every glibc system has them).
ALLOWED_LIBS = {
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "librt.so.1",
    "libpthread.so.0",
    "libutil.so.1",
    "libgcc_s.so.1",
    "ld-linux-x86-64.so.2",
}
INTERPRETER = "/lib64/ld-linux-x86-64.so.2"


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def readelf(flag: str, path: Path) -> str:
    return subprocess.run(["readelf", "-W", flag, str(path)], check=True, capture_output=True, text=True).stdout


def check_elf(name: str, path: Path, glibc: tuple[int, ...], problems: list[str]) -> str:
    """Appends what is wrong with one ELF file to `problems`; returns a one-line summary."""
    needed_versions = re.findall(r"Name: GLIBC_([0-9.]+)", readelf("--version-info", path))
    newest = max(needed_versions, key=version, default=None)
    if newest is None:
        problems.append(f"{name}: readelf shows no GLIBC symbol versions (is it a dynamically linked ELF file?)")
    elif version(newest) > glibc:
        too_new = sorted({v for v in needed_versions if version(v) > glibc}, key=version)
        problems.append(
            f"{name} needs glibc {newest} (symbol versions {', '.join(too_new)}), newer than the "
            f"{'.'.join(map(str, glibc))} the wheel is tagged for: link it with zig for that glibc"
        )
    dynamic = readelf("--dynamic", path)
    libs = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    foreign = sorted(set(libs) - ALLOWED_LIBS)
    if foreign:
        problems.append(
            f"{name} links {', '.join(foreign)}, outside the manylinux set: a machine without it cannot load it"
        )
    for kind, value in re.findall(r"\((RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[([^\]]*)\]", dynamic):
        problems.append(f"{name} has {kind} {value}: it would look for libraries on the building machine's paths")
    interpreter = re.search(r"Requesting program interpreter: ([^\]]+)\]", readelf("--program-headers", path))
    if interpreter and interpreter.group(1) != INTERPRETER:
        problems.append(f"{name} asks for the ELF interpreter {interpreter.group(1)}, not {INTERPRETER}")
    size_mib = path.stat().st_size / (1 << 20)
    return f"{name}: {size_mib:.1f} MiB, glibc >= {newest}, links {', '.join(libs) or 'nothing'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--glibc", default="2.28", help="the oldest glibc the wheel must load on (default 2.28)")
    args = parser.parse_args()
    if shutil.which("readelf") is None:
        print("check_wheel: readelf is not on PATH: install binutils", file=sys.stderr)
        return 2
    glibc = version(args.glibc)
    problems: list[str] = []
    summary: list[str] = []
    with zipfile.ZipFile(args.wheel) as wheel, tempfile.TemporaryDirectory() as tmp:
        names = wheel.namelist()
        dist_info = next((n.split("/")[0] for n in names if n.endswith(".dist-info/WHEEL")), None)
        if dist_info is None:
            print(f"check_wheel: {args.wheel} has no .dist-info/WHEEL: it is not a wheel", file=sys.stderr)
            return 1
        tags = re.findall(r"^Tag: (\S+)$", wheel.read(f"{dist_info}/WHEEL").decode(), re.M)
        good_tag = False
        for tag in tags:
            python, abi, platform = tag.split("-")
            m = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", platform)
            if python == "cp39" and abi == "abi3" and m and (int(m.group(1)), int(m.group(2))) <= glibc:
                good_tag = True
        if not good_tag:
            problems.append(
                f"the wheel's tags {tags} do not include cp39-abi3-manylinux_2_<N>_x86_64 with 2.<N> <= {args.glibc}"
            )
        summary.append(f"tags: {', '.join(tags)}")
        entry_points = f"{dist_info}/entry_points.txt"
        declared = wheel.read(entry_points).decode() if entry_points in names else ""
        if not re.search(r"^\[console_scripts\][^\[]*^gpipe\s*=\s*gpipe\._cli:main\s*$", declared, re.M):
            problems.append(f"the wheel does not declare the console script `{ENTRY_POINT}`")
        for member in (MODULE, CLI):
            if member not in names:
                problems.append(f"the wheel has no {member}")
                continue
            mode = wheel.getinfo(member).external_attr >> 16
            if member == CLI and not mode & stat.S_IXUSR:
                problems.append(f"{member} is not executable in the wheel (mode {oct(mode & 0o777)})")
            summary.append(check_elf(member, Path(wheel.extract(member, tmp)), glibc, problems))
    print(f"check_wheel: {args.wheel.name}")
    for line in summary:
        print(f"  {line}")
    if problems:
        for p in problems:
            print(f"check_wheel: FAIL: {p}", file=sys.stderr)
        return 1
    print("check_wheel: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
