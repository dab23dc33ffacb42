"""One run at a time per output folder: a lease in the run folder, on local disk and S3 alike.

Two runs writing the same folder would each rewrite the shards' checkpoints and lose the other's
parts. The folder holds numbered lease files, `lease/00000001.json`, `lease/00000002.json`, ...;
the newest decides. A run takes the folder by creating the next number with an exclusive create
(an O_EXCL hard link on local disk, a PUT with `If-None-Match: *` on S3), so of two runs racing
for the same number exactly one wins. The holder rewrites its own file every `seconds / 4` (a
heartbeat) and marks it released at the end.

The newest lease is free when it is released, when its heartbeat is older than its `seconds`
(a killed run's lease expires; a run that finds one that missed two heartbeats waits for that
rather than refusing), or at once when it was taken on this machine by a process that no longer
exists. "This machine" is the hostname, the kernel's boot id and the pid namespace together:
containers share hostnames (and a host's boot id), and a pid means something only inside its
own pid namespace of one boot. A lease without them (older versions, or a platform without a
boot id) is another machine's and expires by time. Taking over a free lease creates the next
number, never touches the old file: a run that lost its lease (its heartbeat stalled past
expiry and another run took over) sees a newer number at its next commit (`LeaseFence.check`)
and stops instead of writing; its checkpoint writes are conditional too (part_writer.py), so
one in flight when the new run starts on the shard is refused. The shards' commit records carry
their writer's generation: when lease/ lacks the previous holder's file (a refusal allows
removing lease/), a new lease numbers above every generation they record too, so removing
lease/ and running the same command resumes.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, fields

from generation_core.config.settings import GenerationSettings
from generation_core.errors import GenrunError
from generation_core.interrupt import STOP
from generation_core.store.commit_log import highest_recorded_lease
from generation_core.store.folder import StorageFolder
from generation_core.store.run_folder import LEASE_DIR, lease_file, lease_generation

logger = logging.getLogger(__name__)


class LeaseLost(RuntimeError):
    """Another run took the output folder over: this one must stop writing into it."""


@dataclass
class LeaseRecord:
    generation: int
    owner: str
    host: str
    pid: int
    seconds: float
    acquired: float
    renewed: float
    released: bool = False
    released_at: float | None = None
    boot_id: str | None = None
    """The kernel boot id of the holder's machine (None: unknown, as in leases of early versions)."""
    pid_namespace: str | None = None
    """The holder's pid namespace (`/proc/self/ns/pid`), where its `pid` means something."""

    @classmethod
    def from_dict(cls, payload: dict) -> LeaseRecord:
        # Keys a newer writer added are ignored; ones an older writer lacked take their defaults.
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in payload.items() if key in known})

    def on_this_machine(self) -> bool:
        """Taken in this process's pid space (same host, boot and pid namespace): only then does
        a missing `pid` mean the holder is gone."""
        boot_id, pid_namespace = this_machine()
        return boot_id is not None and (self.host, self.boot_id, self.pid_namespace) == (
            socket.gethostname(),
            boot_id,
            pid_namespace,
        )

    def state(self, now: float) -> str | None:
        """Why the lease is free ("released", "expired", "owner gone"), or None when held."""
        if self.released:
            return "released"
        if self.on_this_machine() and not _process_alive(self.pid):
            return "owner gone"
        if now - self.renewed > self.seconds:
            return "expired"
        return None


@functools.cache
def this_machine() -> tuple[str | None, str | None]:
    """(boot id, pid namespace) of this process; (None, None) where they cannot be known, and
    then every lease is another machine's (it expires by time)."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/sys/kernel/random/boot_id") as handle:
                boot_id = handle.read().strip()
            return (boot_id, os.readlink("/proc/self/ns/pid")) if boot_id else (None, None)
        except OSError:
            return None, None
    if sys.platform == "darwin":
        # One pid space per boot; the boot session's uuid changes at every boot.
        try:
            result = subprocess.run(["sysctl", "-n", "kern.bootsessionuuid"], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None, None
        boot_id = result.stdout.strip() if result.returncode == 0 else ""
        return (boot_id, "") if boot_id else (None, None)
    return None, None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def newest_lease(folder: StorageFolder) -> LeaseRecord | None:
    generations = [g for g in map(lease_generation, folder.list(LEASE_DIR)) if g is not None]
    if not generations:
        return None
    try:
        return LeaseRecord.from_dict(folder.read_json(lease_file(max(generations))))
    except FileNotFoundError:
        # Removed between the listing and the read (a holder cleaning up): look again.
        return newest_lease(folder)


def _describe(record: LeaseRecord, now: float) -> str:
    expires = time.strftime("%H:%M:%S UTC", time.gmtime(record.renewed + record.seconds))
    return (
        f"pid {record.pid} on host {record.host}, started {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(record.acquired))}, "
        f"heartbeat {now - record.renewed:.0f} s ago; if that run was killed, its lease expires at {expires}"
    )


def _refusal(folder: StorageFolder, record: LeaseRecord, now: float) -> GenrunError:
    return GenrunError(
        f"output folder {folder.display()} is in use by another genrun run ({_describe(record, now)}). "
        "Wait for it to finish or stop it, or write to another trainer.default_local_dir; "
        f"remove {folder.display(LEASE_DIR)} only if you are sure no run is writing there"
    )


def check_lease_free(folder: StorageFolder) -> None:
    """Refuse at once when a live run holds the folder (a preflight; taking it is `RunLease.acquire`)."""
    record = newest_lease(folder)
    now = time.time()
    # A lease that missed its heartbeats is left to RunLease.acquire, which waits it out.
    if record is not None and record.state(now) is None and now - record.renewed <= record.seconds / 2:
        raise _refusal(folder, record, now)


def _wait_if_dying(folder: StorageFolder, newest: LeaseRecord | None) -> LeaseRecord | None:
    """A held lease that missed two heartbeats most likely belongs to a killed run on another
    host (a Prefect retry of a crashed flow run lands on any worker): wait the rest of its life
    instead of refusing, unless a heartbeat shows up meanwhile. Returns the newest lease then."""
    if newest is None or newest.state(time.time()) is not None or time.time() - newest.renewed <= newest.seconds / 2:
        return newest
    logger.warning(
        "the run holding %s missed its heartbeats (%s); waiting for its lease to expire",
        folder.display(),
        _describe(newest, time.time()),
    )
    while True:
        # A Ctrl-C ends the wait at once (interrupt.Stopped): nothing of this run is written yet.
        with STOP.interruptible():
            time.sleep(min(max(newest.renewed + newest.seconds - time.time(), 0.0) + 0.5, newest.seconds / 4))
        latest = newest_lease(folder)
        if (
            latest is None
            or latest.generation != newest.generation
            or latest.renewed != newest.renewed
            or latest.state(time.time()) is not None
        ):
            return latest


def _next_generation(folder: StorageFolder, newest: LeaseRecord | None) -> int:
    """The generation a new lease takes: above the newest lease file and, when lease/ does not
    hold the previous holder's file beside it (removed by hand, as a refusal allows, or a first
    resume), above every lease recorded in the shards' commit records too: a lease numbered
    below them would find every unfinished shard claimed by a "later" run. A healthy folder
    keeps the two newest files (`_remove_older`), so a resume pays for the scan at most once."""
    generation = newest.generation if newest is not None else 0
    if generation == 0 or not folder.exists(lease_file(generation - 1)):
        generation = max(generation, highest_recorded_lease(folder))
    return generation + 1


def describe_holder(folder: StorageFolder) -> str | None:
    """Who holds the folder now (for `genrun status`), or None when it is free."""
    record = newest_lease(folder)
    now = time.time()
    return _describe(record, now) if record is not None and record.state(now) is None else None


class RunLease:
    """The lease this process holds on a run folder, with its heartbeat thread."""

    def __init__(self, folder: StorageFolder, record: LeaseRecord):
        self.folder, self.record = folder, record
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, name="genrun-lease-heartbeat", daemon=True)
        self.lost: str | None = None

    @classmethod
    def acquire(cls, folder: StorageFolder, seconds: float = GenerationSettings.lease_seconds) -> RunLease:
        """Take the folder (refused while another run holds it)."""
        now = time.time()
        newest = _wait_if_dying(folder, newest_lease(folder))
        now = time.time()
        if newest is not None:
            why_free = newest.state(now)
            if why_free is None:
                raise _refusal(folder, newest, now)
            if why_free != "released":
                logger.warning(
                    "taking over the lease of a run that stopped without releasing it (%s; %s)",
                    why_free,
                    _describe(newest, now),
                )
        boot_id, pid_namespace = this_machine()
        record = LeaseRecord(
            generation=_next_generation(folder, newest),
            # The token that makes this lease file ours alone (create_exclusive's retry after a
            # lost answer recognises it).
            owner=uuid.uuid4().hex,
            host=socket.gethostname(),
            pid=os.getpid(),
            seconds=float(seconds),
            acquired=now,
            renewed=now,
            boot_id=boot_id,
            pid_namespace=pid_namespace,
        )
        if not folder.create_exclusive(lease_file(record.generation), _encode(record)):
            # Another run created the same number first: it holds the folder now.
            winner = newest_lease(folder)
            raise (
                _refusal(folder, winner, time.time())
                if winner
                else GenrunError(f"lost the race for {folder.display(LEASE_DIR)}; run again")
            )
        lease = cls(folder, record)
        lease._remove_older()
        lease._heartbeat.start()
        return lease

    def fence(self) -> LeaseFence:
        return LeaseFence(self.record.generation)

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=30)
        if self.lost:
            return
        self.record.released, self.record.released_at = True, time.time()
        try:
            self.folder.put_atomic(lease_file(self.record.generation), _encode(self.record))
        except Exception as exc:  # noqa: BLE001 - an unreleased lease only expires later
            logger.warning(
                "could not release the run lease (%s: %s); it expires in %.0f s",
                type(exc).__name__,
                exc,
                self.record.seconds,
            )

    def __enter__(self) -> RunLease:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()

    def _beat(self) -> None:
        while not self._stop.wait(self.record.seconds / 4):
            try:
                newest = newest_lease(self.folder)
                if newest is not None and newest.generation > self.record.generation:
                    self.lost = f"lease {newest.generation} was taken by pid {newest.pid} on {newest.host}"
                    logger.error(
                        "this run lost its output folder %s: %s (our heartbeat stalled past %.0f s)",
                        self.folder.display(),
                        self.lost,
                        self.record.seconds,
                    )
                    return
                self.record.renewed = time.time()
                self.folder.put_atomic(lease_file(self.record.generation), _encode(self.record))
            except Exception as exc:  # noqa: BLE001 - storage hiccups: the next beat tries again
                logger.warning(
                    "run lease heartbeat failed (%s: %s); retrying in %.0f s",
                    type(exc).__name__,
                    exc,
                    self.record.seconds / 4,
                )

    def _remove_older(self) -> None:
        # The previous holder's file stays: when it ended and this run began, for `genrun status`
        # readers and audits.
        for generation in map(lease_generation, self.folder.list(LEASE_DIR)):
            if generation is not None and generation < self.record.generation - 1:
                self.folder.remove(lease_file(generation))


@dataclass(frozen=True)
class LeaseFence:
    """What shard writers (in any process of the run) check before each checkpoint: that no
    later run has taken the folder over."""

    generation: int

    def check(self, folder: StorageFolder) -> None:
        newest = newest_lease(folder)
        if newest is not None and newest.generation > self.generation:
            raise LeaseLost(
                f"output folder {folder.display()} was taken over by another run (lease {newest.generation}, pid {newest.pid} "
                f"on {newest.host}) while this one (lease {self.generation}) was still writing; this run stops without committing"
            )


def _encode(record: LeaseRecord) -> bytes:
    return json.dumps(asdict(record), indent=2, sort_keys=True).encode()
