#!/usr/bin/env python3
"""Turns a CUDA source into C++ for zero8's CUDA simulator (ZERO8_CUDA=SIM, tests only).

Three rewrites, each kept on its line (a #line directive keeps compiler messages pointing at the .cu file):
  kernel<<<grid, block[, smem[, stream]]>>>(args)  ->  ::zero8_cudasim::launch(kernel, "kernel", grid, ...)(args)
  extern __shared__ [__align__(n)] T name[];      ->  T* name = reinterpret_cast<T*>(::zero8_cudasim::dynamic_smem());
  __shared__ T a[N], b;                            ->  T (&a)[N] = ::zero8_cudasim::shared_var<T[N]>("file:line:a"); ...
The last gives each CUDA block fresh shared variables filled with NaN bytes, as a GPU's are garbage, so a
read before the block's own write (a missing barrier) shows in the tests.
Usage: rewrite_cu.py IN.cu OUT.cpp. Anything else that looks like a launch or shared memory and does not
match is an error, so a new form of either fails the build instead of compiling into something else.
"""
import re
import sys

LAUNCH = re.compile(r"([A-Za-z_][A-Za-z_0-9:]*(?:<[^<>;()]*>)?)<<<(.*?)>>>\(")
DYN_SMEM = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([A-Za-z_][A-Za-z_0-9 ]*?)\s+([A-Za-z_][A-Za-z_0-9]*)\[\];")


SHARED = re.compile(r"(?<!extern )__shared__\s+(?:__align__\(\d+\)\s+)?([^;]+);")
FIRST = re.compile(r"^(.+?)\s+([A-Za-z_][A-Za-z_0-9]*)((?:\[[^\]]*\])*)\s*$")
MORE = re.compile(r"^\s*([A-Za-z_][A-Za-z_0-9]*)((?:\[[^\]]*\])*)\s*$")


def shared_decl(m, where):
    parts = m.group(1).split(",")
    first = FIRST.match(parts[0])
    if not first:
        return None
    ctype, decls = first.group(1).strip(), [(first.group(2), first.group(3))]
    for p in parts[1:]:
        more = MORE.match(p)
        if not more:
            return None
        decls.append((more.group(1), more.group(2)))
    out = []
    for name, dims in decls:
        ref = "(&%s)%s" % (name, dims) if dims else "&" + name
        out.append('%s %s = ::zero8_cudasim::shared_var<%s%s>("%s:%s");' % (ctype, ref, ctype, dims, where, name))
    return " ".join(out)


def rewrite(text, path):
    out = ['#include "zero8_cudasim.h"', '#line 1 "%s"' % path]
    for n, line in enumerate(text.split("\n"), 1):
        line = LAUNCH.sub(lambda m: '::zero8_cudasim::launch(%s, "%s", %s)(' % (m.group(1), m.group(1), m.group(2)), line)
        line = DYN_SMEM.sub(
            lambda m: "%s* %s = reinterpret_cast<%s*>(::zero8_cudasim::dynamic_smem());" % (m.group(1), m.group(2), m.group(1)),
            line)
        where = "%s:%d" % (path.rsplit("/", 1)[-1], n)
        line = SHARED.sub(lambda m: shared_decl(m, where) or m.group(0), line)
        code = line.split("//", 1)[0]
        if "<<<" in code or ">>>" in code or "__shared__" in code:
            sys.exit("%s:%d: a kernel launch or dynamic shared memory the simulator's rewrite does not know: %s" % (path, n, line.strip()))
        out.append(line)
    return "\n".join(out)


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: rewrite_cu.py IN.cu OUT.cpp")
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        text = f.read()
    result = rewrite(text, src)
    try:
        with open(dst) as f:
            if f.read() == result:
                return
    except OSError:
        pass
    with open(dst, "w") as f:
        f.write(result)


if __name__ == "__main__":
    main()
