"""Which genrun wrote a run folder: the build (package version, source commit) and output format.

The rule for a change of genrun itself:
- OUTPUT_FORMAT_VERSION is part of the run fingerprint (generation_core/preflight/fingerprint.py). A genrun change
  that writes other trajectories for the same inputs (other tokens, record fields, padding,
  seeds, how a reward is called or stored) bumps it: the same command then has another
  fingerprint, so it starts a new folder (the default one derives from the fingerprint) or is
  refused on an explicit folder of the old format; old and new trajectories never mix.
- Every other change (speed, logging, retries, fixes that leave the output as it was) keeps it:
  the same command resumes the folder. The package version is in the fingerprint too
  (plan.versions): a release is a new run.
- Each attempt records the build that ran it: run.json (`build`) for the run that took the
  folder, each shard's `attempt` commit record for every attempt. `genrun status` and the report
  show them, and a resume by another build says so in one line.
Light: the standard library only (read-only commands import it).
"""

from __future__ import annotations

import functools
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

OUTPUT_FORMAT_VERSION = 2
"""The trajectories genrun writes for given inputs; bump it with any change of them (module
docstring). 1 is also what genrun wrote before the constant existed. 2: verl's default scorer
by data_source when no reward function is given (shard/rewards.py); chat messages keep their
content parts' text and their `name`."""

SOURCE_ROOT = Path(__file__).resolve().parent.parent
# genrun's own packages in a source checkout: their state is the build's commit and dirty flag.
OWN_PACKAGES = ("generation_core", "flows", "tasks")
_GIT_SECONDS = 5


@functools.cache
def genrun_build() -> dict[str, Any]:
    """This process's genrun: {version, commit (None outside a git checkout or without git),
    dirty (uncommitted changes under genrun's packages), output_format}. Cached: one `git`
    call pair per process."""
    try:
        version = metadata.version("genrun")
    except metadata.PackageNotFoundError:
        version = "unknown"
    commit, dirty = _git_state(SOURCE_ROOT)
    return {"version": version, "commit": commit, "dirty": dirty, "output_format": OUTPUT_FORMAT_VERSION}


def _git_state(root: Path) -> tuple[str | None, bool]:
    # Only the checkout genrun's own packages sit in: an installed genrun lives in site-packages,
    # which may itself be inside some other repository (a venv in a project).
    if not (root / ".git").exists():
        return None, False
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=_GIT_SECONDS
        )
        if head.returncode != 0:
            return None, False
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", *OWN_PACKAGES],
            capture_output=True,
            text=True,
            timeout=_GIT_SECONDS,
        )
    except (OSError, subprocess.SubprocessError):  # no git, or it hangs: the build is its version only
        return None, False
    dirty = status.returncode != 0 or any(line.strip() for line in status.stdout.splitlines())
    return head.stdout.strip() or None, dirty


def describe_build(build: dict[str, Any] | None) -> str:
    """One phrase: `genrun 0.1.0 (commit 1a2b3c4d5e6f, uncommitted changes; output format 1)`."""
    if not isinstance(build, dict):
        return "a genrun that recorded no build"
    source = f"commit {str(build['commit'])[:12]}" if build.get("commit") else "no git commit"
    if build.get("dirty"):
        source += ", uncommitted changes"
    return f"genrun {build.get('version', '?')} ({source}; output format {build.get('output_format', '?')})"


def same_build(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Both recorded and equal in version, commit, dirty flag and output format (two dirty
    builds of one commit cannot be told apart: they count as the same)."""
    keys = ("version", "commit", "dirty", "output_format")
    return isinstance(a, dict) and isinstance(b, dict) and all(a.get(k) == b.get(k) for k in keys)


def other_build_warning(folder_display: str, recorded: dict[str, Any] | None) -> str | None:
    """The one line a resume or `genrun status` prints when the folder was written by another
    build than this process's, else None. A folder that recorded no build has format 1."""
    current = genrun_build()
    if same_build(recorded, current):
        return None
    recorded_format = recorded.get("output_format", 1) if isinstance(recorded, dict) else 1
    if recorded_format == current["output_format"]:
        effect = "the output format is the same, so a resume keeps its trajectories (each attempt records its build)"
    else:
        effect = "another output format, so this genrun does not resume it (finish it with that build, or start another folder)"
    return f"{folder_display} was written by {describe_build(recorded)}; this is {describe_build(current)}: {effect}"


def refusal_hint(recorded: dict[str, Any] | None) -> str:
    """What else may tell a folder's fingerprint from this run's, beside the config, dataset, code
    and versions: genrun's output format, or a folder older than build records."""
    if not isinstance(recorded, dict):
        return (
            "; it records no genrun build: a genrun from before builds were recorded fingerprinted it without the modules "
            "that tools, reward files and plugin agent loops import, so finish it with that genrun if nothing else changed"
        )
    if recorded.get("output_format") != OUTPUT_FORMAT_VERSION:
        return f"; genrun's output format changed (format {recorded.get('output_format')} there, {OUTPUT_FORMAT_VERSION} in this genrun): finish it with {describe_build(recorded)}"
    return ""
