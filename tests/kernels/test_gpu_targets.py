"""GPU target descriptions: packaged with jaxllm, extended or overridden by $JAXLLM_GPU_TARGETS.

Reading and parsing needs no CUDA plugin; the one compile at the end does (gpu-compile extra).
Nothing here reads outside the repository except files the tests write under tmp_path.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import jaxllm.kernels
from jaxllm.kernels import gpu_compile as gc
from jaxllm.kernels import paged_attention as pa
from jaxllm.kernels import tuning

PACKAGE_DIR = pathlib.Path(jaxllm.kernels.__file__).parent / "targets"
# name: (ptxas arch, SMs, shared memory per block opt-in, HBM bytes/s, driver's device name)
EXPECTED = {
    "a100": ("sm_80", 108, 166912, 2.039e12, "NVIDIA A100-SXM4-80GB"),
    "h100": ("sm_90a", 132, 232448, 3.35232e12, "NVIDIA H100 80GB HBM3"),
    "h200": ("sm_90a", 132, 232448, 4.8e12, "NVIDIA H200"),
    "l4": ("sm_89", 58, 101376, 3.0e11, "NVIDIA L4"),
}


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(gc.TARGETS_ENV, raising=False)


def test_packaged_targets_load_from_the_package():
    assert gc.available_targets() == ["a100", "h100", "h200", "l4"]
    for name, (arch, sms, smem, bandwidth, description) in EXPECTED.items():
        info = gc.target_info(name)
        assert (info.arch, info.num_sms, info.shared_memory_per_block_optin,
                info.memory_bandwidth, info.description) == (arch, sms, smem, bandwidth,
                                                              description)
        assert info.registers_per_block_limit == 65536
        assert pathlib.Path(info.source) == PACKAGE_DIR / f"{name}.txtpb"


def test_every_packaged_target_has_tuning_for_its_sm_count_and_device_name():
    for name in gc.available_targets():
        info = gc.target_info(name)
        assert tuning.TARGETS[name].num_sms == info.num_sms
        assert tuning.target_of_device_kind(info.description) == name


def test_borrowed_tuning():
    assert tuning.TARGETS["h200"] == tuning.TARGETS["h100"]
    l4, a100 = tuning.TARGETS["l4"], tuning.TARGETS["a100"]
    assert (l4.decode, l4.prefill, l4.num_sms) == (a100.decode, a100.prefill, 58)


@pytest.mark.parametrize("kind,target", [
    ("NVIDIA H100 PCIe", "h100"), ("NVIDIA A100-SXM4-40GB", "a100"), ("NVIDIA H200 NVL", "h200"),
    ("NVIDIA L40S", "default"), ("NVIDIA GH200 480GB", "default"), ("cpu", "default"),
])
def test_target_of_device_kind_matches_whole_words(kind, target):
    assert tuning.target_of_device_kind(kind) == target


def _variant(name: str, **fields) -> str:
    """The packaged `name` target with some gpu_device_info fields replaced."""
    text = (PACKAGE_DIR / f"{name}.txtpb").read_text()
    for field, value in fields.items():
        text, count = re.subn(rf"^  {field}: \S+$", f"  {field}: {value}", text, flags=re.M)
        assert count == 1, field
    return text


def test_override_dir_adds_and_overrides_targets(monkeypatch, tmp_path):
    (tmp_path / "l4.txtpb").write_text(_variant("l4", core_count=60))
    (tmp_path / "myh100.txtpb").write_text(_variant("h100", core_count=114))
    (tmp_path / "notes.txt").write_text("not a target")
    monkeypatch.setenv(gc.TARGETS_ENV, str(tmp_path))
    assert gc.available_targets() == ["a100", "h100", "h200", "l4", "myh100"]
    assert (gc.target_info("l4").num_sms, gc.target_info("l4").source) == (
        60, str(tmp_path / "l4.txtpb"))
    assert (gc.target_info("myh100").num_sms, gc.target_info("myh100").arch) == (114, "sm_90a")
    assert gc.target_info("h100").num_sms == 132  # not overridden: still the packaged one


def test_unknown_target_lists_the_available_ones():
    with pytest.raises(ValueError) as e:
        gc.target_info("v100")
    assert str(e.value) == ("unknown GPU target 'v100'; available: a100, h100, h200, l4 "
                            "(add one as <dir>/v100.txtpb with JAXLLM_GPU_TARGETS=<dir>)")


def test_override_that_is_not_a_directory_is_an_error(monkeypatch, tmp_path):
    monkeypatch.setenv(gc.TARGETS_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="JAXLLM_GPU_TARGETS=.*missing' is not a directory"):
        gc.available_targets()


def test_a_missing_field_names_the_file(monkeypatch, tmp_path):
    text = (PACKAGE_DIR / "a100.txtpb").read_text().replace("  core_count: 108\n", "")
    (tmp_path / "broken.txtpb").write_text(text)
    monkeypatch.setenv(gc.TARGETS_ENV, str(tmp_path))
    with pytest.raises(ValueError, match=r"broken\.txtpb: field core_count missing"):
        gc.target_info("broken")


@pytest.mark.slow
@pytest.mark.gpu_compile
def test_the_override_reaches_the_compiler(monkeypatch, tmp_path):
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    # The bf16 prefill tile of the L4 takes 57,344 B of shared memory: an L4 that offers only
    # the 48 KB a block gets without opting in must reject it.
    (tmp_path / "l4.txtpb").write_text(_variant("l4", shared_memory_per_block_optin=49152))
    monkeypatch.setenv(gc.TARGETS_ENV, str(tmp_path))
    sds = jax.ShapeDtypeStruct
    cache = sds((1024, 16, 8, 128), jnp.bfloat16)
    specs = [sds((512, 32, 128), jnp.bfloat16), cache, cache, sds((8, 128), jnp.int32),
             sds((8,), jnp.int32), sds((9,), jnp.int32), sds((), jnp.int32)]
    fn = jax.jit(lambda *a: pa.ragged_paged_attention(*a, sm_scale=0.1, target="l4",
                                                      num_kv_splits=1))
    with pytest.raises(Exception, match="requested 57344, available: 49152"):
        gc.compile_for_target(fn, specs, "l4")
