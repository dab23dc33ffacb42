"""The run's tokenizer.json read with the `tokenizers` library (Rust, no torch; it comes with
transformers), for the report's viewer: `genrun report` decodes token ids without importing
transformers, which would bring torch and seconds of start-up to a read-only command.

It decodes as transformers' fast tokenizer does (the same `tokenizers` decode, then transformers'
clean-up of spaces where the folder's tokenizer_config.json asks for it and the model is not BPE,
as transformers 5 skips it there); tests/test_report.py compares the two on the bundled model. A
folder without tokenizer.json, or whose tokenizer is code (`auto_map`), goes to transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# transformers' PreTrainedTokenizerBase.clean_up_tokenization, in order.
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class TokenDecoder:
    """`decode`, `batch_decode` and `eos_token_id`: what the viewer asks of a tokenizer."""

    def __init__(self, backend: Any, eos_token_id: int | None, clean_up: bool):
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.clean_up = clean_up

    @classmethod
    def of_folder(cls, folder: Path) -> TokenDecoder | None:
        """The folder's decoder, or None where only transformers can load its tokenizer."""
        if not (folder / TOKENIZER_FILE).is_file():
            return None
        config = json.loads((folder / TOKENIZER_CONFIG).read_text()) if (folder / TOKENIZER_CONFIG).is_file() else {}
        if config.get("auto_map"):
            return None
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(folder / TOKENIZER_FILE))
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        clean_up = bool(config.get("clean_up_tokenization_spaces")) and type(backend.model).__name__ != "BPE"
        return cls(backend, backend.token_to_id(eos) if isinstance(eos, str) else None, clean_up)

    def decode(self, ids: list[int]) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=False)
        if self.clean_up:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def batch_decode(self, sequences: list[list[int]]) -> list[str]:
        return [self.decode(ids) for ids in sequences]
