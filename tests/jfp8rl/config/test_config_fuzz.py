"""Fuzzed command-line overrides: each one loads, or is a one-line `ConfigError` naming its key
(`train.mesh.data`, or `train.mesh` and `data`) or quoting the override; never another
exception, never a traceback.

Overrides mix every real key (and typos, sub-keys, whole sections, unknown keys, no `=`)
with values of every YAML kind (numbers out of range, NaN, lists, maps, interpolations,
unbalanced quotes and brackets, YAML tags, random text). Deterministic (derandomized, no
example database) and bounded: CASES overrides, each within DEADLINE.
"""

from __future__ import annotations

import collections
import dataclasses
from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jfp8rl.config import Config, ConfigError, load_config

CASES = 100
DEADLINE = timedelta(seconds=2)


def dotted_keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(
            default := f.default_factory()
        ):
            out += dotted_keys(type(default), f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


KEYS = dotted_keys(Config)
SECTIONS = sorted({k.split(".")[0] for k in KEYS if "." in k})
NAME = st.text("abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=8)
KEY = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(KEYS).map(lambda k: k + "x"),  # a typo
    st.sampled_from(KEYS).map(lambda k: k + ".sub"),  # below a leaf
    st.builds(lambda s, n: f"{s}.{n}", st.sampled_from(SECTIONS), NAME),  # unknown field
    st.sampled_from(SECTIONS),  # a whole section
    NAME,
    st.just(""),
    st.text(min_size=1, max_size=12).filter(lambda s: "=" not in s),
)
VALUE = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats().map(repr),
    st.sampled_from(
        [
            "nan",
            ".nan",
            "inf",
            "-inf",
            "1e309",
            "1e-400",
            "-0",
            "0x10",
            "1_000",
            "true",
            "false",
            "null",
            "~",
            "None",
            "???",
            "[]",
            "[1, 2]",
            "[a, b]",
            "{}",
            "{a: 1}",
            "'x'",
            '"',
            "'",
            "{",
            "}",
            ":",
            "a: b",
            "- x",
            "&a",
            "*a",
            "%",
            "@",
            "`",
            "|",
            ">",
            "!!binary x",
            "!!python/object:os.system",
            "${oc.env:HOME}",
            "${nonexistent}",
            "${optim.lr}",
            "${oc.decode:'[1]'}",
            "${oc.create:{a: 1}}",
            "full",
            "size",
            "none",
            "bf16",
            "fp8_block",
            "http",
            "embedded",
            "grpo",
            "calibrated",
            "a\nb",
        ]
    ),  # fmt: skip
    st.text(max_size=20),
)
OVERRIDE = st.one_of(st.builds(lambda k, v: f"{k}={v}", KEY, VALUE), st.text(max_size=15))


def test_bad_overrides_are_one_line_errors_naming_the_key() -> None:
    outcomes: collections.Counter[str] = collections.Counter()

    @settings(
        max_examples=CASES, deadline=DEADLINE, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )  # fmt: skip
    @given(OVERRIDE)
    def one(override: str) -> None:
        try:
            load_config(None, [override])
        except ConfigError as e:
            msg, key = str(e), override.split("=", 1)[0]
            assert "\n" not in msg, (override, msg)
            parent, _, leaf = key.rpartition(".")
            named = key in msg or repr(override) in msg or (parent in msg and leaf in msg)
            assert named, (override, msg)
            outcomes["error"] += 1
        else:
            outcomes["loaded"] += 1

    one()
    print(f"config override fuzz: {sum(outcomes.values())} cases, {dict(outcomes)}")
    assert sum(outcomes.values()) >= CASES
