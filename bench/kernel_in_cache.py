"""The 8-bit kernel's compute cost per kernel variant, in L2, one thread (issue 32). Prints
ns/parameter; never run by pytest.

    python bench/kernel_in_cache.py [--rounds 3]

Builds bench/kernel_in_cache.cpp (the torch-free core, csrc/adamw8bit_core.h) with each
variant's flags this CPU runs, with `-march=native` (the kernel's flags before the
variants), and the AVX2 build once more with the portable loops only
(the compiler's vectorization instead of adamw8bit_avx2.h), then runs the binaries in
alternating rounds and prints each one's best. A best-of-many figure of a single thread
is steady on a shared machine, where the DRAM-bound figures of bench/optimizer.py are not.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from lazytrain_accel.optim import native

_SOURCE = Path(__file__).with_name("kernel_in_cache.cpp")


def builds() -> dict[str, list[str]]:
    """Name -> the compiler flags of each build to compare; first the former single build
    (`-march=native`: this CPU's every instruction and its tuning)."""
    out = {"native (former build)": ["-march=native"]}
    for variant in native.runnable_variants():
        out[variant.name] = list(variant.cflags)
        if variant.name == "avx2":
            out["avx2, portable loops"] = [*variant.cflags, "-DLAZYTRAIN_PORTABLE_LOOPS_ONLY"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp())
    binaries = {}
    for name, flags in builds().items():
        binary = directory / name.replace(" ", "_").replace(",", "")
        subprocess.run(["g++", *native.KERNEL_CFLAGS, *flags, "-I",
                        str(native.CORE_HEADER.parent), str(_SOURCE), "-o", str(binary)],
                       check=True)
        binaries[name] = binary
    best = dict.fromkeys(binaries, float("inf"))
    for _ in range(args.rounds):
        for name, binary in binaries.items():
            ns = float(subprocess.run([str(binary)], capture_output=True, text=True,
                                      check=True).stdout)
            best[name] = min(best[name], ns)
    for name, ns in best.items():
        print(f"{name:24s} {ns:.3f} ns/param")


if __name__ == "__main__":
    main()
