"""The trajectory viewer's data: the sampled trajectories as token ids, mask runs and logprobs,
with one table of token texts shared by all of them, decoded with the run's own tokenizer.

A token's text is its id decoded alone. Byte-level tokenizers split some characters (emoji,
CJK) over several tokens, each of which decodes alone to U+FFFD; such a run is decoded
together and its text given to its first token (`fix`), so the page reads as the model wrote it.

The page embeds this as JSON. Its size is bounded by the sample (report_data) and by
`token_budget`: trajectories are dropped, largest hash of sample id first, until the sample's
tokens fit, so a run of long responses still gives a page a browser opens quickly.

A trajectory's images (a run with images, docs/multimodal.md) are shown as small JPEG thumbnails
(at most THUMBNAIL_PIXELS on a side), each distinct image once in the page, at most
IMAGES_PER_TRAJECTORY per trajectory and IMAGE_BUDGET bytes in all; the viewer says how many of
a trajectory's images it does not show.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from generation_core.engines.base import eos_token_ids as run_eos_token_ids
from generation_core.inputs.tokenizer import tokenizer_dir
from generation_core.report.data import ReportData, data_source_of, sample_hash
from generation_core.report.stop_reasons import STOP_REASONS, stop_reasons
from generation_core.report.token_decoder import TokenDecoder
from generation_core.store.run_record import RunRecord
from generation_core.store.trajectory_record import TIMINGS, TrajectoryRecord, records_to_table

logger = logging.getLogger(__name__)

TOKEN_BUDGET = 250_000
"""Prompt and response tokens embedded in the viewer at most (about 20 bytes of page each with
logprobs: about 5 MB)."""
THUMBNAIL_PIXELS = 128
IMAGES_PER_TRAJECTORY = 4
IMAGE_BUDGET = 1_000_000
"""Bytes of image data URLs in the page at most (about 200 thumbnails of a photograph)."""
_REPLACEMENT = "\ufffd"
_JOIN_AT_MOST = 4


def load_tokenizer(run: RunRecord, trust_remote_code: bool = False):
    """The run's tokenizer (run.json's tokenizer_path, else its model path), or None, and the viewer
    shows token ids, when that folder is not readable here (a report made on another machine than
    the run) or its tokenizer is code from that folder. Such code runs only when the user passes
    `--trust-remote-code` on the command line: run.json's own trust_remote_code is not followed,
    as reading a folder must run no code it names."""
    path = tokenizer_dir(run.config["actor_rollout_ref"]["model"])
    if not Path(path).is_dir():
        logger.warning(
            "report: the run's tokenizer %s is not on this machine; the viewer shows token ids instead of text",
            path,
        )
        return None
    # tokenizer.json through the `tokenizers` library when the folder has one and no tokenizer
    # code: transformers would import torch, seconds of a read-only command's start.
    decoder = TokenDecoder.of_folder(Path(path))
    if decoder is not None:
        return decoder
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        # transformers' refusal to run a folder's code without trust_remote_code=True.
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        logger.warning(
            "report: the run's tokenizer (%s) is code from its folder, which runs only with `genrun report DIR --trust-remote-code`; the viewer shows token ids instead of text",
            path,
        )
        return None


def eos_token_ids(run: RunRecord, tokenizer) -> frozenset[int]:
    """End-of-sequence ids of the run's model and tokenizer (engines.base.eos_token_ids, the engine's and export's rule)."""
    return frozenset(run_eos_token_ids(str(run.config["actor_rollout_ref"]["model"]["path"]), tokenizer))


def within_budget(sample: list[TrajectoryRecord], token_budget: int) -> list[TrajectoryRecord]:
    """The sample's trajectories in order of their sample hash while their tokens fit (at least one)."""
    if not sample:
        return []
    hashes = sample_hash(np.array([r.index for r in sample]), np.array([r.rollout_n for r in sample]))
    kept: list[TrajectoryRecord] = []
    used = 0
    for position in np.argsort(hashes, kind="stable"):
        record = sample[int(position)]
        size = len(record.prompt_ids) + len(record.response_ids)
        if kept and used + size > token_budget:
            break
        kept.append(record)
        used += size
    return sorted(kept, key=lambda record: record.key)


def mask_runs(mask: list[int]) -> list[list[int]]:
    """`[mask value, length]` of each run of equal values: the turns of a response."""
    runs: list[list[int]] = []
    for value in mask:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([int(value), 1])
    return runs


class TokenTexts:
    """Token id -> its text, decoded once per id across the whole sample."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pieces: dict[int, str] = {}

    def add(self, ids: list[int]) -> dict[int, str]:
        """Record the texts of `ids`; returns the fixes of split characters (position -> text)."""
        new = sorted(set(ids) - self.pieces.keys())
        if new:
            texts = (
                self.tokenizer.batch_decode([[i] for i in new])
                if self.tokenizer is not None
                else [f"⟨{i}⟩" for i in new]
            )
            self.pieces.update(zip(new, texts, strict=True))
        fix: dict[int, str] = {}
        if self.tokenizer is None:
            return fix
        position = 0
        while position < len(ids):
            if _REPLACEMENT in self.pieces[ids[position]]:
                for end in range(position + 2, min(position + _JOIN_AT_MOST, len(ids)) + 1):
                    text = self.tokenizer.decode(ids[position:end])
                    if _REPLACEMENT not in text:
                        fix[position] = text
                        fix.update({p: "" for p in range(position + 1, end)})
                        position = end - 1
                        break
            position += 1
        return fix

    def prompt_text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else " ".join(f"⟨{i}⟩" for i in ids)


class Thumbnails:
    """The page's image thumbnails, as data URLs by sha256 of the stored PNG, within IMAGE_BUDGET."""

    def __init__(self, budget: int = IMAGE_BUDGET):
        self.budget = budget
        self.urls: dict[str, str] = {}
        self.used = 0

    def add(self, images: list[bytes] | None) -> dict[str, Any]:
        """A trajectory's `images` (the digests of those shown) and `images_hidden` (how many not)."""
        shown = []
        for data in (images or [])[:IMAGES_PER_TRAJECTORY]:
            digest = hashlib.sha256(data).hexdigest()
            if digest not in self.urls:
                url = _thumbnail_url(data)
                if self.used + len(url) > self.budget:
                    continue
                self.urls[digest] = url
                self.used += len(url)
            shown.append(digest)
        return {"images": shown, "images_hidden": len(images or []) - len(shown)}


def _thumbnail_url(data: bytes) -> str:
    """A stored PNG as a `data:image/jpeg;base64,` URL of at most THUMBNAIL_PIXELS on a side."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        thumbnail = image.convert("RGB")
    thumbnail.thumbnail((THUMBNAIL_PIXELS, THUMBNAIL_PIXELS))
    buffer = io.BytesIO()
    thumbnail.save(buffer, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def _trajectory(record: TrajectoryRecord, texts: TokenTexts, stop: str) -> dict[str, Any]:
    logprobs = record.response_logprobs
    return {
        "id": f"{record.index}:{record.rollout_n}",
        "source": data_source_of(record.input_fields),
        "reward": None if record.reward_score is None else round(float(record.reward_score), 6),
        "length": len(record.response_ids),
        "model_tokens": int(sum(record.response_mask)),
        "turns": record.num_turns,
        "stop": stop,
        "prompt": texts.prompt_text(record.prompt_ids),
        "ids": record.response_ids,
        "runs": mask_runs(record.response_mask),
        "logprobs": None if logprobs is None else [round(float(v), 3) for v in logprobs],
        "fix": {str(position): text for position, text in texts.add(record.response_ids).items()},
        **_timing_fields(record),
    }


def _timing_fields(record: TrajectoryRecord) -> dict[str, Any]:
    """Its time split (trajectory_record.TIMINGS and `total`, seconds; None where unknown) and per model
    turn the replica that served it, its stop reason and seconds; empty for trajectories of
    genruns that did not keep them."""
    if record.timings is None:
        return {"time": None, "replicas": [], "turn_info": []}
    time: dict[str, float | None] = {}
    for name in TIMINGS:
        value = record.timings.get(name)
        time[name] = None if value is None else round(float(value), 4)
    time["total"] = round(sum(v for v in time.values() if v is not None), 4)
    turns = (record.provenance or {}).get("turns") or []
    return {
        "time": time,
        "replicas": sorted({str(t["replica"]) for t in turns if t.get("replica") is not None}),
        "turn_info": [
            [t.get("replica"), t.get("stop_reason"), round(float(t.get("seconds") or 0.0), 4)] for t in turns
        ],
    }


def viewer_payload(data: ReportData, tokenizer, token_budget: int = TOKEN_BUDGET) -> dict[str, Any]:
    """The JSON the page's viewer reads: trajectories, token texts, and how they were chosen."""
    shown = within_budget(data.sample, token_budget)
    stops = stop_reasons(records_to_table(shown), data.limits)[0].tolist() if shown else []
    names = list(STOP_REASONS)
    texts, thumbnails = TokenTexts(tokenizer), Thumbnails()
    trajectories = [
        {**_trajectory(record, texts, names[code]), **thumbnails.add(record.images)}
        for record, code in zip(shown, stops, strict=True)
    ]
    return {
        "total": len(data.stats),
        "trajectories": trajectories,
        "images": thumbnails.urls,
        "image_limit": f"at most {IMAGES_PER_TRAJECTORY} images per trajectory and {IMAGE_BUDGET // 1000} kB of thumbnails",
        "pieces": {str(token): text for token, text in texts.pieces.items()},
        "stop_reasons": STOP_REASONS,
        "decoded": tokenizer is not None,
    }


def payload_json(payload: dict[str, Any]) -> str:
    """JSON safe inside a <script> element: `<`, `>` and `&` as JSON's own \\u escapes, so no
    `</script>`, `<!--` or `-->` can end or change the element and the text is still valid JSON."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
