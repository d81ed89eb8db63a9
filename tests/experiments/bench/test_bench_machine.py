"""The CPU record every results file carries (``experiments.bench.machine``)."""

from experiments.bench.machine import ISA_FLAGS, machine


def test_machine_names_the_cpu_and_its_kernel_flags():
    m = machine()
    with open("/proc/cpuinfo") as f:
        flags = set(next(ln for ln in f if ln.startswith("flags")).split(":", 1)[1].split())
    assert m["isa"] == [f for f in ISA_FLAGS if f in flags]  # read independently here
    assert m["cores"] >= 1 and isinstance(m["cpu"], str)
