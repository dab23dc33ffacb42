"""Pack the GPU kit: download the wheels of wheels.lock, trim, recompress, and pack transfer parts.

    python3 bench/gpu/kit/prepare.py [--wheels DIR] [--out .gpukit] [--part-mib 60]

Runs here (registries reachable), never on the GPU machine: `pip download --no-deps` of each pin
for CPython 3.12 / manylinux x86_64 into --wheels, checked against its published sha256 (the one
sdist-only pin built into a pure-Python wheel here); TRIM's members left out; each wheel re-zipped
uncompressed and xz-compressed (about 30% smaller); packed first-fit into `.gpukit/partN/` of at
most --part-mib MiB (a larger file in chunks) with `manifest.json`: per wheel its chunks and the
sha256 of the .xz, of the wheel pip installs and as published. Steps and sizes: README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

KIT = Path(__file__).resolve().parent
LOCK = KIT / "wheels.lock"
PLATFORMS = (
    "manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 "
    "manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64"
)
PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
PLATFORM_ARGS += [arg for tag in PLATFORMS.split() for arg in ("--platform", tag)]
PIP = [sys.executable, "-m", "pip"]
# Members left out, by wheel-name prefix. With --attention-backend triton on a Hopper GPU SGLang
# loads sgl_kernel's sm90 common ops only: flash_ops (FA3, 1.07 GB unpacked) and flashmla_ops load
# only for those backends, sm100 only on Blackwell. flashinfer's cubins (427 MB) are read only by
# flashinfer kernels, which this run does not select (sampling_backend=pytorch).
TRIM = {
    "sglang_kernel-": ("sgl_kernel/flash_ops", "sgl_kernel/flashmla_ops", "sgl_kernel/sm100/"),
    "flashinfer_cubin-": ("flashinfer_cubin/cubins/",),
}


def read_lock() -> list[tuple[str, str]]:
    rows = []
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            file_name, digest = line.split()
            rows.append((file_name, digest.removeprefix("sha256=")))
    return rows


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def requirement(file_name: str) -> str:
    if file_name.endswith(".tar.gz"):  # an sdist: the name may hold dashes, the version does not
        name, version = file_name.removesuffix(".tar.gz").rsplit("-", 1)
    else:
        name, version = file_name.split("-")[:2]
    return f"{name}=={version}"


def build_sdists(rows: list[tuple[str, str]], wheels: Path) -> list[tuple[str, str]]:
    """Rows with each sdist replaced by the wheel built from it; its published sha256 checked first.

    The built wheel's own sha256 cannot be pinned (a build stamps times into the zip); the manifest
    records it, and the GPU side checks the wheel it installs against that."""
    built_rows = []
    for file_name, published in rows:
        if not file_name.endswith(".tar.gz"):
            built_rows.append((file_name, published))
            continue
        sdist = wheels / "sdist" / file_name
        if not sdist.exists():
            download = [*PIP, "download", "-q", "--no-deps", "--no-binary=:all:", "-d", str(sdist.parent)]
            subprocess.run([*download, requirement(file_name)], check=True)
        if sha256(sdist) != published:
            sys.exit(f"{file_name}: sha256 differs from wheels.lock; delete {sdist} and run again")
        name, version = requirement(file_name).split("==")
        stem = f"{name.replace('-', '_')}-{version}-"
        found = sorted(wheels.glob(stem + "*.whl"))
        if not found:
            subprocess.run([*PIP, "wheel", "-q", "--no-deps", "-w", str(wheels), str(sdist)], check=True)
            found = sorted(wheels.glob(stem + "*.whl"))
        if not found or not found[0].name.endswith("-py3-none-any.whl"):
            sys.exit(f"{file_name}: building it gave {[path.name for path in found]}, not one pure-Python wheel")
        built_rows.append((found[0].name, f"sdist {published}"))
    return built_rows


def download(rows: list[tuple[str, str]], wheels: Path) -> None:
    rows = [row for row in rows if row[0].endswith(".whl")]
    missing = [file_name for file_name, _ in rows if not (wheels / file_name).exists()]
    if missing:
        download = [*PIP, "download", "-q", "--no-deps", *PLATFORM_ARGS, "-d", str(wheels)]
        subprocess.run([*download, *[requirement(name) for name in missing]], check=True)
    for file_name, published in rows:
        path = wheels / file_name
        if not path.exists():
            sys.exit(f"pip did not save {file_name}: is the pin in wheels.lock still published?")
        if sha256(path) != published:
            sys.exit(f"{file_name}: sha256 differs from wheels.lock; delete it from {wheels} and run again")


def stored_copy(source: Path, target: Path, drop: tuple[str, ...]) -> None:
    """The wheel with members under `drop` left out, every member stored (uncompressed)."""
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            if any(info.filename.startswith(prefix) for prefix in drop):
                continue
            data = zin.read(info.filename)
            if drop and info.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not any(line.startswith(p) for p in drop)]
                data = ("\n".join(kept) + "\n").encode()
            info.compress_type = zipfile.ZIP_STORED
            zout.writestr(info, data)


def pack_one(file_name: str, published: str, wheels: Path, work: Path) -> dict:
    drop = next((members for prefix, members in TRIM.items() if file_name.startswith(prefix)), ())
    stored = work / file_name
    stored_copy(wheels / file_name, stored, drop)
    compressed = work / (file_name + ".xz")
    with stored.open("rb") as raw, lzma.open(compressed, "wb", preset=6) as out:
        shutil.copyfileobj(raw, out, 1 << 20)
    entry = {
        "wheel": file_name,
        "published_sha256": published,
        "trimmed": list(drop),
        "wheel_sha256": sha256(stored),
        "wheel_bytes": stored.stat().st_size,
        "xz_sha256": sha256(compressed),
        "xz_bytes": compressed.stat().st_size,
    }
    stored.unlink()
    return entry


def pack_parts(entries: list[dict], work: Path, out: Path, part_bytes: int) -> int:
    """First-fit-decreasing into parts; a file over one part's room is cut into chunks."""
    parts: list[int] = []  # bytes used per part
    for entry in sorted(entries, key=lambda e: -e["xz_bytes"]):
        source = work / (entry["wheel"] + ".xz")
        remaining, offset, chunks = entry["xz_bytes"], 0, []
        while remaining:
            index = next((i for i, used in enumerate(parts) if part_bytes - used >= min(remaining, part_bytes)), None)
            if index is None:
                parts.append(0)
                index = len(parts) - 1
            size = min(remaining, part_bytes - parts[index])
            chunk_name = f"{entry['wheel']}.xz.{len(chunks)}"
            folder = out / f"part{index + 1}"
            folder.mkdir(parents=True, exist_ok=True)
            with source.open("rb") as handle:
                handle.seek(offset)
                (folder / chunk_name).write_bytes(handle.read(size))
            chunks.append({"part": index + 1, "file": chunk_name, "bytes": size})
            parts[index] += size
            offset += size
            remaining -= size
        entry["chunks"] = chunks
        source.unlink()
    return len(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheels", type=Path, default=Path.home() / ".cache" / "genrun" / "gpukit-wheels")
    parser.add_argument("--out", type=Path, default=Path(".gpukit"))
    parser.add_argument("--part-mib", type=float, default=60.0)
    args = parser.parse_args()
    rows = read_lock()
    args.wheels.mkdir(parents=True, exist_ok=True)
    download(rows, args.wheels)
    rows = build_sdists(rows, args.wheels)
    if args.out.exists():
        shutil.rmtree(args.out)
    work = args.out / "work"
    work.mkdir(parents=True)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:  # lzma releases the GIL
        entries = list(pool.map(lambda row: pack_one(*row, args.wheels, work), rows))
    count = pack_parts(entries, work, args.out, int(args.part_mib * 2**20))
    work.rmdir()
    manifest = {
        "parts": count,
        "wheels": sorted(entries, key=lambda e: e["wheel"]),
        "published_bytes": sum((args.wheels / name).stat().st_size for name, _ in rows),
        "xz_bytes": sum(e["xz_bytes"] for e in entries),
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    # Each part carries the manifest: its step installs the wheels that part completes.
    for index in range(1, count + 1):
        (args.out / f"part{index}" / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(
        f"{len(rows)} wheels, {manifest['published_bytes'] / 2**20:.1f} MiB as published, "
        f"{manifest['xz_bytes'] / 2**20:.1f} MiB packed in {count} part(s) of <= {args.part_mib} MiB under {args.out}/"
    )


if __name__ == "__main__":
    main()
