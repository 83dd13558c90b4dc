"""Check a lock against pyproject.toml, and (with --installed) a virtual environment against the lock.

    python locks/check.py locks/cpu.txt --extras cpu,dev                      # this interpreter's markers
    python locks/check.py locks/cuda.txt --extras cuda,megatron,dev --python 3.12   # another target
    python locks/check.py locks/cpu.txt --extras cpu,dev --installed --prune  # what `make install` runs

A lock is stale when a requirement of vime (its dependencies, the extras given, locks/installer.in)
that applies to the target is missing from it or pinned outside the requirement's range: `pip install
--no-deps` would not notice, so this does. --installed also checks that this interpreter has exactly
the lock: every locked package at its locked version, nothing else but vime itself (--prune uninstalls
the rest, e.g. packages an older lock or a hand install left). Needs `packaging` (in every lock).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "vime"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = PIN.match(line)
        if m:
            pins[norm(m.group(1))] = m.group(2)
    return pins


def wanted(extras: list[str]) -> list[tuple[str, Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    reqs = [("dependencies", r) for r in project["dependencies"]]
    for extra in extras:
        if extra not in optional:
            sys.exit(f"check: pyproject.toml has no extra {extra!r}")
        reqs += [(f"extra {extra}", r) for r in optional[extra]]
    for line in (ROOT / "locks" / "installer.in").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            reqs.append(("locks/installer.in", line))
    return [(where, Requirement(r)) for where, r in reqs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lock", type=Path)
    ap.add_argument("--extras", required=True, help="comma-separated extras the lock was compiled for")
    ap.add_argument("--python", help="target Python X.Y (Linux x86-64); default: this interpreter")
    ap.add_argument("--installed", action="store_true", help="also compare this interpreter's packages")
    ap.add_argument("--prune", action="store_true", help="with --installed: uninstall packages not in the lock")
    args = ap.parse_args()

    pins = read_lock(args.lock)
    env = default_environment()
    if args.python:
        env.update(python_version=args.python, python_full_version=f"{args.python}.0",
                   sys_platform="linux", platform_system="Linux", platform_machine="x86_64",
                   os_name="posix", implementation_name="cpython",
                   platform_python_implementation="CPython")
    problems = []
    for where, req in wanted([e for e in args.extras.split(",") if e]):
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        have = pins.get(norm(req.name))
        if have is None:
            problems.append(f"{req} ({where}) is not in {args.lock}")
        elif not req.specifier.contains(Version(have), prereleases=True):
            problems.append(f"{req} ({where}) but {args.lock} has {req.name}=={have}")
    if problems:
        print("\n".join(["check: the lock is out of date with pyproject.toml:", *problems,
                         "refresh it with `make lock` (see the Makefile)"]), file=sys.stderr)
        return 1

    if args.installed:
        installed = {norm(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
        wrong = [f"{n}=={v} installed, {args.lock} has {n}=={pins[n]}"
                 for n, v in sorted(installed.items()) if n in pins and v != pins[n]]
        wrong += [f"{n} is in {args.lock} but not installed" for n in sorted(set(pins) - set(installed))]
        extra = sorted(set(installed) - set(pins) - {PROJECT})
        if extra and args.prune:
            print(f"check: removing what {args.lock} does not list: {' '.join(extra)}", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", *extra], check=True)
        elif extra:
            wrong += [f"{n}=={installed[n]} is installed but not in {args.lock}" for n in extra]
        if wrong:
            print("\n".join(["check: this environment is not the lock:", *wrong]), file=sys.stderr)
            return 1
        print(f"check: {sys.prefix} has exactly {args.lock} ({len(pins)} packages) plus {PROJECT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
