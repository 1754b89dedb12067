"""The visualizer follows a real vLLM server's KV events live, in JupyterLab in a real browser.

One vLLM server, one JupyterLab, one chromium (as in ``tests/test_browser.py``). A notebook
written here opens two ``viz.watch`` views before the server exists: one on the server's
endpoints, one on a wrong port. Both must say that no vLLM answers, and keep listening. Then
the server starts and gets chat requests with shipped images from this process; the first
view must say vLLM answers and draw every block vLLM cached (one node per 32-token block,
image chips where a block holds image tokens, a fork where two images part), while the other
still says no vLLM answers. Last, ``reset_prefix_cache`` and one more request: the view
clears (``AllBlocksCleared``) to that request's blocks alone.

What the view must draw comes from vLLM's replies, through a plain prefix-cache model (block
``i`` of a request is its first ``32 (i + 1)`` tokens that hold KV, with its image); the
model is checked against vLLM's own ``cached_tokens``. Needs the vLLM venv (``make vllm``):
skipped without it, except in CI; skipped without chromium or playwright. About 75-95 s on
2 cores (vLLM's start is most of it).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from browser_tools import (
    Console,
    cell_view,
    free_port,
    jupyter_lab,
    missing,
    run_all_cells,
    wait_for_view,
    write_notebook,
)

from minirad.kv_events.block_events import VLLM_BLOCK_SIZE
from minirad.peers.vllm_server import DEFAULT_MODEL_DIR, VLLMServer

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "data" / "images"
IMAGE_TOKEN = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["image_token_index"]
NOTEBOOK = "watch_vllm.ipynb"
IMAGE_SPAN = re.compile(r"\[(img \w+) x(\d+)\]")  # an image in a node's hover text
# (image, question), sent in order: the second forks from the first at its image (in block 0),
# the third shares the first's image blocks and parts at its question.
REQUESTS = (
    ("red_circle_left_of_blue_square.png", "Describe the image."),
    ("blue_square_left_of_red_circle.png", "Describe the image."),
    (
        "red_circle_left_of_blue_square.png",
        "Where is the red circle in this picture? Say where the circle is relative to the blue "
        "square.",  # 98 prompt tokens: a third block, which ends the image and asks
    ),
)
REASON = missing()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def cached_blocks(image: str, reply: dict) -> list[tuple]:
    """The blocks vLLM caches for one request, named as a plain prefix cache names them:
    ``(image or None, the first 32 (i + 1) tokens)`` for block ``i``, the image counted from
    the block that holds its first token on (vLLM hashes it into the chain from there). Every
    token holds KV but the last one sampled, which is never fed back."""
    tokens = reply["prompt_token_ids"] + reply["token_ids"][:-1]
    blocks = []
    for i in range(len(tokens) // VLLM_BLOCK_SIZE):
        prefix = tuple(tokens[: (i + 1) * VLLM_BLOCK_SIZE])
        blocks.append((image if IMAGE_TOKEN in prefix else None, prefix))
    return blocks


def expected_cached_tokens(blocks: list[tuple], cache: set, num_prompt_tokens: int) -> int:
    """The prompt tokens vLLM serves from ``cache``: the leading blocks it holds, but never the
    whole prompt (the last prompt token is always computed)."""
    hits = 0
    while hits < len(blocks) and blocks[hits] in cache:
        hits += 1
    return VLLM_BLOCK_SIZE * min(hits, (num_prompt_tokens - 1) // VLLM_BLOCK_SIZE)


def has_image(block: tuple) -> bool:
    """Block ``(image, prefix)`` holds image placeholders among its own 32 tokens."""
    return IMAGE_TOKEN in block[1][-VLLM_BLOCK_SIZE:]


def live_nodes(shown: dict) -> list[dict]:
    """The drawn nodes but the root and those evicted in this frame (fading out)."""
    return [n for n in shown["nodes"] if n["id"] != 0 and "evicted" not in n["classes"]]


def image_names(shown: dict) -> set[str]:
    """The names of the images on the live nodes (from their hover texts)."""
    return {name for n in live_nodes(shown) for name, _ in IMAGE_SPAN.findall(n["hover"])}


def at_last_frame(shown: dict) -> bool:
    i, n = shown["counter"].split(" / ")
    return i == n


def draws(blocks: list) -> Callable[[dict], bool]:
    """The condition: the player, at its last frame, draws ``len(blocks)`` live nodes."""
    return lambda s: at_last_frame(s) and len(live_nodes(s)) == len(blocks)


def no_server_at(replay_endpoint: str) -> Callable[[dict], bool]:
    return lambda s: s["status"].startswith(f"no vLLM answering at {replay_endpoint}")


def test_the_view_follows_a_real_vllm_server_live(vllm_python, browser, tmp_path):
    server = VLLMServer(python=vllm_python)
    wrong = (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    notebooks = tmp_path / "notebooks"
    write_notebook(
        notebooks / NOTEBOOK,
        [
            "import viz\n\n"
            f"view = viz.watch({server.kv_events_endpoint!r}, {server.replay_endpoint!r})\nview",
            f"wrong_port = viz.watch({wrong[0]!r}, {wrong[1]!r})\nwrong_port",
        ],
    )
    with (
        jupyter_lab(tmp_path, root=notebooks) as lab,
        contextlib.ExitStack() as cleanup,
    ):
        cleanup.callback(server.stop)
        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        # Closed before JupyterLab stops: a page left open would log its lost connections.
        cleanup.callback(page.close)
        console = Console().watch(page)
        run_all_cells(page, lab, NOTEBOOK, root=notebooks)
        live, dead = cell_view(page, 0), cell_view(page, 1)
        # No server yet: both views say so, and go on listening.
        wait_for_view(live, no_server_at(server.replay_endpoint), "'no vLLM answering'")
        shown = wait_for_view(dead, no_server_at(wrong[1]), "'no vLLM answering' (wrong port)")
        assert f"still listening on {wrong[0]}" in shown["status"], shown["status"]

        server.start()
        wait_for_view(
            live,
            lambda s: s["status"].startswith(f"vLLM answering at {server.replay_endpoint}"),
            "'vLLM answering' once the server is up",
        )

        cache: set[tuple] = set()
        blocks: list[tuple] = []  # every block cached, in order
        drawn = []  # live nodes drawn after each request
        chips_of_first: set[str] = set()  # the name the view gives the first image
        for image, question in REQUESTS:
            reply = server.chat(question, IMAGES / image)
            mine = cached_blocks(image, reply)
            expected = expected_cached_tokens(mine, cache, len(reply["prompt_token_ids"]))
            assert reply["cached_tokens"] == expected, (
                "the test's block model disagrees with vLLM",
                image,
                question,
                reply,
            )
            new = [b for b in mine if b not in cache]
            cache.update(new)
            blocks += new
            shown = wait_for_view(
                live, draws(blocks), f"{len(blocks)} blocks after {image!r} {question!r}"
            )
            drawn.append(len(live_nodes(shown)))
            if not chips_of_first:
                chips_of_first = image_names(shown)
        # The tree grew with each request: a fork at the image (block 0), then one under the
        # first image's blocks (block 2).
        assert 0 < drawn[0] < drawn[1] < drawn[2], drawn
        # Image chips on exactly the blocks that hold image tokens, each block's image tokens
        # counted right, and one name per image.
        nodes = live_nodes(shown)
        assert sum(bool(n["chips"]) for n in nodes) == sum(map(has_image, blocks)) > 0
        spans = [IMAGE_SPAN.findall(n["hover"]) for n in nodes]
        assert sorted(sum(int(k) for _, k in node) for node in spans) == sorted(
            b[1][-VLLM_BLOCK_SIZE:].count(IMAGE_TOKEN) for b in blocks
        ), spans
        assert len(image_names(shown)) == len({image for image, _ in REQUESTS}), spans
        assert len(chips_of_first) == 1, chips_of_first
        # Nothing went wrong on the wire: the status still says vLLM answers (or that batches
        # sent before the live stream caught up came through the replay socket).
        assert shown["status"].startswith(
            (f"vLLM answering at {server.replay_endpoint}", "recovered ")
        ), shown["status"]

        # The wrong port still shows nothing but the root, and says why.
        shown = wait_for_view(dead, no_server_at(wrong[1]), "'no vLLM answering' still")
        assert [n["id"] for n in shown["nodes"]] == [0] and shown["counter"] == "1 / 1"

        # A reset: the next request's batch starts with AllBlocksCleared; the view clears
        # to that request's blocks.
        assert server.reset_prefix_cache()
        image, question = REQUESTS[0]
        reply = server.chat(question, IMAGES / image)
        assert reply["cached_tokens"] == 0, reply
        after = cached_blocks(image, reply)
        shown = wait_for_view(
            live,
            lambda s: "AllBlocksCleared" in s["status"] and draws(after)(s),
            f"the view cleared to {len(after)} blocks (AllBlocksCleared)",
        )
        assert len(after) < len(blocks)
        assert image_names(shown) == chips_of_first  # the second image's blocks are gone
        page.screenshot(path=str(tmp_path / "watch_vllm.png"))
        assert page.get_by_text("Error displaying widget").count() == 0
        assert not console.errors, console.errors
    print(f"vLLM started in {server.startup_s:.0f} s; screenshot: {tmp_path / 'watch_vllm.png'}")
