"""A ring's shape: the same rule and the same words as the gpipe CLI (issue 32, points 4-6).

Each refusal is a ValueError whose message starts with the argument's name, followed by the
words `gpipe produce` prints after the flag's name.
"""

from __future__ import annotations

import os
import subprocess

import pytest

import gpipe

GIB = 1 << 30
# The limits, as pipeline_core::limits states them (and the CLI's messages print them).
MAX_SLOT_BYTES = 64 * GIB
MAX_SLOTS = 4096
MAX_CONSUMERS = 63


def refused(sock, **kwargs) -> str:
    with pytest.raises(ValueError) as e:
        gpipe.Producer(sock, backend="host", **kwargs)
    assert not os.path.exists(sock), "the socket was bound before the refusal"
    return str(e.value)


def test_a_batch_of_zero_bytes_is_refused_naming_the_argument(sock):
    msg = refused(sock, batch_bytes=0)
    assert msg.startswith("batch_bytes: "), msg
    assert "0 bytes" in msg


@pytest.mark.parametrize(
    "kwargs, argument, words",
    [
        ({"batch_bytes": 100 * GIB}, "batch_bytes", "at most 64 GiB"),
        ({"slots": MAX_SLOTS + 1}, "slots", f"at most {MAX_SLOTS} slots"),
        ({"max_consumers": MAX_CONSUMERS + 1}, "max_consumers", f"at most {MAX_CONSUMERS}"),
    ],
)
def test_each_limit_is_named_in_words_and_units(sock, kwargs, argument, words):
    msg = refused(sock, **kwargs)
    assert msg.startswith(f"{argument}: "), msg
    assert words in msg, msg
    assert "..=" not in msg and "multiple" not in msg, msg


def test_a_ring_larger_than_host_memory_is_refused_with_the_numbers(sock):
    msg = refused(sock, slots=MAX_SLOTS, batch_bytes=MAX_SLOT_BYTES)
    for part in (f"{MAX_SLOTS} slots × 64 GiB = 256 TiB", "available host memory", "fewer slots"):
        assert part in msg, msg


@pytest.mark.parametrize(
    "kwargs, flags",
    [
        ({"batch_bytes": 0}, ["--batch-bytes", "0"]),
        ({"batch_bytes": 100 * GIB}, ["--batch-bytes", "100GiB"]),
        ({"slots": MAX_SLOTS + 1}, ["--slots", str(MAX_SLOTS + 1)]),
        ({"max_consumers": MAX_CONSUMERS + 1}, ["--max-consumers", str(MAX_CONSUMERS + 1)]),
    ],
)
def test_the_cli_says_the_same_words(sock, gpipe_bin, kwargs, flags):
    msg = refused(sock, **kwargs)
    out = subprocess.run(
        [gpipe_bin, "produce", "--backend", "host", "--socket", sock, *flags],
        capture_output=True, text=True, timeout=30,
    )
    assert out.returncode != 0
    words = msg.split(": ", 1)[1]
    assert f"{flags[0]}: {words}" in out.stderr, (msg, out.stderr)
