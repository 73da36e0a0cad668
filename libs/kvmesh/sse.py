"""Reading a server-sent-events stream of JSON chunks, as OpenAI-compatible servers stream
completions: `data: {...}` lines until `data: [DONE]` (other lines -- comments, event names,
blank separators -- are skipped)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator


async def json_events(lines: AsyncIterator[str]) -> AsyncIterator[dict]:
    """Each `data:` line's JSON object, in order, up to `[DONE]` (json.JSONDecodeError for a
    line that is not JSON)."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
