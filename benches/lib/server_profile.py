"""Where a server process's Python time goes under load: a py-spy sample of the thread holding the GIL, grouped.

``benches/serving.py --profile SYSTEM`` runs :class:`GilProfile` beside that system's server during its run at the
largest concurrency (the first run of the point): ``py-spy record --gil --nonblocking --subprocesses`` on the
server's process, ``--rate`` samples a second, raw (collapsed) stacks. ``--gil`` keeps only the samples of the
thread that holds the GIL, so the samples over ``rate x seconds`` are the share of the run's wall time in which
some thread ran Python in that process: near 1, the server is bound by its one GIL (Python); well under it, by
something else (the device, the preprocessing workers, the clients). Each sample is put in one group by its
innermost frame that matches a group of :data:`GROUPS` (the first match from the leaf up), so a ``json.loads``
inside the server's own code counts as JSON. Preprocessing workers are processes of their own (``--subprocesses``:
their samples are counted apart, under ``workers``). ``top_encgraph`` names, per sample, the innermost frame of
encgraph's own code (:func:`frame_name`): which of its functions was running, whatever library it had called.

py-spy is not a dependency: without it on ``PATH`` the option records why it did not run. On the device machine,
carry its wheel (``py_spy-*-manylinux*.whl``) and put the ``bin`` folder of the ``--target`` install on ``PATH``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["GROUPS", "TOP", "GilProfile", "frame_name", "group_of", "summarize_raw"]

GROUPS: tuple[tuple[str, str], ...] = (
    # (group, a regular expression searched in a frame "function (path:line)"), first match wins per frame.
    ("garbage collection", r"[(/]gc\.py|gc_collect"),
    ("base64", r"[(/]base64\.py|binascii"),
    ("JSON", r"[(/]json/|orjson|ujson"),
    ("image decode (Pillow)", r"[(/]PIL/"),
    ("image processor", r"image_process|[(/]torchvision/|image_transforms|image_utils"),
    ("HTTP parsing and server", r"[(/](uvicorn|httptools|h11)/"),
    ("ASGI framework", r"[(/](starlette|fastapi|anyio)/"),
    ("metrics", r"prometheus_client"),
    ("serving front and answers", r"[(/]encgraph/serving/"),
    ("runner: planning, replay, copies", r"[(/]encgraph/(capture|packing|models)/"),
    ("torch (host side)", r"[(/]torch/"),
    ("event loop (asyncio)", r"[(/]asyncio/|[(/]selectors\.py"),
    ("threads and queues", r"[(/](threading|queue)\.py|[(/]concurrent/futures/"),
)
_COMPILED = tuple((name, re.compile(pattern)) for name, pattern in GROUPS)
_PROCESS = re.compile(r'process (\d+):"[^"]*";')  # a command line may hold ";"
_FRAME = re.compile(r"^(?P<function>.*) \((?P<path>[^()]*?)(?::\d+)?\)$")
_OWN = re.compile(r"[(/]encgraph/")
TOP = 10
"""Frames listed per profile (``top_encgraph``: by share of the server's GIL samples)."""


def frame_name(frame: str) -> str:
    """``function (package/module.py)`` of a py-spy frame ``function (path:line)``: the path from its ``encgraph``,
    ``site-packages`` or ``lib/python3.X`` folder on, no line, so that one function's samples add up.

    >>> frame_name("answer (/root/repo/encgraph/serving/app.py:251)")
    'answer (encgraph/serving/app.py)'
    >>> frame_name("get (/usr/lib/python3.12/queue.py:171)")
    'get (queue.py)'
    """
    match = _FRAME.match(frame)
    if match is None:
        return frame
    path = match.group("path")
    for marker in ("/site-packages/", "/dist-packages/"):
        path = path.rpartition(marker)[2] if marker in path else path
    path = re.sub(r"^.*/lib/python3\.\d+/", "", path)
    if "/encgraph/" in path:
        path = "encgraph/" + path.rpartition("/encgraph/")[2]
    return f"{match.group('function')} ({path})"


def group_of(frames: list[str]) -> str:
    """The group of one stack (frames from the root to the leaf): that of the innermost frame matching a group,
    else ``"other"``."""
    for frame in reversed(frames):
        for name, pattern in _COMPILED:
            if pattern.search(frame):
                return name
    return "other"


def summarize_raw(text: str, rate: int, seconds: float, server_pid: int) -> dict[str, Any]:
    """Groups of a py-spy raw file (``process PID:"cmdline";[process PID:"cmdline";]thread (TID): name;frame;...
    N`` lines, or without the process parts when one process was sampled): the server process's share of wall
    time holding its GIL (a lower bound: py-spy skips samples when it falls behind, as on a loaded 2-core host),
    and per group its share of those samples; the subprocesses' (preprocessing workers') GIL samples apart."""
    own: Counter[str] = Counter()
    ours: Counter[str] = Counter()  # the innermost encgraph frame of each sample: which of our functions held it
    workers = 0
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        pid = server_pid
        while (match := _PROCESS.match(stack)) is not None:  # "process PID:"cmdline";" per level, innermost last
            pid, stack = int(match.group(1)), stack[match.end():]
        if pid != server_pid:
            workers += int(count)
            continue
        frames = stack.split(";")
        frames = frames[1:] if frames[0].startswith("thread (") else frames
        own[group_of(frames)] += int(count)
        ours[next((frame_name(f) for f in reversed(frames) if _OWN.search(f)), "(no encgraph frame)")] += int(count)
    total = sum(own.values())
    expected = rate * seconds
    return {"rate_hz": rate, "seconds": seconds, "samples": total,
            "gil_held_share": round(total / expected, 3) if expected else None,
            "groups": {name: round(n / total, 3) for name, n in own.most_common()} if total else {},
            "top_encgraph": {name: round(n / total, 3) for name, n in ours.most_common(TOP)} if total else {},
            "workers_gil_share": round(workers / expected, 3) if expected else None}


class GilProfile:
    """One py-spy recording of ``pid`` (and its subprocesses) for ``seconds``, started at construction;
    :meth:`result` waits for it and returns :func:`summarize_raw`'s dict, or ``{"skipped": why}``."""

    def __init__(self, pid: int, seconds: float, rate: int = 200, delay: float = 0.0) -> None:
        self.pid, self.seconds, self.rate = pid, max(1, round(seconds)), rate
        self.tool = shutil.which("py-spy")
        self._dir = tempfile.TemporaryDirectory()
        self._out = Path(self._dir.name) / "raw.txt"
        self._proc: subprocess.Popen[bytes] | None = None
        self._timer = threading.Timer(delay, self._start)  # after the load's warm-up
        if self.tool is not None:
            self._timer.start()

    def _start(self) -> None:
        assert self.tool is not None
        self._proc = subprocess.Popen(
            [self.tool, "record", "--pid", str(self.pid), "--duration", str(self.seconds), "--rate", str(self.rate),
             "--format", "raw", "--output", str(self._out), "--gil", "--nonblocking", "--subprocesses"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def result(self) -> dict[str, Any]:
        try:
            if self.tool is None:
                return {"skipped": "py-spy is not on PATH (pip install py-spy)"}
            self._timer.join()
            assert self._proc is not None
            log, _ = self._proc.communicate(timeout=self.seconds + 60)
            if self._proc.returncode != 0 or not self._out.exists():
                return {"skipped": f"py-spy exited {self._proc.returncode}: "
                                   f"{log.decode(errors='replace').strip()[-300:]}"}
            return summarize_raw(self._out.read_text(), self.rate, self.seconds, self.pid)
        finally:
            self._dir.cleanup()
