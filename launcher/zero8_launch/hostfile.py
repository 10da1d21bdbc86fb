"""Hostfiles and resource selection, read the way DeepSpeed's launcher reads them (deepspeed/launcher/
runner.py: `host slots=N` lines, --include/--exclude `host[:slot,slot]@host...`, --num_nodes and
--num_gpus), with errors that name the file and line. Plus SLURM's compressed host lists (`node[01-03]`).
"""

from __future__ import annotations

import re
from collections import OrderedDict

__all__ = ["LaunchError", "parse_hostfile", "read_hostfile", "filter_resources", "select_resources",
           "expand_hostlist", "parse_core_list", "LOCAL_HOST"]

# Without a hostfile, --include/--exclude select from this one host, with a slot per core (DeepSpeed's
# runner uses "localhost" with the local device count then).
LOCAL_HOST = "localhost"


class LaunchError(ValueError):
    """A mistake in what the user asked for (hostfile, filters, options): printed without a traceback."""


# DeepSpeed's pattern is r'^(\S+)\s+slots=(\d+)'; anything after the slots (OpenMPI's max_slots=...) is
# ignored there and here. A line that does not match is an error, not a 1-slot host as in OpenMPI.
_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\S+)(?:\s+.*)?$")
# Characters that separate hosts and slots in the lists built from host names.
_HOST_SEPARATORS = ":@,"
# Most names or cores one range of a core list or a SLURM host list expands to: far above any machine
# or allocation, and small enough that a typo ('0-99999999999') fails at once instead of filling memory.
_MAX_RANGE = 1 << 20


def _is_uint(text: str) -> bool:
    """ASCII digits only: str.isdigit() also accepts '²' (which int() refuses) and other scripts' digits."""
    return text.isascii() and text.isdigit()


def parse_hostfile(text: str, source: str = "<hostfile>") -> "OrderedDict[str, int]":
    """Hostfile text -> {host: slots} in file order. `#` starts a comment (whole line or trailing);
    blank lines are skipped. Duplicate hosts, bad lines and non-positive slot counts raise LaunchError
    with `source:line`."""
    pool: "OrderedDict[str, int]" = OrderedDict()
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if m is None:
            raise LaunchError(f"{source}:{lineno}: bad hostfile line '{raw.strip()}': expected 'hostname slots=N'")
        host, slots_text = m.group("host"), m.group("slots")
        bad = [c for c in _HOST_SEPARATORS if c in host]
        if bad:
            # mpirun's --host (host:slots,...), the wrapper's --hosts (host:slots@...) and MASTER_ADDR
            # would read them as separators.
            raise LaunchError(f"{source}:{lineno}: bad host name '{host}': "
                              f"{' '.join(repr(c) for c in bad)} cannot be in a host name "
                              f"(expected a host name or an IPv4 address)")
        if not _is_uint(slots_text) or int(slots_text) < 1:
            raise LaunchError(f"{source}:{lineno}: bad slot count '{slots_text}' for host '{host}': "
                              f"expected a positive integer")
        if host in pool:
            raise LaunchError(f"{source}:{lineno}: host '{host}' is listed twice (first on line "
                              f"{first_line[host]}): one line per host")
        pool[host] = int(slots_text)
        first_line[host] = lineno
    if not pool:
        raise LaunchError(f"{source}: the hostfile names no hosts (expected lines 'hostname slots=N')")
    return pool


def read_hostfile(path: str) -> "OrderedDict[str, int]":
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise LaunchError(f"cannot read hostfile '{path}': {e.strerror or e}") from None
    return parse_hostfile(text, source=path)


def _parse_slots(spec: str, text: str) -> list[int]:
    slots = []
    for s in text.split(","):
        s = s.strip()
        if not _is_uint(s):
            raise LaunchError(f"bad slot '{s}' in '{spec}': expected host:slot[,slot...] with integer slots")
        slots.append(int(s))
    return slots


def filter_resources(pool: "OrderedDict[str, list[int]]", include: str = "",
                     exclude: str = "", source: str = "") -> "OrderedDict[str, list[int]]":
    """DeepSpeed's parse_resource_filter: `include`/`exclude` are NODE_SPEC[@NODE_SPEC...] with
    NODE_SPEC = host[:slot[,slot...]] (no slots: the whole host). Include keeps only what is named;
    exclude removes it. Hosts left with no slot disappear; host order stays the hostfile's. `source`
    says where the pool came from in errors (default: the hostfile and its hosts)."""
    if include and exclude:
        raise LaunchError("--include and --exclude are mutually exclusive")
    if not include and not exclude:
        return OrderedDict((h, list(s)) for h, s in pool.items())
    spec_text = include or exclude
    flag = "--include" if include else "--exclude"
    chosen: dict[str, set[int]] = {} if include else {h: set(s) for h, s in pool.items()}
    for spec in spec_text.split("@"):
        spec = spec.strip()
        if not spec:
            raise LaunchError(f"{flag} '{spec_text}': empty host between '@' separators")
        host, sep, slot_text = spec.partition(":")
        if host not in pool:
            raise LaunchError(f"{flag}: host '{host}' is not in "
                              + (source or f"the hostfile (hosts: {', '.join(pool)})"))
        if sep:
            slots = _parse_slots(spec, slot_text)
            for s in slots:
                if s not in pool[host]:
                    raise LaunchError(f"{flag}: host '{host}' has no slot {s} (slots 0..{len(pool[host]) - 1})")
            if include:
                chosen.setdefault(host, set()).update(slots)
            else:
                chosen[host].difference_update(slots)
        elif include:
            chosen[host] = set(pool[host])
        else:
            chosen[host] = set()
    return OrderedDict((h, sorted(chosen[h])) for h in pool if chosen.get(h))


def select_resources(pool: "OrderedDict[str, int]", num_nodes: int = -1, num_procs: int = -1,
                     include: str = "", exclude: str = "",
                     oversubscribe: bool = False, source: str = "") -> "OrderedDict[str, list[int]]":
    """The hosts and slot indices the job runs on, as DeepSpeed selects them: include/exclude filters,
    or the first `num_nodes` hosts and `num_procs` processes (slots 0..num_procs-1) on each. Unlike
    DeepSpeed, asking for more nodes than listed, or more processes than a host's slots (without
    `oversubscribe`), is an error rather than silently fewer or more."""
    if (num_nodes > 0 or num_procs > 0) and (include or exclude):
        raise LaunchError("--num_nodes/--num_procs cannot be combined with --include/--exclude "
                          "(as in DeepSpeed): select hosts and slots one way")
    active = filter_resources(OrderedDict((h, list(range(n))) for h, n in pool.items()), include, exclude, source)
    if not active:
        raise LaunchError("no host left after --include/--exclude")
    if num_nodes > 0:
        if num_nodes > len(active):
            raise LaunchError(f"--num_nodes {num_nodes}: the hostfile lists only {len(active)} host(s)")
        active = OrderedDict(list(active.items())[:num_nodes])
    if num_procs > 0:
        for h in active:
            if num_procs > pool[h] and not oversubscribe:
                raise LaunchError(f"--num_procs {num_procs}: host '{h}' has only {pool[h]} slot(s) in the "
                                  f"hostfile (raise slots=, or pass --oversubscribe)")
            active[h] = list(range(num_procs))
    return active


def parse_core_list(text: str, flag: str = "--bind_core_list") -> list[int]:
    """DeepSpeed's core list syntax: '0,2-5,7' -> [0, 2, 3, 4, 5, 7] (order kept). Raises LaunchError
    naming the bad item, a backwards range or a core listed twice."""
    cores: list[int] = []
    seen: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        lo, dash, hi = item.partition("-")
        if not _is_uint(lo) or (dash and not _is_uint(hi)):
            raise LaunchError(f"{flag} '{text}': bad item '{item}' (expected cores like 0,2-5,7)")
        first, last = int(lo), int(hi if dash else lo)
        if last < first:
            raise LaunchError(f"{flag} '{text}': range '{item}' runs backwards")
        if len(cores) + last - first >= _MAX_RANGE:
            raise LaunchError(f"{flag} '{text}': more than {_MAX_RANGE} cores")
        for c in range(first, last + 1):
            if c in seen:
                raise LaunchError(f"{flag} '{text}': core {c} is listed twice")
            seen.add(c)
            cores.append(c)
    return cores


_BRACKET = re.compile(r"^(?P<pre>[^\[\]]*)\[(?P<ranges>[^\[\]]+)\](?P<post>.*)$")


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list ('node[01-03,07],gpu1') -> ['node01', 'node02', 'node03', 'node07',
    'gpu1'] (zero padding kept; one bracket group per name, as in typical allocations)."""
    names: list[str] = []
    # Split on commas outside brackets.
    parts, depth, cur = [], 0, ""
    for ch in text.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchError(f"bad host list '{text}': unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise LaunchError(f"bad host list '{text}': unbalanced '['")
    parts.append(cur)
    for part in parts:
        part = part.strip()
        if not part:
            continue
        m = _BRACKET.match(part)
        if m is None:
            if "[" in part or "]" in part:
                raise LaunchError(f"bad host list '{text}': only one [...] group per name is supported")
            names.append(part)
            continue
        for r in m.group("ranges").split(","):
            lo, dash, hi = r.partition("-")
            if not _is_uint(lo) or (dash and not _is_uint(hi)):
                raise LaunchError(f"bad host list '{text}': bad range '{r}'")
            if len(names) + int(hi if dash else lo) - int(lo) >= _MAX_RANGE:
                raise LaunchError(f"bad host list '{text}': more than {_MAX_RANGE} names")
            width = len(lo)
            for i in range(int(lo), int(hi if dash else lo) + 1):
                names.append(f"{m.group('pre')}{i:0{width}d}{m.group('post')}")
    return names
