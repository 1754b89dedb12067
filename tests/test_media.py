"""The media folder: a name is found beneath the folder without opening anything outside it.

``MediaFolder.read`` used to open the name (following its links), then check what it had
opened and refuse a file outside the folder without reading it. Opening is an effect in itself
(a device acts when opened, an audit log records it), so the name is walked now one name at a
time beneath the folder, its links read rather than followed. ``strace`` shows the opens a read
makes; the links' shapes are checked against ``os.path.realpath`` and against the kernel's own
``openat2(RESOLVE_BENEATH)``. The server's side (one message for every name, a link swapped
while it is read) is in tests/test_serve_hostile.py.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minirad.engine.media import MAX_LINKS, MediaFolder
from minirad.errors import ImageError

REPO = Path(__file__).resolve().parents[1]
SQUARE = REPO / "data" / "images" / "orange_square.png"


def _read(folder: MediaFolder, name: str) -> bytes | None:
    """What ``read`` gives for ``name`` under the folder, None for a refusal."""
    try:
        return folder.read(os.path.join(folder.path, name))
    except ImageError as e:
        assert "not a readable image" in str(e), e  # the one message, whatever the reason
        return None


# ------------------------------------------------------------- nothing outside is ever opened
@pytest.fixture(scope="module")
def strace() -> str:
    """The ``strace`` program. Without it (or without ptrace) the test is skipped, except in
    CI, where ``.ci/run`` installs it."""
    path = shutil.which("strace")
    why = "strace is not installed (apt-get install strace)"
    if path is not None:
        ran = subprocess.run([path, "-o", os.devnull, "true"], capture_output=True, text=True)
        why = f"strace cannot trace here: {ran.stderr.strip()}" if ran.returncode else ""
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return path


PROBE = """
import json, os, sys
from minirad.engine.media import MediaFolder
from minirad.errors import ImageError

folder, names = MediaFolder(sys.argv[1]), sys.argv[2:]

def read(name):
    try:
        return len(folder.read(os.path.join(folder.path, name)))
    except ImageError:
        return None

[read(name) for name in names]  # what the first reads import is opened before the marks
for mark in ("begin", "end"):
    try:
        os.open(os.path.join(folder.path, ".mark-" + mark), os.O_RDONLY)
    except FileNotFoundError:
        pass
    if mark == "begin":
        print(json.dumps([read(name) for name in names]))
"""
# strace -y: a file descriptor is shown with its path, "3</tmp/media>"; -s: whole paths.
_CALL = re.compile(
    r'^\d+\s+(open|openat|openat2)\((?:(AT_FDCWD|\d+)<(.*?)>, )?"((?:[^"\\]|\\.)*)",'
    r".*\)\s+=\s+(-?\d+)(?:<(.*)>)?"
)


def _opens(trace: str) -> list[tuple[str, int, str | None]]:
    """The opens between the probe's two marks: (the path asked for, made absolute, the
    result, the opened file's path)."""
    calls = []
    for line in trace.splitlines():
        if "resumed>" in line or "<unfinished" in line:
            raise AssertionError(f"an open split across lines: {line}")
        if (m := _CALL.match(line)) is None:
            continue
        _, _, at, name, result, opened = m.groups()
        calls.append((os.path.normpath(os.path.join(at or "/", name)), int(result), opened))
    marks = [i for i, (path, *_) in enumerate(calls) if ".mark-" in path]
    assert len(marks) == 2, trace[-3000:]
    return calls[marks[0] + 1 : marks[1]]


def test_no_read_opens_anything_outside_the_folder(strace, tmp_path):
    """Links to /etc/passwd, /proc/self/environ and /dev/zero, to a folder outside (a file
    under it), a relative link out through ``..``: each is refused without a single open
    outside the folder (the old read opened /etc/passwd, then refused it). An absolute link
    to a file inside, and a relative one through ``..`` inside, are read."""
    media, outside = tmp_path / "media", tmp_path / "outside"
    (media / "sub").mkdir(parents=True)
    outside.mkdir()
    shutil.copy(SQUARE, media / "square.png")
    (outside / "passwd").write_text("root:x:0:0")
    links = {
        "passwd.png": "/etc/passwd",
        "environ.png": "/proc/self/environ",
        "zero.png": "/dev/zero",
        "outlink": str(outside),
        "up.png": "../outside/passwd",
        "inside.png": str(media / "square.png"),
        "sub/back.png": "../square.png",
    }
    for name, target in links.items():
        (media / name).symlink_to(target)
    names = [*links, "outlink/passwd"]
    names.remove("outlink")
    out = tmp_path / "trace"
    cmd = [strace, "-f", "-y", "-s", "4096", "-e", "trace=open,openat,openat2", "-o", str(out)]
    ran = subprocess.run(
        [*cmd, sys.executable, "-c", PROBE, str(media), *names],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    size = SQUARE.stat().st_size
    read = dict(zip(names, json.loads(ran.stdout), strict=True))
    assert read == {
        name: size if name in ("inside.png", "sub/back.png") else None for name in names
    }
    real = os.path.realpath(media)
    opens = _opens(out.read_text())
    assert any(result >= 0 for _, result, _ in opens), opens  # the reads were traced
    outside_opens = [
        (path, result, opened)
        for path, result, opened in opens
        if not Path(path).is_relative_to(real)
        or (result >= 0 and not Path(opened or "/").is_relative_to(real))
    ]
    assert not outside_opens, outside_opens


# ------------------------------------------------------------------ what a name resolves to
def _tree(root: Path) -> tuple[MediaFolder, dict[str, bool]]:
    """A media folder with one name of every shape, and whether each must be read (a regular
    file reached without leaving the folder)."""
    media, outside = root / "media", root / "outside"
    (media / "sub").mkdir(parents=True)
    outside.mkdir()
    (media / "file.png").write_bytes(b"inside")
    (media / "sub" / "in.png").write_bytes(b"deeper")
    (outside / "x.png").write_bytes(b"outside")
    os.mkfifo(media / "fifo.png")
    links = {
        "rel.png": "file.png",  # a link inside, relative
        "chain.png": "rel.png",  # a link to a link
        "dirlink": "sub",  # then dirlink/in.png: a link to a folder inside, a file under it
        "sub/up.png": "../file.png",  # .. that stays inside
        "sub/dot.png": "./../sub/./in.png",
        "abs_in.png": str(media / "file.png"),  # absolute, inside
        "abs_dir": str(media / "sub"),  # then abs_dir/in.png
        "dangling.png": "missing.png",
        "loop_a.png": "loop_b.png",
        "loop_b.png": "loop_a.png",
        "self.png": "self.png",
        "escape.png": "../outside/x.png",  # relative, out
        "abs_out.png": str(outside / "x.png"),  # absolute, out
        "outlink": str(outside),  # then outlink/x.png
        "back_in.png": "../media/file.png",  # out and back in: refused, as RESOLVE_BENEATH
        "over_top.png": "../file.png",  # .. above the folder does not stay at its top
        "abs_back_in.png": f"{media}/../media/file.png",  # the same, absolute
        "to_dir.png": "sub",  # a folder
        "to_fifo.png": "fifo.png",
        "zero.png": "/dev/zero",
        "file_slash.png": "file.png/",  # a file is no folder
        "chain_40": "file.png",  # with the 39 below: 40 links (Linux's limit) are followed
    }
    for name, target in links.items():
        (media / name).symlink_to(target)
    for i in range(39):
        (media / f"c40_{i}").symlink_to("chain_40" if i == 0 else f"c40_{i - 1}")
    (media / "c41").symlink_to("c40_38")  # 41 are not
    read = {
        "file.png": True,
        "missing.png": False,
        "sub": False,
        "fifo.png": False,
        "rel.png": True,
        "chain.png": True,
        "dirlink/in.png": True,
        "sub/up.png": True,
        "sub/dot.png": True,
        "abs_in.png": True,
        "abs_dir/in.png": True,
        "dangling.png": False,
        "loop_a.png": False,
        "self.png": False,
        "escape.png": False,
        "abs_out.png": False,
        "outlink/x.png": False,
        "back_in.png": False,
        "over_top.png": False,
        "abs_back_in.png": False,
        "to_dir.png": False,
        "to_fifo.png": False,
        "zero.png": False,
        "file_slash.png": False,
        "c40_38": True,
        "c41": False,
    }
    return MediaFolder(media), read


def _regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # missing, a loop
        return False


def test_each_shape_of_link_is_read_exactly_when_it_resolves_to_a_file_inside(tmp_path):
    """Read, with the bytes of the file it names, exactly when the name reaches a regular
    file inside the folder; ``os.path.realpath`` agrees, except on a link that leaves the
    folder and comes back (refused, as ``openat2``'s ``RESOLVE_BENEATH`` refuses it) and on
    a chain of more than :data:`MAX_LINKS` links (the kernel's limit too)."""
    folder, read = _tree(tmp_path)
    assert MAX_LINKS == 40
    wrong = {}
    for name, readable in read.items():
        full = os.path.join(folder.path, name)
        real = os.path.realpath(full)
        inside = Path(real).is_relative_to(folder.real) and _regular(real)
        if name not in ("back_in.png", "abs_back_in.png", "c41", "file_slash.png"):
            assert inside == readable, name  # the table agrees with realpath
        got = _read(folder, name)
        if got != (Path(real).read_bytes() if readable else None):
            wrong[name] = got
    assert not wrong, wrong


# ------------------------------------------------------- the kernel's RESOLVE_BENEATH agrees
class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_SYS_OPENAT2, _RESOLVE_BENEATH = 437, 0x08


def _openat2_beneath(root: str, name: str) -> bytes | None:
    """The kernel's answer: the bytes of the regular file ``name`` reached beneath ``root``
    (``openat2`` with ``RESOLVE_BENEATH``), None if it refuses or it is no regular file.

    Raises:
        OSError: openat2 is not there (a kernel before 5.6, or a seccomp filter).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    how = _OpenHow(os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, 0, _RESOLVE_BENEATH)
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = libc.syscall(_SYS_OPENAT2, dfd, name.encode(), ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOSYS, errno.EPERM):
                raise OSError(err, "openat2 is not available")
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            with open(fd, "rb", closefd=False) as f:
                return f.read()
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


@pytest.fixture(scope="module")
def openat2() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("openat2 is Linux's")
    with tempfile.TemporaryDirectory() as root:
        try:
            _openat2_beneath(root, "x")
        except OSError as e:
            pytest.skip(str(e))


NAMES = ["a", "b", "c", "d"]  # at the top; d may be a folder holding x and y
# A link's target: one of these, or up to three of them joined by slashes.
TARGETS = ["a", "b", "d", "x", "d/x", ".", "..", "../a", "../d", "../media/a", "d/..", "d/../a"]
KINDS = st.one_of(
    st.sampled_from(["file", "missing", *TARGETS]),
    st.lists(st.sampled_from(TARGETS), min_size=2, max_size=3).map("/".join),
)


@given(top=st.tuples(*[KINDS] * 3), d_is_folder=st.booleans(), inner=st.tuples(KINDS, KINDS))
def test_relative_links_resolve_as_the_kernels_resolve_beneath(openat2, top, d_is_folder, inner):
    """Random trees of files and relative links (chains, loops, ``..`` in and out of the
    folder, links to folders then a name under them): every name reads as the kernel's own
    ``openat2(RESOLVE_BENEATH)`` reads it."""
    with tempfile.TemporaryDirectory() as root:
        media = Path(root) / "media"
        media.mkdir()
        (Path(root) / "x").write_bytes(b"outside")  # what ../x would reach
        entries = dict(zip(NAMES[:3], top, strict=True))
        if d_is_folder:
            (media / "d").mkdir()
            entries |= {"d/x": inner[0], "d/y": inner[1]}
        else:
            entries["d"] = inner[0]
        for name, kind in entries.items():
            if kind == "file":
                (media / name).write_bytes(name.encode())
            elif kind != "missing":
                (media / name).symlink_to(kind)
        folder = MediaFolder(media)
        for name in [*NAMES, "d/x", "d/y", "d/x/y", "a/x"]:
            assert _read(folder, name) == _openat2_beneath(str(media), name), (name, entries)


# ------------------------------------------------------------ the folder the server started on
def test_a_folder_replaced_by_a_link_after_the_start_is_not_followed(tmp_path):
    """The folder was opened again by its path for every read: moved away and replaced by a
    link to another folder, it served that folder's files. Its handle is kept from the start
    now: the names are read beneath the folder that was opened, wherever it went."""
    media, outside = tmp_path / "media", tmp_path / "outside"
    media.mkdir()
    outside.mkdir()
    shutil.copy(SQUARE, media / "inside.png")
    (outside / "secret.png").write_bytes(b"secret")
    folder = MediaFolder(media)
    media.rename(tmp_path / "media.old")
    media.symlink_to(outside)
    assert _read(folder, "secret.png") is None
    assert _read(folder, "inside.png") == SQUARE.read_bytes()


def test_relative_names_outlive_the_working_folder(tmp_path, monkeypatch):
    """A working folder removed after the start made every relative name a 500
    (``os.path.abspath`` raised FileNotFoundError): names are taken from the start's."""
    media, work = tmp_path / "media", tmp_path / "work"
    media.mkdir()
    work.mkdir()
    shutil.copy(SQUARE, media / "inside.png")
    monkeypatch.chdir(work)
    folder = MediaFolder("../media")
    work.rmdir()
    assert folder.read("../media/inside.png") == SQUARE.read_bytes()
    with pytest.raises(ImageError, match="not a readable image"):
        folder.read("../media/missing.png")
    with pytest.raises(ImageError, match="outside the media folder"):
        folder.read("elsewhere.png")
