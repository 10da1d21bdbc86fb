"""Fuzzing of zero8-launch's parsers of user input (launcher/zero8_launch/hostfile.py: hostfiles,
--include/--exclude, --bind_core_list, SLURM host lists) with Hypothesis: any text either parses into
a result that holds the parser's promises or raises LaunchError with a message naming the input;
never another exception, and never a hang or an allocation that grows with a number in the text.

Hypothesis rather than a coverage-guided fuzzer (atheris): the parsers are a few regular expressions
and splits in pure Python, so what finds their bugs is the shape of the input (Unicode digits,
separators inside names, huge ranges), which the strategies below generate directly; and Hypothesis
runs inside pytest, shrinks a failure to a minimal input and replays it, with no native build.
CI runs a fixed, derandomized set of examples; ZERO8_FUZZ_EXAMPLES=N runs N random examples per test
(docs/TESTING.md). Inputs that once failed are pinned with @example.
"""

from __future__ import annotations

import contextlib
import os
import signal
import string
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="pip install hypothesis (the test extra has it)")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "launch"))
from launch_util import installed_problem  # noqa: E402

_problem = installed_problem()
if _problem is None:
    from zero8_launch.hostfile import (LaunchError, expand_hostlist, parse_core_list, parse_hostfile,
                                       select_resources)


@pytest.fixture(autouse=True)
def _launcher_installed():
    if _problem:
        pytest.fail(_problem, pytrace=False)


_examples = int(os.environ.get("ZERO8_FUZZ_EXAMPLES", "0"))
fuzz = settings(max_examples=_examples or 400, derandomize=not _examples, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])

@contextlib.contextmanager
def _bounded(seconds: float = 5.0):
    """Fails the example, instead of hanging the suite, when a parse runs longer than `seconds` (a range
    that the parser expands element by element). Hypothesis' deadline only measures a call that returns."""
    def _expired(signum, frame):
        raise AssertionError(f"the parser ran longer than {seconds} s")
    old = signal.signal(signal.SIGALRM, _expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# Pieces that the parsers treat specially, mixed into otherwise arbitrary text: separators, comment
# and range characters, ASCII and non-ASCII digits (str.isdigit() accepts '²' and '٣'), whitespace.
_special = st.sampled_from(["#", ":", "@", ",", "-", "[", "]", "=", "slots=", " ", "\t", "\n", "\r\n", "\x0b",
                            "\u2028", "0", "1", "7", "01", "²", "٣", "１", "99999999999999999999"])
_fragment = st.one_of(st.text(string.ascii_letters + string.digits + ".-_", max_size=8), _special,
                      st.text(max_size=3))
_text = st.lists(_fragment, max_size=24).map("".join)
_number = st.one_of(st.integers(-3, 70).map(str), st.sampled_from(["", "²", "٣", "1٣", "+1", " 2", "0x10",
                                                                  "1e3", "99999999999999999999"]))
_host = st.one_of(st.from_regex(r"[a-z][a-z0-9.-]{0,12}", fullmatch=True), _text)


@st.composite
def _hostfile_text(draw) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            lines.append(draw(_text))
        else:
            comment = draw(st.sampled_from(["", " # c", "#x slots=1"]))
            tail = draw(st.sampled_from(["", " max_slots=4", "\t"]))
            lines.append(f"{draw(_host)}{draw(st.sampled_from([' ', '  ', chr(9)]))}slots={draw(_number)}"
                         f"{tail}{comment}")
    return draw(st.sampled_from(["\n", "\r\n"])).join(lines)


@fuzz
@given(st.one_of(_hostfile_text(), _text))
@example("a slots=²")
@example("a slots=٣")
def test_hostfile_parses_or_names_the_line(text):
    try:
        with _bounded():
            pool = parse_hostfile(text, "fuzz.hostfile")
    except LaunchError as e:
        assert str(e).startswith("fuzz.hostfile"), e
        return
    assert pool, "an accepted hostfile names at least one host"
    lines = [line.split("#", 1)[0].split() for line in text.splitlines()]
    listed = [words[0] for words in lines if words]
    assert list(pool) == listed, "the hosts, in file order, one per non-blank line"
    for host, slots in pool.items():
        assert host and not set(host) & set(":@,#") and not any(c.isspace() for c in host), host
        assert type(slots) is int and slots >= 1, (host, slots)


@fuzz
@given(st.lists(st.tuples(st.from_regex(r"[a-zA-Z0-9][a-zA-Z0-9._-]{0,15}", fullmatch=True),
                          st.integers(1, 4096)), min_size=1, max_size=8, unique_by=lambda t: t[0]),
       st.lists(st.sampled_from(["", "# note", "   "]), min_size=1, max_size=3), st.sampled_from(["\n", "\r\n"]))
def test_hostfile_round_trip(entries, extra_lines, newline):
    lines = [f"{h} slots={n}" + (" # comment" if i % 2 else "") for i, (h, n) in enumerate(entries)]
    text = newline.join(extra_lines + lines + extra_lines)
    assert parse_hostfile(text, "hf") == OrderedDict(entries)


@fuzz
@given(st.one_of(_text, st.lists(st.one_of(_number, st.tuples(_number, _number).map("-".join)),
                                 min_size=1, max_size=6).map(",".join)))
@example("²")
@example("0-99999999999999")
def test_core_list_parses_or_names_the_item(text):
    try:
        with _bounded():
            cores = parse_core_list(text)
    except LaunchError as e:
        assert "--bind_core_list" in str(e), e
        return
    assert cores and len(set(cores)) == len(cores), cores
    assert all(type(c) is int and c >= 0 for c in cores), cores


@fuzz
@given(st.one_of(_text, st.lists(st.tuples(_host, st.one_of(st.just(""), st.lists(
    st.one_of(_number, st.tuples(_number, _number).map("-".join)), min_size=1, max_size=3).map(
        lambda r: "[" + ",".join(r) + "]")), _host).map("".join), max_size=4).map(",".join)))
@example("n[²]")
@example("node[0-99999999999999]")
def test_hostlist_expands_or_names_the_list(text):
    try:
        with _bounded():
            names = expand_hostlist(text)
    except LaunchError as e:
        assert text in str(e), e
        return
    assert all(isinstance(n, str) and n and "[" not in n and "]" not in n for n in names), names


@fuzz
@given(st.lists(st.tuples(st.from_regex(r"[a-c][0-9]?", fullmatch=True), st.integers(1, 4)), min_size=1,
                max_size=4, unique_by=lambda t: t[0]),
       st.integers(-1, 5), st.integers(-1, 5), st.one_of(st.just(""), _text, st.from_regex(
           r"([a-c][0-9]?(:[0-9](,[0-9]){0,2})?)(@[a-c][0-9]?(:[0-9](,[0-9]){0,2})?){0,2}", fullmatch=True)),
       st.booleans(), st.booleans())
def test_select_resources_keeps_to_the_hostfile(entries, num_nodes, num_procs, spec, as_exclude, oversubscribe):
    pool = OrderedDict(entries)
    include, exclude = ("", spec) if as_exclude else (spec, "")
    try:
        with _bounded():
            active = select_resources(pool, num_nodes, num_procs, include, exclude, oversubscribe)
    except LaunchError:
        return
    assert active and list(active) == [h for h in pool if h in active], "hostfile order"
    for host, slots in active.items():
        assert slots == sorted(set(slots)) and slots, (host, slots)
        if num_procs > 0:
            assert slots == list(range(num_procs))
        else:
            assert all(0 <= s < pool[host] for s in slots), (host, slots)
    if num_nodes > 0:
        assert len(active) == num_nodes
