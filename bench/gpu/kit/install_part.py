"""On the GPU machine: verify and install the wheels that transfer part N completes.

    python3 bench/gpu/kit/install_part.py N      (receive.sh starts it in the background)

Joins the chunks in /tmp/kit/in, checks each .xz and wheel against the manifest's sha256, installs
the part's wheels with `pip install --no-index --no-deps --target /tmp/kit/site.N` (pip does not
merge into a target that holds a namespace folder such as nvidia/), then copies that into /tmp/site
under a lock. Writes /tmp/kit/partN.ok or .failed. Standard library only: nothing is installed yet.
"""

import argparse
import fcntl
import json
import lzma
import shutil
import subprocess
import sys
import time
from pathlib import Path

from prepare import sha256  # this script's folder (bench/gpu/kit) is first on sys.path

KIT = Path("/tmp/kit")
SITE = Path("/tmp/site")


def main(part: int) -> None:
    started = time.monotonic()
    manifest = json.loads((KIT / "in" / "manifest.json").read_text())
    mine = [w for w in manifest["wheels"] if max(c["part"] for c in w["chunks"]) == part]
    wheels_dir = KIT / f"wheels.{part}"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    for wheel in mine:
        xz = wheels_dir / (wheel["wheel"] + ".xz")
        with xz.open("wb") as out:
            for chunk in wheel["chunks"]:
                with (KIT / "in" / chunk["file"]).open("rb") as handle:
                    shutil.copyfileobj(handle, out, 1 << 20)
        if sha256(xz) != wheel["xz_sha256"]:
            raise SystemExit(f"{xz.name}: sha256 differs from the manifest (a part arrived damaged)")
        target = wheels_dir / wheel["wheel"]
        with lzma.open(xz) as source, target.open("wb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
        xz.unlink()
        if sha256(target) != wheel["wheel_sha256"]:
            raise SystemExit(f"{target.name}: unpacked wheel's sha256 differs from the manifest")
    unpacked = time.monotonic()
    site = KIT / f"site.{part}"
    if not mine:  # this part holds only leading chunks of files that a later part completes
        print(f"part {part}: no wheel completed yet", flush=True)
        return
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    pip += ["--disable-pip-version-check", "--target", str(site)]
    subprocess.run([*pip, *map(str, sorted(wheels_dir.glob("*.whl")))], check=True)
    installed = time.monotonic()
    SITE.mkdir(exist_ok=True)
    with (KIT / "merge.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(["cp", "-a", f"{site}/.", str(SITE)], check=True)
    print(
        f"part {part}: {len(mine)} wheels verified+unpacked {unpacked - started:.1f}s, "
        f"pip {installed - unpacked:.1f}s, merged {time.monotonic() - installed:.1f}s",
        flush=True,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", type=int)
    number = parser.parse_args().part
    try:
        main(number)
    except BaseException as error:  # the sitting script reads the marker, not this process's exit
        (KIT / f"part{number}.failed").write_text(f"{type(error).__name__}: {error}\n")
        raise
    (KIT / f"part{number}.ok").write_text("ok\n")
