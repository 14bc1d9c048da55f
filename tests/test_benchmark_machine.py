"""benchmarks/machine.py: the machine header every benchmark prints, from a fake /proc/cpuinfo.

benchmarks/ is not a package (its scripts run as `python benchmarks/x.py`), so the module is
loaded from its file.
"""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "benchmark_machine", os.path.join(ROOT, "benchmarks", "machine.py"))
machine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(machine)

CPUINFO = """\
processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16
bugs\t\t: spectre_v1

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_tile amx_bf16
"""

NO_MODEL_NAME = """\
processor\t: 0
flags\t\t: fpu sse2 avx2 avx512f
"""


def test_cpu_line_reads_the_model_name_and_the_flags_that_matter():
    assert machine.cpu_line(CPUINFO, 8, 2, "x86_64") == (
        "cpu: Intel(R) Xeon(R) Platinum 8480+; 8 cores, 2 usable; avx512_bf16 yes, "
        "amx_bf16 yes, amx_tile yes, avx512_vnni yes, avx512f yes")


def test_cpu_line_falls_back_to_the_processor_name_and_marks_absent_flags():
    assert machine.cpu_line(NO_MODEL_NAME, 2, 2, "x86_64") == (
        "cpu: x86_64; 2 cores, 2 usable; avx512_bf16 no, amx_bf16 no, amx_tile no, "
        "avx512_vnni no, avx512f yes")
    assert machine.cpu_line("", None, None, "") == (
        "cpu: unknown CPU; None cores, None usable; avx512_bf16 no, amx_bf16 no, "
        "amx_tile no, avx512_vnni no, avx512f no")


def test_jax_line_counts_devices_by_kind_and_shows_xla_flags():
    assert machine.jax_line("0.10.2", "0.10.2", "gpu", ["H100", "H100"],
                            "--xla_cpu_use_onednn=true") == (
        "jax 0.10.2, jaxlib 0.10.2; backend gpu, devices 2 x H100; "
        "XLA_FLAGS=--xla_cpu_use_onednn=true")
    assert machine.jax_line("0.10.2", "0.10.2", "cpu", ["cpu"], None) == (
        "jax 0.10.2, jaxlib 0.10.2; backend cpu, devices 1 x cpu; XLA_FLAGS unset")


def test_machine_header_is_three_lines_on_this_machine():
    lines = machine.machine_header().splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["cpu:", "jax", "dtype"]
    assert lines[2].startswith('dtype "auto" -> ')
