"""Wheels for the workplace's lent GPU, whose image reaches no registry and whose calls carry 64 MiB each with the
working tree (about 9 MiB): a set's wheels, downloaded here, split where one is too large and packed into folders
that each fit one call; on the device, after one call per folder run back to back (the machine keeps carried
folders while it is warm; 30 s idle and it is a fresh one), the parts joined, their sha256 checked and every wheel
installed with one ``pip install --no-deps --target /tmp/site`` (a second ``--target`` install into the same folder
skips top-level folders already there).

Sets (``SETS``): ``fa4``: FlashAttention-4 with nvidia-cutlass-dsl's CUDA 13 libraries (a 92 MB wheel) and
nvidia-cudnn-frontend (``benches/attention_kernels.py``'s ``fa4`` and ``cudnn_frontend`` rows, the traces with
FlashAttention-4); ``ray``: ray[serve] 2.60 (a 79 MB wheel) and its dependencies but numpy (``encgraph serve --ray``,
``benches/serving.py --transports ray``). Each set's folders hold ``.whl/`` too (transformers 5.25 and the serving
stack, benches/README.md), so the install is one command::

    here:    python3 benches/carry_wheels.py download fa4      # prints the carry list of each call
    device:  carry [".carry-fa4-1"]: true;  carry [".carry-fa4-2"]: true;  ...
             carry [".carry-fa4-N"]: env=$(python3 benches/carry_wheels.py install fa4) && eval "$env" && <command>

(not ``eval "$(...)" && ...``: an eval of nothing succeeds, so a failed install would run the command without its
wheels). ``install`` prints the exports to eval: ``PYTHONPATH`` with /tmp/site (and, for ``fa4``, nvidia-cutlass-dsl's
``dsl_packages``: a ``--target`` install runs no ``.pth`` file), ``USE_HUB_KERNELS=NO``, ``PATH``. Standard library
only (the device's python runs it before anything is installed).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CALL_MIB = 53
"""What one folder may hold: 64 MiB a call, less the working tree (9 MiB on 2026-12-07) and a margin."""
PART_MIB = 26
"""Wheels larger than this travel in parts of at most this size."""

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64")
SETS: dict[str, dict[str, tuple[str, ...]]] = {
    "fa4": {
        "wheels": ("flash-attn-4==4.0.0b40", "nvidia-cutlass-dsl==4.8.1", "nvidia-cutlass-dsl-libs-base==4.8.1",
                   "nvidia-cutlass-dsl-libs-core==4.8.1", "nvidia-cutlass-dsl-libs-cu13==4.8.1", "cuda-bindings==13.*",
                   "cuda-pathfinder", "protobuf", "typing_extensions", "einops", "apache-tvm-ffi>=0.1.11,<0.2",
                   "torch-c-dlpack-ext", "quack-kernels>=0.5.3", "nvidia-cudnn-frontend==1.32.0"),
        "resolve": (),
        "skip": (),
        "paths": ("nvidia_cutlass_dsl/dsl_packages",),
    },
    "ray": {
        "wheels": (),
        "resolve": ("ray[serve]==2.60.0",),  # with its dependencies, resolved by pip for the device's python
        "skip": ("numpy",),  # the image's own (torch's) numpy stays
        "paths": (),
    },
}


def pack(sizes: dict[str, int], capacity: int) -> list[list[str]]:
    """File names into folders of at most ``capacity`` bytes each, first fit in decreasing size; raises
    ValueError for a file larger than ``capacity``.

    >>> pack({"a": 5, "b": 4, "c": 3, "d": 2}, 7)
    [['a', 'd'], ['b', 'c']]
    """
    bins: list[tuple[int, list[str]]] = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        if sizes[name] > capacity:
            raise ValueError(f"pack: {name} is {sizes[name]} bytes, over one folder's {capacity}; split it first.")
        for i, (used, names) in enumerate(bins):
            if used + sizes[name] <= capacity:
                bins[i] = (used + sizes[name], [*names, name])
                break
        else:
            bins.append((sizes[name], [name]))
    return [names for _, names in bins]


def split(path: Path, part_bytes: int) -> list[Path]:
    """``path`` cut into ``<name>.part<k>`` files of at most ``part_bytes`` beside it, and ``<name>.sha256``;
    ``path`` removed. Returns the new files."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    out = [path.with_name(path.name + ".sha256")]
    out[0].write_text(f"{digest}  {path.name}\n")
    with path.open("rb") as f:
        k = 0
        while chunk := f.read(part_bytes):
            part = path.with_name(f"{path.name}.part{k}")
            part.write_bytes(chunk)
            out.append(part)
            k += 1
    path.unlink()
    return out


def join(folders: list[Path], into: Path) -> list[Path]:
    """Every split wheel found in ``folders`` (its ``.sha256`` and ``.part<k>`` files) joined into ``into`` and
    checked; raises ValueError naming a missing part or a wrong checksum. Returns the joined wheels."""
    files = {p.name: p for folder in folders for p in folder.iterdir()}
    joined = []
    for name in sorted(n for n in files if n.endswith(".sha256")):
        wheel = name[: -len(".sha256")]
        digest = files[name].read_text().split()[0]
        parts = sorted((n for n in files if n.startswith(wheel + ".part")), key=lambda n: int(n.rsplit("part", 1)[1]))
        if not parts or [int(n.rsplit("part", 1)[1]) for n in parts] != list(range(len(parts))):
            raise ValueError(f"carry_wheels: parts of {wheel} missing (found {parts}): carry every folder, back to "
                             "back.")
        target = into / wheel
        with target.open("wb") as f:
            for n in parts:
                f.write(files[n].read_bytes())
        if hashlib.sha256(target.read_bytes()).hexdigest() != digest:
            raise ValueError(f"carry_wheels: {wheel} joined from {len(parts)} parts does not match its sha256.")
        joined.append(target)
    return joined


def project(wheel: str) -> str:
    """The normalised project name of a wheel file name.

    >>> project("opentelemetry_api-1.45.3-py3-none-any.whl"), project("PyYAML-6.0.4-cp312-cp312-x.whl")
    ('opentelemetry_api', 'pyyaml')
    """
    return wheel.split("-")[0].lower().replace(".", "_")


def folders_of(name: str) -> list[Path]:
    return sorted(ROOT.glob(f".carry-{name}-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))


def download(name: str) -> list[Path]:
    spec = SETS[name]
    pip = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *(a for p in PLATFORMS for a in ("--platform", p))]
    with tempfile.TemporaryDirectory() as tmp:
        pool = Path(tmp)
        if spec["wheels"]:
            subprocess.run([*pip, "--no-deps", "-d", str(pool), *spec["wheels"]], check=True)
        if spec["resolve"]:
            subprocess.run([*pip, "-d", str(pool), *spec["resolve"]], check=True)
        for wheel in pool.glob("*.whl"):
            if project(wheel.name) in spec["skip"]:
                wheel.unlink()
        have = {project(w.name) for w in pool.glob("*.whl")}
        for wheel in sorted((ROOT / ".whl").glob("*.whl")):  # the repository's own GPU wheels travel too, where
            if project(wheel.name) not in have:                # the set has no other version of the project
                shutil.copy2(wheel, pool / wheel.name)
        for wheel in list(pool.glob("*.whl")):
            if wheel.stat().st_size > PART_MIB * MIB:
                split(wheel, PART_MIB * MIB)
        sizes = {p.name: p.stat().st_size for p in pool.iterdir()}
        for old in folders_of(name):
            shutil.rmtree(old)
        out = []
        for i, names in enumerate(pack(sizes, CALL_MIB * MIB), start=1):
            folder = ROOT / f".carry-{name}-{i}"
            folder.mkdir()
            for n in names:
                shutil.move(str(pool / n), folder / n)
            out.append(folder)
    return out


def install(name: str) -> str:
    folders = folders_of(name)
    if not folders:
        raise SystemExit(f"carry_wheels: no .carry-{name}-* folder here: carry each one (python3 benches/"
                         f"carry_wheels.py download {name} made them), back to back.")
    site = Path("/tmp/site")
    with tempfile.TemporaryDirectory() as tmp:
        wheels = [*join(folders, Path(tmp)), *(p for f in folders for p in f.glob("*.whl"))]
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site), *map(str, wheels)], check=True, stdout=sys.stderr)
    paths = ":".join([str(site), *(str(site / p) for p in SETS[name]["paths"]), str(ROOT)])
    return f"export PYTHONPATH={paths}${{PYTHONPATH:+:$PYTHONPATH}} USE_HUB_KERNELS=NO PATH={site}/bin:$PATH"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("download", "install"))
    p.add_argument("set", choices=tuple(SETS))
    args = p.parse_args()
    if args.action == "download":
        folders = download(args.set)
        for folder in folders:
            mib = sum(f.stat().st_size for f in folder.iterdir()) / MIB
            print(f"{folder.name}: {mib:.1f} MiB, carry [\"{folder.name}\"]")
        return 0
    print(install(args.set))
    return 0


if __name__ == "__main__":
    sys.exit(main())
