"""The one reader of `/proc/cpuinfo`: CPU model, family, feature flags and clock.

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
        family: int or None, the x86 family (`cpu family`; AMD Zen 4 is 25, Zen 5 26).
            Defaults to `None`.
        model_number: int or None, the x86 model number (`model`). Defaults to `None`.
    """

    flags: frozenset[str] = frozenset()
    model: str = ""
    mhz: float | None = None
    family: int | None = None
    model_number: int | None = None

    def identity(self) -> str:
        """The model name with family, model number and bf16 units, for report headers.

        Two CPUs can share a model name (cloud VMs report "AMD EPYC" for Zen 4 and Zen 5),
        and bf16 speed depends on the units, so figures name all three.

        >>> CPUInfo(frozenset({"avx512_bf16"}), "AMD EPYC", None, 25, 17).identity()
        'AMD EPYC (family 25, model 17; bf16: AVX512_BF16)'

        Returns:
            string, `""` when nothing is known.
        """
        details = []
        if self.family is not None and self.model_number is not None:
            details.append(f"family {self.family}, model {self.model_number}")
        units = [name for flag, name in _BF16_UNITS if flag in self.flags]
        if units:
            details.append("bf16: " + ", ".join(units))
        if not details:
            return self.model
        return f"{self.model} ({'; '.join(details)})".strip()


# bf16 units by `/proc/cpuinfo` flag, as named in the vendors' manuals.
_BF16_UNITS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512_BF16"))


def parse_cpuinfo(text: str) -> CPUInfo:
    """Parses the text of `/proc/cpuinfo`; keys missing from it keep `CPUInfo`'s defaults.

    >>> parse_cpuinfo("model name\\t: X\\ncpu MHz\\t: 2600.0\\nflags\\t: fma avx2\\n").mhz
    2600.0
    """
    flags: frozenset[str] | None = None
    model = ""
    mhz = None
    numbers: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key in ("flags", "Features") and flags is None:  # x86 / arm64; one line per core
            flags = frozenset(value.split())
        elif key == "model name" and not model:
            model = value.strip()
        elif key in ("cpu family", "model") and key not in numbers:
            try:
                numbers[key] = int(value.strip())
            except ValueError:
                pass
        elif key == "cpu MHz" and mhz is None:
            try:
                mhz = float(value.strip())
            except ValueError:
                pass
    return CPUInfo(
        flags=flags or frozenset(),
        model=model,
        mhz=mhz,
        family=numbers.get("cpu family"),
        model_number=numbers.get("model"),
    )


def read_cpuinfo(path: str = CPUINFO_PATH) -> CPUInfo:
    """Reads and parses `path`; an unreadable file (macOS, Windows) gives an empty `CPUInfo`."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return CPUInfo()
