"""Compare the PTX of every .entry in two files (a kernel change that must leave the
existing entry points alone).

    nvcc -arch=sm_90 -ptx -std=c++17 -I kernels kernels/moe.cu -o /tmp/after.ptx  (and before)
    python bench/probes/ptx_diff.py /tmp/before.ptx /tmp/after.ptx

Per entry: "identical" (the text, with two names that change when nothing else does: the
shared arrays nvcc demotes into the entry, whose mangled names carry the template arguments
of the function that declares them, kept as their local names, and the block labels
$L__BB<function>_<n>, numbered per file, kept as $L__BB_<n>), "same up to register numbers"
(every %r12-style register number erased too), or "DIFFERENT"; then the entries only the
second file has.
"""

from __future__ import annotations

import re
import sys


def _local_name(m: re.Match) -> str:
    """A demoted shared array's mangled name _ZZ<function>E<len><name> -> SHARED_<name>."""
    token = m.group(0)
    for e in re.finditer(r"E(\d+)", token):
        rest = token[e.end():]
        if rest and len(rest) == int(e.group(1)):
            return "SHARED_" + rest
    return token


def entries(path: str) -> dict[str, str]:
    with open(path) as f:
        text = f.read()
    out = {}
    for m in re.finditer(r"\.entry (\w+)\(.*?\n\}\n", text, re.DOTALL):
        body = re.sub(r"_ZZ\w+", _local_name, m.group(0))
        out[m.group(1)] = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
    return out


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
