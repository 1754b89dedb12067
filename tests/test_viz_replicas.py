"""viz.replicas: several replicas' block caches side by side, and the router's choice.

The replicas here are minirad's own ``KVEventPublisher`` (real ZMQ sockets on 127.0.0.1,
vLLM's wire format); ``tests/test_routers.py`` drives the view with real workers behind a real
router.
"""

import json

import pytest
from test_viz_watch import live_nodes, stored, wait_for

import viz
from minirad.errors import InvalidArgumentError, KVEventError
from minirad.kv_events import BlockStored, KVEventPublisher
from viz.replicas import ReplicaCacheView, Route, prompt_label, replay_replicas
from viz.svg import side_by_side


def publisher() -> KVEventPublisher:
    return KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")


class Replica:
    """What :meth:`ReplicaCacheView.listen` reads off a worker."""

    name = "publisher"

    def __init__(self, pub: KVEventPublisher) -> None:
        self.kv_events_endpoint, self.replay_endpoint = pub.endpoint, pub.replay_endpoint
        self.base_url = pub.endpoint


def test_each_replica_has_its_own_tree_and_the_slider_follows_the_routes(tmp_path):
    pubs = [publisher(), publisher()]
    view = viz.watch_replicas([Replica(p) for p in pubs], model_dir=None)
    try:
        for v in view.views:
            wait_for(lambda v=v: v.status.startswith(f"{Replica.name} answering at"), "probes")
        pubs[0].publish([stored([1, 2])])
        wait_for(lambda: live_nodes(view.views[0]) == 2, "replica 0's blocks")
        view.add_route(Route(0, "first", 64, 0))
        pubs[1].publish([stored([7], first_token=300)])
        wait_for(lambda: live_nodes(view.views[1]) == 1, "replica 1's block")
        view.add_route(Route(1, "second", 32, 0))
        pubs[0].publish([stored([3], parent=2)])
        wait_for(lambda: live_nodes(view.views[0]) == 3, "replica 0's third block")
        view.add_route(Route(0, "third", 96, 64))
    finally:
        view.stop()
        for p in pubs:
            p.close()
    # The trees are apart: replica 1 never saw replica 0's blocks.
    assert [live_nodes(v) for v in view.views] == [3, 1]
    assert [r.replica for r in view.routes] == [0, 1, 0]
    # Request 1: replica 0 as it was after request 0 (2 blocks), replica 1 with its block.
    view.request.value = 1
    assert [len(v.frames[v.step].live) for v in view.views] == [2, 1]
    view.request.value = 0
    assert [len(v.frames[v.step].live) for v in view.views] == [2, 0]
    # What the browser does alone (the slider is jslinked to each player's `mark`): each
    # player's mark k is its frame of request k, the one the slider shows from Python.
    for i, v in enumerate(view.views):
        assert v.marks == [max(0, r.frames[i] - 1) for r in view.routes]
        v.mark = 1
        assert v.step == max(0, view.routes[1].frames[i] - 1)
    assert [r["prompt"] for r in view.request.routes] == ["first", "second", "third"]
    assert "3 requests (per replica [2, 1])" in repr(view)
    assert "64 of 192 prompt tokens cached" in repr(view)

    # Saved and replayed: the same frames in every tree, the same routes.
    path = view.save_recording(tmp_path / "routing.jsonl")
    again = replay_replicas(path, model_dir=None)
    assert again.routes == view.routes
    for a, b in zip(again.views, view.views, strict=True):
        assert [f.to_dict({}) for f in a.frames] == [f.to_dict({}) for f in b.frames]


def test_a_replicas_status_names_the_worker_it_is():
    """Our workers publish vLLM's wire format, but they are not vLLM: the status line says
    what each replica is, a ``minirad serve`` worker or a real vLLM server."""
    pubs = [publisher(), publisher()]
    workers = [Replica(p) for p in pubs]
    workers[0].name, workers[1].name = "minirad serve", "vLLM"
    view = viz.watch_replicas(workers, model_dir=None)
    try:
        for v, name in zip(view.views, ("minirad serve", "vLLM"), strict=True):
            wait_for(lambda v=v, n=name: v.status.startswith(f"{n} answering at"), name)
        pubs[0].close()  # no server behind replica 0 any more
        wait_for(
            lambda: view.views[0].status.startswith("no minirad serve answering at"), "no server"
        )
    finally:
        view.stop()
        pubs[1].close()
    assert "vLLM" not in view.views[0].status


def test_the_static_picture_shows_every_tree_and_the_route_table(tmp_path):
    view = ReplicaCacheView(["left", "right"], model_dir=None)
    view.receive(0, (0, _batch(stored([1]))))
    view.add_route(Route(0, "a prompt", 32, 0))
    data, _ = view._repr_mimebundle_()
    assert data["text/plain"] == repr(view)
    svg = data["image/svg+xml"]
    assert svg.count("<svg ") == 3 and ">left<" in svg and ">right<" in svg
    assert "a prompt" in svg and 'width="840"' in svg.split("\n")[0]


def test_a_bad_recording_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    head = json.dumps({"replicas": ["a", "b"]})
    route = {"replica": 0, "prompt": "p", "prompt_tokens": 1, "cached_tokens": 0}
    good = json.dumps({"route": route})
    for bad in (
        "[1, 2]",
        '{"seq": 0}',
        '{"replica": 0, "seq": -1, "ts": 0, "events": []}',
        '{"replica": 2, "seq": 0, "ts": 0, "events": []}',
        '{"replica": -1, "seq": 0, "ts": 0, "events": []}',
        '{"route": {"replica": 5, "prompt": "p", "prompt_tokens": 1, "cached_tokens": 0}}',
    ):
        path.write_text(f"{head}\n{good}\n{bad}\n")
        with pytest.raises(KVEventError, match=r"bad.jsonl:3:"):
            replay_replicas(path, model_dir=None)
    for text, reason in (("not json\n", ":1: not JSON"), (good + "\n", 'no {"replicas"')):
        path.write_text(text)
        with pytest.raises(KVEventError, match=reason):
            replay_replicas(path, model_dir=None)
    # Lines keep their numbers (blank lines count), and a bad value is named.
    path.write_text(f"{head}\n\n{good}\n{good.replace('0}', '-5}')}\n")
    with pytest.raises(KVEventError, match=r"bad.jsonl:4: .*token counts"):
        replay_replicas(path, model_dir=None)
    for bad_route in ({"cached_tokens": 9}, {"replica": True}, {"prompt": 3}):
        line = json.dumps({"route": route | bad_route})
        path.write_text(f"{head}\n{line}\n")
        with pytest.raises(KVEventError, match=r"bad.jsonl:2:"):
            replay_replicas(path, model_dir=None)
    path.write_text('{"replicas": [1, 2]}\n')
    with pytest.raises(KVEventError, match=r"bad.jsonl:1: names must be"):
        replay_replicas(path, model_dir=None)
    path.write_text(f"{head}\n{good}\n")
    with pytest.raises(InvalidArgumentError, match="1 names for 2 replicas"):
        replay_replicas(path, names=["a"], model_dir=None)
    # A replica that served nothing is still drawn: the header says there were two.
    assert len(replay_replicas(path, model_dir=None).views) == 2


def test_misuse_is_a_typed_error():
    for names in ([], "ab", ["a", 2]):
        with pytest.raises(InvalidArgumentError, match="names must be a non-empty list"):
            ReplicaCacheView(names, model_dir=None)
    with pytest.raises(InvalidArgumentError, match="no model folder"):
        ReplicaCacheView(["a"], model_dir="/nope")
    view = ReplicaCacheView(["a", "b"], model_dir=None)
    pub = publisher()
    try:
        with pytest.raises(InvalidArgumentError, match="1 workers for 2 replicas"):
            view.listen([Replica(pub)])
        silent = Replica(pub)
        silent.kv_events_endpoint = None
        with pytest.raises(InvalidArgumentError, match="publish no KV events"):
            view.listen([silent, silent])
    finally:
        pub.close()
    for bad in (2, -1, "0"):
        with pytest.raises(InvalidArgumentError, match="no replica"):
            view.add_route(Route(bad, "p", 1, 0))
    with pytest.raises(ValueError, match="headings"):
        side_by_side(["<svg/>"], [])


@pytest.mark.parametrize(
    ("body", "label"),
    [
        ({"prompt": "Notes 0:   red circle\nQ: where"}, "Notes 0: red circle Q: where"),
        ({"prompt": [1, 2, 3]}, "3 token ids"),
        ({"prompt": "x" * 50}, "x" * 39 + "…"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}, "Hi"),
    ],
)
def test_prompt_label(body, label):
    assert prompt_label(body) == label


def _batch(*events: BlockStored):
    from minirad.kv_events import KVEventBatch

    return KVEventBatch(ts=0.0, events=list(events))
