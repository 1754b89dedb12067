"""Chapter 08's committed recording still describes what the real vLLM does.

The chapter replays ``data/recordings/vllm_ch08_*`` under nbval, without vLLM. This test
records the same session again on a fresh real server (``make vllm``; skipped without it,
except in CI) and compares what must not drift: the answers, the cached tokens and the
structure of the KV events (block counts, parents, token ids), not timestamps or hash values.
The session's server (the ``vllm_server`` fixture of tests/conftest.py) records it right
after its start, before tests/test_vllm_events.py uses it.
"""

import pytest
import servers

from minirad.course import recordings


@pytest.fixture(scope="module")
def fresh(vllm_server):
    _server, recording = vllm_server
    return recording


def test_answers_and_cached_tokens_are_the_committed_ones(fresh):
    committed = recordings.load()
    assert [o.request for o in fresh.outputs] == list(recordings.CHAPTER_REQUESTS)
    for new, old in zip(fresh.outputs, committed.outputs, strict=True):
        assert new.prompt_token_ids == old.prompt_token_ids
        assert new.token_ids == old.token_ids and new.text == old.text
        assert new.cached_tokens == old.cached_tokens


def test_events_have_the_committed_structure(fresh):
    committed = recordings.load()
    assert recordings.structure(fresh.batches) == recordings.structure(committed.batches)
    assert len(fresh.batches) == len(committed.batches)


def test_structure_sees_parents_and_ignores_hash_values():
    """The comparison can fail: another parent or other tokens change it, hash values do not."""
    batches = recordings.load().batches
    base = recordings.structure(batches)
    renamed = [
        (seq, type(b)(b.ts + 1.0, [_rehash(e) for e in b.events], b.data_parallel_rank))
        for seq, b in batches
    ]
    assert recordings.structure(renamed) == base
    first = batches[0][1].events[0]
    broken = [
        (0, type(batches[0][1])(0.0, [_replace(first, token_ids=[0] * len(first.token_ids))]))
    ]
    assert recordings.structure(broken) != recordings.structure(batches[:1])


def _rehash(event):
    if not hasattr(event, "block_hashes"):
        return event
    changes = {"block_hashes": [h ^ 0x5A5A for h in event.block_hashes]}
    if getattr(event, "parent_block_hash", None) is not None:
        changes["parent_block_hash"] = event.parent_block_hash ^ 0x5A5A
    return _replace(event, **changes)


def _replace(event, **changes):
    import msgspec

    return msgspec.structs.replace(event, **changes)


def test_vllms_start_says_each_stage(vllm_server):
    """The log lines ``VLLMServer.stages`` looks for are the ones vLLM 0.32 prints."""
    servers.check_start_lines(vllm_server[0])
