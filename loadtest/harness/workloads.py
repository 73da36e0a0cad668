"""Seeded request generators for `kvmesh loadtest`: what load looks like where KV reuse matters,
and a control where it does not.

  random         independent prompts of random words (the control: nothing to reuse)
  shared-prefix  a few long system prompts, each request one of them + its own question
  multiturn      chat sessions that grow: each turn resends the whole conversation so far,
                 with the assistant's real answers (the runner fills them in)
  rag            a pool of documents, each request citing k of them in a random order + a
                 question (kvmesh's `documents` extension where the target has it, else the
                 same text inlined the way the gateway places documents)
  trace FILE     a replay of a Mooncake-format trace (JSONL: timestamp ms, input_length,
                 output_length, hash_ids; see `read_trace`)

Lengths are in words of a fixed English word list (about 1.2 tokens each for SmolLM2's
tokenizer); the server's usage reports the real token counts. `seed` fixes what is meant to be
shared (system prompts, the document pool); `variant` (the level of a sweep) changes each
request's own part, so a level never finds the previous level's exact requests cached.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

WORDS = tuple("""the of and to in is was that for on with as by at from his her they this which are be or had
one not but all were when we there can an their what so if would about into more other has time some could
them these two may then first any my now such like our over man me even most made after also did many before
must through back years where much your way well down should because each just those people how too little
state good very make world still own see men work long get here between both life being under never day same
another know while last might us great old year off come since against go came right used take three city
water river stone light north wind field house music bread glass metal paper garden market engine winter summer
island valley forest harbor bridge tower letter number question answer story method system signal energy
""".split())

WORKLOADS = ("random", "shared-prefix", "multiturn", "rag", "mixed", "trace")


@dataclass
class LoadRequest:
    """One request of a workload (its arrival time comes from the schedule, or the trace)."""

    messages: list[dict]
    """Chat messages; for a multi-turn session, only the new user turn (the runner prepends the
    conversation so far)."""
    max_tokens: int
    session: Optional[str] = None
    """Turns of one session are sent in order, each after the previous one's answer."""
    documents: tuple[str, ...] = ()
    """Documents the request cites, in order (rag)."""
    arrival: Optional[float] = None
    """Seconds from the start, for a trace replay (None: the schedule decides)."""
    tags: dict = field(default_factory=dict)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _question(rng: random.Random, n: int) -> str:
    return f"{_words(rng, n).capitalize()}?"


def random_prompts(n: int, *, seed: int, variant: int = 0, prompt_words: int = 200,
                   max_tokens: int = 64) -> list[LoadRequest]:
    rng = random.Random(f"{seed}/{variant}")
    return [LoadRequest([{"role": "user", "content": _words(rng, rng.randint(prompt_words // 2, prompt_words))}],
                        max_tokens) for _ in range(n)]


def shared_prefix(n: int, *, seed: int, variant: int = 0, prefixes: int = 4, prefix_words: int = 400,
                  question_words: int = 24, max_tokens: int = 64) -> list[LoadRequest]:
    shared = random.Random(seed)
    systems = [f"You are assistant {i}. {_words(shared, prefix_words)}" for i in range(prefixes)]
    rng = random.Random(f"{seed}/{variant}")
    out = []
    for _ in range(n):
        i = rng.randrange(prefixes)
        out.append(LoadRequest([{"role": "system", "content": systems[i]},
                                {"role": "user", "content": _question(rng, question_words)}],
                               max_tokens, tags={"prefix": i}))
    return out


def multiturn(n: int, *, seed: int, variant: int = 0, sessions: int = 8, first_words: int = 400,
              turn_words: int = 30, max_tokens: int = 64) -> list[LoadRequest]:
    """`n` turns spread over `sessions` conversations (turn t of every session before turn t+1
    of any, so all sessions grow together); the first turn is long (a pasted text of about 500
    tokens), later ones short follow-ups."""
    rng = random.Random(f"{seed}/{variant}")
    out: list[LoadRequest] = []
    turn = 0
    while len(out) < n:
        for s in range(sessions):
            if len(out) == n:
                break
            text = _words(rng, first_words) if turn == 0 else _question(rng, turn_words)
            out.append(LoadRequest([{"role": "user", "content": text}], max_tokens, session=f"v{variant}s{s}",
                                   tags={"turn": turn}))
        turn += 1
    return out


def rag(n: int, *, seed: int, variant: int = 0, pool: int = 12, doc_words: int = 250, cite: int = 3,
        question_words: int = 20, max_tokens: int = 64) -> list[LoadRequest]:
    shared = random.Random(seed)
    docs = [f"Document {i}. {_words(shared, doc_words)}" for i in range(pool)]
    rng = random.Random(f"{seed}/{variant}")
    out = []
    for _ in range(n):
        chosen = rng.sample(range(pool), cite)  # a random subset, in a random order
        out.append(LoadRequest([{"role": "user", "content": _question(rng, question_words)}], max_tokens,
                               documents=tuple(docs[i] for i in chosen), tags={"documents": chosen}))
    return out


def mixed(n: int, *, seed: int, variant: int = 0, long_every: int = 8, long_words: int = 3000,
          short_words: int = 40, max_tokens: int = 64) -> list[LoadRequest]:
    """Many short chats with a long prompt (about 4,000 tokens: a pasted document to summarise)
    every `long_every` requests, starting with a short one; no two prompts share a prefix. The
    workload of prefill/decode disaggregation: a long prefill stalls every decode beside it.
    Requests are tagged {"class": "long"|"short"}, and the report gives each class its own
    line as well."""
    rng = random.Random(f"{seed}/{variant}")
    out = []
    for i in range(n):
        if i % long_every == long_every - 1:
            text = f"Summarise this text. {_words(rng, long_words)}"
            out.append(LoadRequest([{"role": "user", "content": text}], max_tokens, tags={"class": "long"}))
        else:
            out.append(LoadRequest([{"role": "user", "content": _question(rng, short_words)}], max_tokens,
                                   tags={"class": "short"}))
    return out


def inline_documents(messages: list[dict], documents: tuple[str, ...]) -> list[dict]:
    """The request with its documents written into the last user message, each followed by a
    blank line, at its start: where kvmesh's gateway places `documents` (so both targets see the
    same prompt text)."""
    if not documents:
        return messages
    out = [dict(m) for m in messages]
    last = max(i for i, m in enumerate(out) if m["role"] == "user")
    out[last]["content"] = "".join(f"{d}\n\n" for d in documents) + out[last]["content"]
    return out


def read_trace(path: str | Path, *, max_tokens_cap: int = 512, block_words: int = 400,
               limit: Optional[int] = None) -> list[LoadRequest]:
    """A Mooncake trace (FAST'25; one JSON object per line): `timestamp` (ms from the start),
    `input_length` and `output_length` (tokens), `hash_ids` (one id per 512-token block of the
    prompt: equal ids = equal blocks, so prompts that share leading ids share a prefix). Each id
    becomes a deterministic block of `block_words` words, the prompt is cut to input_length
    words, and max_tokens = output_length (capped). Optional fields beyond Mooncake's:
    `session_id` (turns sent in order) and `prompt` (the text itself)."""
    out: list[LoadRequest] = []
    for line_no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            arrival = float(row["timestamp"]) / 1000.0
            length = int(row["input_length"])
            max_tokens = max(1, min(int(row["output_length"]), max_tokens_cap))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{line_no}: not a Mooncake trace row ({e}); need timestamp (ms), "
                             "input_length and output_length") from None
        text = row.get("prompt")
        if text is None:
            blocks = [_words(random.Random(f"block-{h}"), block_words) for h in row.get("hash_ids", [])]
            words = " ".join(blocks).split()
            if len(words) < length:  # no ids, or too few: fill from this row's own seed
                words += _words(random.Random(f"row-{line_no}"), length - len(words)).split()
            text = " ".join(words[:length])
        session = row.get("session_id")
        out.append(LoadRequest([{"role": "user", "content": text}], max_tokens,
                               session=str(session) if session is not None else None, arrival=arrival))
        if limit is not None and len(out) >= limit:
            break
    out.sort(key=lambda r: r.arrival)
    return out


def make(name: str, n: int, *, seed: int, max_tokens: int, trace: Optional[str] = None,
         variant: int = 0, sessions: Optional[int] = None) -> list[LoadRequest]:
    """Workload `name` with `n` requests (a trace: its first n rows, whatever the variant);
    `sessions`: the number of conversations of the multiturn workload (its default otherwise)."""
    if name == "trace":
        if not trace:
            raise ValueError("the trace workload needs --trace FILE (Mooncake JSONL)")
        return read_trace(trace, max_tokens_cap=max_tokens, limit=n)
    makers = {"random": random_prompts, "shared-prefix": shared_prefix, "multiturn": multiturn, "rag": rag,
              "mixed": mixed}
    if name not in makers:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if sessions is not None:
        if name != "multiturn":
            raise ValueError(f"--sessions applies to the multiturn workload only, not {name!r}")
        if sessions < 1:
            raise ValueError(f"--sessions must be at least 1, got {sessions}")
        return multiturn(n, seed=seed, variant=variant, max_tokens=max_tokens, sessions=sessions)
    return makers[name](n, seed=seed, variant=variant, max_tokens=max_tokens)
