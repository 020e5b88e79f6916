"""The one reader of `/proc/cpuinfo`: CPU model, feature flags and clock.

Used by `mixed_precision.detect_hardware` (policy choice), `bench.flops.read_cpu_description`
(peak FLOP/s) and `bench.harness.machine_description` (report headers). TensorFlow-free.
"""

from __future__ import annotations

import dataclasses

CPUINFO_PATH = "/proc/cpuinfo"


@dataclasses.dataclass(frozen=True)
class CPUInfo:
    """What `/proc/cpuinfo` says about the CPU (the first core's entries).

    Args:
        flags: frozenset of strings, the feature flags (x86 `flags`, arm64 `Features`).
            Defaults to the empty set.
        model: string, the model name (`model name`). Defaults to `""`.
        mhz: float or None, the current clock in MHz (`cpu MHz`). Defaults to `None`.
    """

    flags: frozenset[str] = frozenset()
    model: str = ""
    mhz: float | None = None


def parse_cpuinfo(text: str) -> CPUInfo:
    """Parses the text of `/proc/cpuinfo`; keys missing from it keep `CPUInfo`'s defaults.

    >>> parse_cpuinfo("model name\\t: X\\ncpu MHz\\t: 2600.0\\nflags\\t: fma avx2\\n").mhz
    2600.0
    """
    flags: frozenset[str] | None = None
    model = ""
    mhz = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key in ("flags", "Features") and flags is None:  # x86 / arm64; one line per core
            flags = frozenset(value.split())
        elif key == "model name" and not model:
            model = value.strip()
        elif key == "cpu MHz" and mhz is None:
            try:
                mhz = float(value.strip())
            except ValueError:
                pass
    return CPUInfo(flags=flags or frozenset(), model=model, mhz=mhz)


def read_cpuinfo(path: str = CPUINFO_PATH) -> CPUInfo:
    """Reads and parses `path`; an unreadable file (macOS, Windows) gives an empty `CPUInfo`."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return CPUInfo()
