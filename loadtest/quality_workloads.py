"""The prompts of `kvmesh bench quality`: three workloads built from text this machine has offline,
each prompt deterministic, split into a dev set (for any tuning) and a test set (never tuned on).

* ``rag``: 4-6 passages of the Python language reference (``pydoc_data.topics``, cut at its
  section headings into passages of 150-650 tokens) in a shuffled order, labelled "Passage j",
  then a question generated from one of them (from its heading or its first words);
  1,500-2,700 tokens.
* ``chat``: a conversation of 3-6 user turns: 2-5 earlier turns each paste the docstring of a
  standard-library function or class and ask about it, answered by the docstring's own first
  paragraph (the assistant turns are text, not model-written); the last turn asks about one or
  two of them again; 900-2,600 tokens.
* ``longdoc``: one long document, the reference of a standard-library module (its docstring,
  then its public functions and classes with signatures and docstrings) of 1,500-2,400 tokens,
  and one of three questions generated from it (which member does what the member's summary line
  says; what a member does and takes; what the reference says about a member).

Every prompt is a chat in the model's own template (``tokenizer.apply_chat_template``, so with
its default system prompt), split into segments: documents (the passages; the pasted
docstrings; the module reference) and new text around them, each tokenized on its own -- what a
client sends as prompt parts, so the full prompt is the segments' concatenation and the same
document has the same token ids in every prompt.

Splits are by source, so the same text never appears in both: a passage's topic, a docstring's
module, a reference's module is hashed (blake2b of ``workload:source``), odd = test, even = dev;
every document of a prompt comes from its split's sources. Torch-free; only the tokenizer is
passed in.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import random
import re
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Optional, Protocol

WORKLOADS = ("rag", "chat", "longdoc")
SPLITS = ("dev", "test")
PROMPTS_PER_SPLIT = {"rag": 30, "chat": 24, "longdoc": 24}
QUESTIONS_PER_DOCUMENT = 3  # longdoc: questions asked of each module reference
PROMPT_TOKENS = {"rag": (1500, 2700), "chat": (900, 2600), "longdoc": (1600, 2800)}
PASSAGE_TOKENS = (150, 650)
LONGDOC_TOKENS = (1500, 2400)

# Disjoint module lists: longdoc references and chat docstrings never share a module.
LONGDOC_MODULES = (
    "argparse", "logging", "typing", "inspect", "doctest", "optparse", "pickle", "subprocess",
    "threading", "tarfile", "zipfile", "configparser", "difflib", "shutil", "tempfile", "email.message",
    "http.client", "urllib.parse", "unittest.case", "pathlib", "functools", "collections", "statistics",
    "fractions", "ipaddress", "calendar", "dataclasses", "enum", "contextlib", "ast", "traceback",
    "imaplib", "smtplib", "ftplib", "mailbox", "plistlib", "gettext", "pdb", "cmd", "xml.dom.minidom",
    "html.parser", "http.cookies", "http.server", "asyncio.tasks", "concurrent.futures._base",
    "multiprocessing.pool", "decimal", "datetime", "shelve", "filecmp", "fileinput", "reprlib",
)
CHAT_MODULES = (
    "json", "textwrap", "random", "heapq", "bisect", "string", "glob", "fnmatch", "pprint", "copy",
    "base64", "hmac", "secrets", "uuid", "operator", "tokenize", "shlex", "csv", "gzip", "bz2", "lzma",
    "html", "mimetypes", "locale", "warnings", "weakref", "types", "abc", "numbers", "queue", "sched",
    "socket", "selectors", "signal", "getopt", "codecs", "re", "struct", "timeit", "trace", "code",
    "stat", "graphlib", "zoneinfo", "os", "posixpath", "io", "itertools", "math", "sys", "time",
    "binascii", "zlib", "hashlib", "quopri", "netrc", "poplib", "wave", "colorsys", "linecache",
    "tabnanny", "pyclbr", "keyword", "token",
    "symtable", "dis", "pickletools", "sqlite3", "dbm", "webbrowser", "urllib.request", "wsgiref.util",
    "xml.etree.ElementTree", "email.utils", "email.header", "json.decoder", "json.encoder",
)

_MARK = re.compile("\x00(\\d+)\x00")


class ChatTokenizer(Protocol):
    """What the builders need of kvmesh.model.tokenizer.Tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True)
class QualityPrompt:
    """One prompt: its segments in order -- (token ids, is a document) -- and, per document
    segment, the document's id (the same text has the same id and ids in every prompt)."""

    id: str
    workload: str
    split: str
    segments: tuple[tuple[tuple[int, ...], bool], ...]
    documents: tuple[str, ...]
    source: str
    """What the question is about (a passage, a docstring, a module reference)."""
    question: str

    @property
    def token_ids(self) -> list[int]:
        return [t for ids, _ in self.segments for t in ids]

    def document_segments(self) -> list[tuple[str, tuple[int, ...]]]:
        """(document id, token ids) of each document segment, in prompt order."""
        return list(zip(self.documents, [ids for ids, is_doc in self.segments if is_doc]))


def split_of(workload: str, source: str) -> str:
    """The split of every prompt built from `source` (stable: a hash of the name, not an order)."""
    h = hashlib.blake2b(f"{workload}:{source}".encode(), digest_size=8, person=b"kvmesh-quality").digest()
    return "test" if h[0] & 1 else "dev"


def build_prompts(tok: ChatTokenizer, splits: tuple[str, ...] = SPLITS) -> list[QualityPrompt]:
    """Every prompt of `splits`, in a fixed order (workload, split, index)."""
    builder = _Builder(tok)
    out: list[QualityPrompt] = []
    for workload in WORKLOADS:
        for split in splits:
            out += getattr(builder, workload)(split, PROMPTS_PER_SPLIT[workload])
    return out


# ---- sources ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Text:
    id: str
    source: str  # what decides the split
    title: str
    text: str


_HEADING = re.compile(r"^([^\n]+)\n([=\-*~^])\2{2,}\n", re.M)


def _topic_blocks(text: str) -> list[tuple[str, str]]:
    """(heading, block text including the heading) of one pydoc topic, at its RST headings."""
    starts = [m for m in _HEADING.finditer(text) if abs(len(m.group(0).split("\n")[1]) - len(m.group(1))) <= 2]
    if not starts:
        return [(text.split("\n", 1)[0], text)]
    blocks = []
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        blocks.append((m.group(1).strip(), text[m.start():end].strip()))
    return blocks


def _paragraphs(text: str) -> list[str]:
    return [p for p in text.split("\n\n") if p.strip()]


class _Builder:
    def __init__(self, tok: ChatTokenizer) -> None:
        self.tok = tok
        self._ids: dict[str, tuple[int, ...]] = {}

    def n(self, text: str) -> int:
        return len(self.tok.encode(text))

    def doc_ids(self, doc: _Text) -> tuple[int, ...]:
        if doc.id not in self._ids:
            self._ids[doc.id] = tuple(self.tok.encode(doc.text))
        return self._ids[doc.id]

    def render(self, messages: list[dict[str, str]], docs: list[_Text]) -> tuple[tuple, tuple[str, ...]]:
        """Segments of `messages` in the chat template, whose contents hold "\\x00j\\x00" where
        document j goes."""
        pieces = _MARK.split(self.tok.apply_chat_template(messages))
        segments, names = [], []
        for k, piece in enumerate(pieces):
            if k % 2:
                doc = docs[int(piece)]
                segments.append((self.doc_ids(doc), True))
                names.append(doc.id)
            elif piece:
                segments.append((tuple(self.tok.encode(piece)), False))
        return tuple(segments), tuple(names)

    def prompt(self, workload: str, split: str, i: int, messages, docs, source: str, question: str,
               ) -> Optional[QualityPrompt]:
        """The prompt, or None when its size is out of PROMPT_TOKENS[workload]."""
        segments, names = self.render(messages, docs)
        lo, hi = PROMPT_TOKENS[workload]
        if not lo <= sum(len(ids) for ids, _ in segments) <= hi:
            return None
        return QualityPrompt(f"{workload}-{split}-{i:03d}", workload, split, segments, names, source, question)

    # ---- rag --------------------------------------------------------------------------------

    @cached_property
    def passages(self) -> tuple[_Text, ...]:
        """Passages of pydoc_data.topics: blocks under one heading, small ones merged with the
        next, large ones cut at paragraphs; PASSAGE_TOKENS long."""
        from pydoc_data.topics import topics

        lo, hi = PASSAGE_TOKENS
        out = []
        for topic in sorted(topics):
            pieces: list[tuple[str, str]] = []
            for title, block in _topic_blocks(topics[topic]):
                if pieces and self.n(pieces[-1][1]) < lo:  # too small alone: joins the next block
                    pieces[-1] = (pieces[-1][0], pieces[-1][1] + "\n\n" + block)
                    continue
                pieces.append((title, block))
            for title, block in pieces:
                part, size = [], 0
                for para in _paragraphs(block) + [None]:
                    m = self.n(para) + 2 if para is not None else 0
                    if part and (para is None or size + m > hi):
                        body = "\n\n".join(part)
                        if lo <= size <= hi:
                            out.append(_Text(f"{topic}#{len(out)}", topic, title, body))
                        part, size = [f"{title} (continued)"], self.n(title) + 4
                    if para is not None:
                        part.append(para)
                        size += m
        return tuple(out)

    def rag(self, split: str, count: int) -> list[QualityPrompt]:
        pool = [p for p in self.passages if split_of("rag", p.source) == split]
        targets = list(pool)
        random.Random(f"rag-{split}").shuffle(targets)
        out: list[QualityPrompt] = []
        for i in range(count):
            target = targets[i % len(targets)]
            rng = random.Random(f"rag-{split}-{i}")
            for _ in range(200):
                k = rng.randint(4, 6)
                docs = rng.sample([p for p in pool if p.id != target.id], k - 1) + [target]
                rng.shuffle(docs)
                question = _rag_question(target, rng)
                body = "\n\n".join(f"Passage {j + 1}:\n\x00{j}\x00" for j in range(len(docs)))
                content = ("Answer the question from these passages of the Python language reference.\n\n"
                           f"{body}\n\nQuestion: {question}")
                p = self.prompt("rag", split, i, [{"role": "user", "content": content}], docs, target.id, question)
                if p is not None:
                    out.append(p)
                    break
        return out

    # ---- chat -------------------------------------------------------------------------------

    @cached_property
    def docstrings(self) -> tuple[_Text, ...]:
        """Docstrings (300-1,500 characters, cut at a paragraph) of public functions and classes
        of CHAT_MODULES."""
        out = []
        for mod, name, _, doc in _members(CHAT_MODULES, min_chars=300):
            out.append(_Text(f"{mod}.{name}", mod, f"{mod}.{name}", _cut(doc, 1500)))
        return tuple(out)

    def chat(self, split: str, count: int) -> list[QualityPrompt]:
        pool = [d for d in self.docstrings if split_of("chat", d.source) == split]
        out: list[QualityPrompt] = []
        for i in range(count):
            rng = random.Random(f"chat-{split}-{i}")
            for _ in range(200):
                docs = rng.sample(pool, rng.randint(2, 5))
                messages = []
                for j, d in enumerate(docs):
                    messages += [{"role": "user", "content": f"Here is the documentation of `{d.title}`:\n\n"
                                                             f"\x00{j}\x00\n\n{rng.choice(_CHAT_ASKS)}"},
                                 {"role": "assistant", "content": _paragraphs(d.text)[0][:400]}]
                about = rng.choice(docs)
                other = rng.choice([d for d in docs if d is not about])
                question = rng.choice(_CHAT_FINAL).format(a=about.title, b=other.title)
                messages.append({"role": "user", "content": question})
                p = self.prompt("chat", split, i, messages, docs, about.id, question)
                if p is not None:
                    out.append(p)
                    break
        return out

    # ---- longdoc ----------------------------------------------------------------------------

    @cached_property
    def references(self) -> tuple[tuple[_Text, tuple[tuple[str, str], ...]], ...]:
        """Module references of LONGDOC_TOKENS and the (member, summary line) pairs they list."""
        out = []
        lo, hi = LONGDOC_TOKENS
        for mod in LONGDOC_MODULES:
            try:
                module = importlib.import_module(mod)
            except ImportError:
                continue
            text = f"Reference of the Python module `{mod}`\n\n{_cut(inspect.getdoc(module) or '', 1200)}"
            size, listed = self.n(text), []
            for _, name, obj, doc in _members((mod,), min_chars=80, methods=True):
                entry = f"{name}{_signature(obj)}\n{_indent(_cut(doc, 900))}"
                m = self.n(entry) + 2
                if size + m > hi:
                    continue
                text, size = f"{text}\n\n{entry}", size + m
                listed.append((name, doc.split("\n", 1)[0].strip()))
            if size >= lo and len(listed) >= QUESTIONS_PER_DOCUMENT:
                out.append((_Text(f"module:{mod}", mod, mod, text), tuple(listed)))
        return tuple(out)

    def longdoc(self, split: str, count: int) -> list[QualityPrompt]:
        refs = [r for r in self.references if split_of("longdoc", r[0].source) == split]
        out: list[QualityPrompt] = []
        for i in range(count):
            ref, listed = refs[i // QUESTIONS_PER_DOCUMENT % len(refs)]
            q = i % QUESTIONS_PER_DOCUMENT
            # members early, in the middle and late in the document
            at = [len(listed) // 5, len(listed) // 2, len(listed) * 5 // 6][q]
            name, summary = listed[min(len(listed) - 1, at)]
            question = _longdoc_question(q, ref.title, name, summary)
            content = f"Read this module reference, then answer the question after it.\n\n\x000\x00\n\nQuestion: {question}"
            p = self.prompt("longdoc", split, i, [{"role": "user", "content": content}], [ref],
                            f"{ref.id}:{name}", question)
            if p is not None:
                out.append(p)
        return out


def _members(modules, min_chars: int, methods: bool = False) -> list[tuple[str, str, Any, str]]:
    """(module, qualified name, object, docstring) of the public functions and classes each
    module defines (and, with `methods`, each class's public methods after it)."""
    out = []
    for mod in modules:
        try:
            module = importlib.import_module(mod)
        except ImportError:
            continue
        with warnings.catch_warnings():  # typing's deprecated io/re aliases warn when read
            warnings.simplefilter("ignore", DeprecationWarning)
            out += _module_members(module, min_chars, methods)
    return out


def _module_members(module, min_chars: int, methods: bool) -> list[tuple[str, str, Any, str]]:
    mod = module.__name__
    out = []
    for name in sorted(vars(module)):
        obj = getattr(module, name)
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isroutine(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        doc = inspect.getdoc(obj) or ""
        if len(doc) >= min_chars:
            out.append((mod, name, obj, doc))
        if methods and inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                fn = vars(obj)[attr]
                if attr.startswith("_") or not inspect.isfunction(fn):
                    continue
                doc = inspect.getdoc(fn) or ""
                if len(doc) >= min_chars:
                    out.append((mod, f"{name}.{attr}", fn, doc))
    return out


def _cut(text: str, chars: int) -> str:
    """`text` cut at the last paragraph (else line) break before `chars`."""
    if len(text) <= chars:
        return text
    cut = text.rfind("\n\n", 0, chars)
    if cut < chars // 3:
        cut = text.rfind("\n", 0, chars)
    return text[:cut if cut > chars // 3 else chars].rstrip()


def _indent(text: str) -> str:
    return "\n".join("    " + line if line else "" for line in text.split("\n"))


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _first_words(text: str, n: int) -> str:
    for para in _paragraphs(text):
        line = para.strip()
        if line and not para.startswith(" ") and not set(line.split("\n")[-1]) <= set("=-*~^"):
            words = line.split()
            if len(words) >= n:
                return " ".join(words[:n])
    return " ".join(text.split()[:n])


def _rag_question(p: _Text, rng: random.Random) -> str:
    body = p.text.split("\n", 2)[-1] if not p.title.endswith("(continued)") else p.text
    kind = rng.randrange(3)
    if kind == 0:
        return f"What does the passage on “{p.title}” say? Summarize it in two sentences."
    if kind == 1:
        return f"Which passage explains {p.title[:1].lower() + p.title[1:]}, and what are its main points?"
    return f"One passage contains the words “{_first_words(body, 8)}”. What is that passage about?"


_CHAT_ASKS = ("What does it do?", "Can you summarize this?", "When would I use it?",
              "Explain this in plain words.")
_CHAT_FINAL = (
    "Going back to `{a}`: which arguments does it take, and what does it return?",
    "What is the difference between `{a}` and `{b}`?",
    "Show me a short example that uses `{a}`.",
    "Which of the two, `{a}` or `{b}`, would you use to process text, and why?",
)


def _longdoc_question(kind: int, module: str, name: str, summary: str) -> str:
    usable = summary and "(" not in summary and len(summary) < 140 and summary[:1].isupper()
    if kind == 0 and usable:
        task = summary[:1].lower() + summary[1:].rstrip(".")
        return f"Which function or class of `{module}` would I use to {task}? Name it and say how to call it."
    if kind == 2:
        return f"What does the reference say about `{name}`? Quote the relevant part."
    return f"According to the reference, what does `{module}.{name}` do, and which arguments does it take?"
