"""Server-sent events: what the server writes survives line-splitting clients, and
the benchmarks' reader splits lines as the SSE format does (CRLF, LF or CR only)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from hypothesis import example, given
from hypothesis import strategies as st
from kvpage.bench.sse import SSEEvents, sse_lines
from kvpage.openai.sse_events import ChunkTemplate, sse_event

# Characters JSON may leave raw that str.splitlines (and httpx's aiter_lines) break at.
SEPARATORS = "\u2028\u2029\x85"
TEXT = "a\u2028b\u2029c\x85d\ne\rf\x1cg"


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@given(
    st.fixed_dictionaries({"id": st.text(), "object": st.sampled_from(["text_completion", "%s"]),
                           "created": st.integers(0, 2**40), "model": st.text()}),
    st.dictionaries(st.text(), _JSON_VALUES, max_size=6),
)
@example({"id": "100%s", "object": "%%", "created": 1, "model": "m%d"},
         {"index": 0, "te%sxt": "50%s \u2028", "delta": {"content": "%"}, "logprobs": None})
def test_a_chunk_template_writes_what_json_dumps_writes(fixed: dict, choice: dict) -> None:
    expected = sse_event({**fixed, "choices": [choice]})
    assert ChunkTemplate(fixed, list(choice)).event(*choice.values()) == expected
    payload = json.dumps({**fixed, "choices": [choice]}, ensure_ascii=False,
                         separators=(",", ":"))
    escaped = payload.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029") \
        .replace("\x85", "\\u0085")
    assert expected == b"data: " + escaped.encode() + b"\n\n"


def test_events_have_no_raw_line_separators_and_keep_their_text() -> None:
    event = sse_event({"choices": [{"text": TEXT}]})
    decoded = event.decode()
    assert not any(ch in decoded for ch in SEPARATORS)
    lines = decoded.splitlines()
    assert lines[0].startswith("data: ") and lines[1:] == [""]
    assert json.loads(lines[0][6:])["choices"][0]["text"] == TEXT
    plain = sse_event({"text": "héllo 🙂"}).decode()
    assert "héllo 🙂" in plain, "other non-ASCII text stays as it is"


async def _chunks(text: str, cuts: list[int]) -> AsyncIterator[str]:
    start = 0
    for cut in sorted(set(cuts)):
        yield text[start:cut]
        start = cut
    yield text[start:]


def _lines(text: str, cuts: list[int]) -> list[str]:
    async def collect() -> list[str]:
        return [line async for line in sse_lines(_chunks(text, cuts))]

    return asyncio.run(collect())


@given(
    st.lists(st.text(alphabet="ab\u2028\x85é", max_size=6), min_size=1, max_size=6),
    st.lists(st.sampled_from(["\n", "\r", "\r\n"]), min_size=6, max_size=6),
    st.lists(st.integers(0, 60), max_size=8),
)
def test_lines_end_only_at_cr_lf_or_crlf_wherever_the_chunks_are_cut(
    lines: list[str], ends: list[str], cuts: list[int]
) -> None:
    ends = ends[: len(lines)]
    # A CR, then an empty line ended by LF, reads as CRLF: end such lines with LF, from
    # the last one back (a change can make the line before it such a line too).
    for i in reversed(range(len(lines) - 1)):
        if ends[i] == "\r" and lines[i + 1] == "" and ends[i + 1].startswith("\n"):
            ends[i] = "\n"
    text = "".join(line + end for line, end in zip(lines, ends, strict=True))
    cuts = [min(cut, len(text)) for cut in cuts]
    assert _lines(text, cuts) == lines


class _FakeResponse:
    def __init__(self, body: str, cuts: list[int]) -> None:
        self.body, self.cuts = body, cuts

    def aiter_text(self) -> AsyncIterator[str]:
        return _chunks(self.body, self.cuts)


def test_reader_parses_events_with_raw_separators_from_any_server() -> None:
    raw = json.dumps({"text": TEXT}, ensure_ascii=False)  # a server that does not escape
    body = f": comment\r\ndata: {raw}\r\n\r\ndata:{raw}\n\ndata: [DONE]\n\n"

    async def read() -> tuple[list[dict], bool]:
        events = SSEEvents(_FakeResponse(body, [3, 17, 40, len(body) - 5]))
        return [event async for event in events], events.done

    events, done = asyncio.run(read())
    assert [e["text"] for e in events] == [TEXT, TEXT] and done
