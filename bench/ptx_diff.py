"""Compare the PTX of every .entry in two files (a kernel change that must leave the
existing entry points alone).

    nvcc -arch=sm_90 -ptx -std=c++17 -I kernels kernels/moe.cu -o /tmp/after.ptx  (and before)
    python bench/ptx_diff.py /tmp/before.ptx /tmp/after.ptx

Per entry: "identical" (the text, with shared arrays that nvcc demoted into the entry named
XS: their mangled names carry the template arguments of the function that declares them),
"same up to register numbers" (every %r12-style register number erased), or "DIFFERENT";
then the entries only the second file has.
"""

from __future__ import annotations

import re
import sys


def entries(path: str) -> dict[str, str]:
    with open(path) as f:
        text = f.read()
    return {m.group(1): re.sub(r"_ZZ\w+E2xs", "XS", m.group(0))
            for m in re.finditer(r"\.entry (\w+)\(.*?\n\}\n", text, re.DOTALL)}


def verdict(a: str, b: str) -> str:
    if a == b:
        return "identical"
    erase = re.compile(r"(%[a-z]+)\d+")
    same = erase.sub(r"\1", a) == erase.sub(r"\1", b)
    return "same up to register numbers" if same else "DIFFERENT"


def main() -> None:
    before, after = entries(sys.argv[1]), entries(sys.argv[2])
    for name in sorted(before):
        print(f"{name:28s} {verdict(before[name], after[name]) if name in after else 'MISSING'}")
    print("new:", " ".join(sorted(set(after) - set(before))))


if __name__ == "__main__":
    main()
