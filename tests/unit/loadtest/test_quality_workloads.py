"""The quality benchmark's prompts, on the real tokenizer: enough of them, in three workloads, the
right sizes, segments that make the prompt, and dev/test splits that are stable and share no
source."""
import pytest

from kvmesh.loadtest import quality_workloads as qw


@pytest.fixture(scope="module")
def tokenizer():
    from kvmesh.model.loader import load_tokenizer

    return load_tokenizer("bundled", progress=False)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return qw.build_prompts(tokenizer)


def test_at_least_150_prompts_in_three_workloads_and_both_splits(prompts):
    assert len(prompts) >= 150
    assert {p.workload for p in prompts} == set(qw.WORKLOADS)
    for workload in qw.WORKLOADS:
        for split in qw.SPLITS:
            assert sum(p.workload == workload and p.split == split for p in prompts) == qw.PROMPTS_PER_SPLIT[workload]
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({tuple(p.token_ids) for p in prompts}) == len(prompts)  # no prompt twice


def test_the_same_prompts_every_time(tokenizer, prompts):
    assert qw.build_prompts(tokenizer, ("test",)) == [p for p in prompts if p.split == "test"]


def test_split_is_a_stable_hash_of_the_source():
    # Pinned: a change here silently moves prompts between the tuning and the reported set.
    assert [qw.split_of("rag", "for"), qw.split_of("rag", "calls"), qw.split_of("chat", "json"),
            qw.split_of("longdoc", "logging")] == ["dev", "dev", "test", "test"]


def _source(workload: str, doc_id: str) -> str:
    return {"rag": lambda d: d.split("#")[0], "chat": lambda d: d.rsplit(".", 1)[0],
            "longdoc": lambda d: d.removeprefix("module:")}[workload](doc_id)


def test_splits_share_no_document_and_no_source(prompts):
    for workload in qw.WORKLOADS:
        docs = {split: {d for p in prompts if p.workload == workload and p.split == split for d in p.documents}
                for split in qw.SPLITS}
        assert docs["dev"] and docs["test"] and not docs["dev"] & docs["test"]
        for p in (p for p in prompts if p.workload == workload):
            assert {qw.split_of(workload, _source(workload, d)) for d in p.documents} == {p.split}, p.id


def test_sizes_and_shapes(prompts, tokenizer):
    for p in prompts:
        lo, hi = qw.PROMPT_TOKENS[p.workload]
        assert lo <= len(p.token_ids) <= hi, p.id
        n_docs = len(p.documents)
        if p.workload == "rag":
            assert 4 <= n_docs <= 6
        elif p.workload == "chat":
            assert 2 <= n_docs <= 5
            assert tokenizer.decode(p.token_ids, skip_special_tokens=False).count("<|im_start|>user") == n_docs + 1
        else:
            assert n_docs == 1 and len(p.document_segments()[0][1]) >= qw.LONGDOC_TOKENS[0]


def test_segments_make_the_prompt_in_the_chat_template(prompts, tokenizer):
    by_doc: dict[str, tuple[int, ...]] = {}
    for p in prompts:
        assert p.token_ids == [t for ids, _ in p.segments for t in ids]
        assert sum(is_doc for _, is_doc in p.segments) == len(p.documents)
        assert not p.segments[-1][1]  # the prompt ends in new text: the last token is computed
        text = tokenizer.decode(p.token_ids, skip_special_tokens=False)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert p.question in text
        for doc_id, ids in p.document_segments():
            assert by_doc.setdefault(doc_id, ids) == ids  # a document is the same tokens everywhere
