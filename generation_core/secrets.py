"""Secrets in a run's config: one rule that finds them, masks them wherever the config is
written or sent, and hands them to the processes that need them through the environment.

A value is a secret when its key's name says so (`secret`, `password`, `credential`, `auth`,
`dsn`, `webhook`, ... anywhere in the name; `connection_string`, `private_key` anywhere; `key` or
`token` as its last word, as in `api_key`, `aws_secret_access_key`, `aws_session_token`, `key`;
`key_id`) or when it lies under an `env_vars` mapping (Ray's runtime env: names like
OPENAI_API_KEY say nothing reliable). verl's dataset column names (`prompt_key`, ...) and its
distillation teachers' `key` (a dataset's name) are not secrets. The rule is by name, so it covers the free-form sections (storage and data options,
`engine_kwargs.*`, reward kwargs, Ray's init) too. A URL holds its own: the user part
(`https://user:pass@host`) and signed or tokened query parameters (`X-Amz-Signature`, `sig`,
`token`, ...) are secrets whatever the key, and only they are masked, so the URL stays readable.

Masked copies (`without_secrets`) are what run.json, Prefect parameters, W&B, the report and
logs get; `overrides_without_secrets` masks Hydra overrides by the same rule, and
`without_url_credentials` the URLs inside a message. The values themselves stay in the memory of
the process that loaded the config and travel to shard workers in one environment variable,
SECRETS_ENV, which Ray's runtime env carries (ray_setup.RAY_WORKER_ENV); a worker puts them back
(`with_secrets`) where its copy of the plan holds the masked value. A deployment run loads its
config from its parameters on the worker: its secrets come from that worker's environment
(`${oc.env:NAME}` in an override, or the AWS_* variables s3fs reads), never from the parameters.
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import Any
from urllib.parse import unquote, urlsplit

PLACEHOLDER = "<redacted>"
SECRETS_ENV = "GENRUN_CONFIG_SECRETS"
"""JSON list of [path, value] pairs: the config's secrets, for the run's own workers."""

# Words that make any name a secret, wherever they stand.
SECRET_WORDS = frozenset(
    {
        "secret",
        "secrets",
        "password",
        "passwd",
        "passphrase",
        "passkey",
        "credential",
        "credentials",
        "apikey",
        "authorization",
        "auth",
        "cookie",
        "bearer",
        "dsn",
        "webhook",
        "webhooks",
    }
)
# Words that make a name a secret as its last word (`api_key`, `aws_session_token`), not
# elsewhere (`max_token_len_per_gpu`, `num_key_value_heads`).
SECRET_LAST_WORDS = frozenset({"key", "token", "pwd"})
# Two words that make a name a secret where they stand together: Azure's `connection_string`
# holds `AccountKey=`, `private_key_pem` a key.
SECRET_WORD_PAIRS = frozenset({("connection", "string"), ("conn", "str"), ("private", "key")})
# verl's names of dataset columns: keys that hold a column name, not a secret.
COLUMN_NAMES = frozenset(
    {
        "prompt_key",
        "reward_fn_key",
        "image_key",
        "video_key",
        "audio_key",
        "teacher_key",
        "tools_key",
        "messages_key",
        "response_key",
        "answer_key",
        "question_key",
    }
)
# Everything under a mapping of this name is a secret (environment variables of Ray workers).
SECRET_MAPPINGS = frozenset({"env_vars"})
# The `key` of each entry of these mappings names a dataset (verl's distillation teachers).
DATASET_KEYED_MAPPINGS = frozenset({"teacher_models"})
# A URL's query or fragment parameters that hold a credential, as last word, besides the names
# above (`token`, `access_token`, `key`, `api_key`, `X-Amz-Credential`, `X-Amz-Security-Token`):
# the signatures of pre-signed S3/GCS/Azure URLs and OAuth's authorization `code`.
URL_SECRET_LAST_WORDS = frozenset({"signature", "sig", "code"})
# Schemes whose user part names a storage container, not a user (`abfs://container@account...`).
CONTAINER_SCHEMES = frozenset({"abfs", "abfss", "az", "adl", "wasb", "wasbs"})
_WHOLE_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://\S+")
# In a message a URL ends at a space or a quote (`{url!r}`).
_URL_IN_TEXT = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"]+")
# Characters Hydra's grammar reads only escaped in a mapping's key (as Hydra writes them back).
_HYDRA_SPECIAL = re.compile(r"([\\()\[\]{}:=, \t])")

Path = tuple[str | int, ...]


def _words(name: str) -> list[str]:
    """`awsSecretAccessKey`, `AWS_SECRET_ACCESS_KEY`, `aws-secret` -> lower-case words."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name)
    return [word for word in re.split(r"[^a-z0-9]+", spaced.lower()) if word]


def is_secret_name(name: str) -> bool:
    """Whether a config key of this name holds a secret (see the module docstring)."""
    words = _words(str(name))
    if not words or str(name).lower() in COLUMN_NAMES:
        return False
    return (
        bool(SECRET_WORDS & set(words))
        # `prefill_seconds_per_token` is a rate.
        or (words[-1] in SECRET_LAST_WORDS and words[-2:-1] != ["per"])
        or words[-2:] == ["key", "id"]
        or bool(SECRET_WORD_PAIRS & set(zip(words, words[1:], strict=False)))
    )


def _is_secret_key(path: Path) -> bool:
    """Whether the value at this path of a config is a secret by its key (see the module docstring)."""
    name = path[-1]
    if name == "key" and len(path) >= 3 and path[-3] in DATASET_KEYED_MAPPINGS:
        return False
    return is_secret_name(str(name)) or name in SECRET_MAPPINGS


def _is_secret_parameter(name: str) -> bool:
    name = unquote(name)
    words = _words(name)
    return is_secret_name(name) or (bool(words) and words[-1] in URL_SECRET_LAST_WORDS)


def _mask_parameters(text: str, found: list[str]) -> str:
    """`a=1&sig=XYZ` -> `a=1&sig=<redacted>`; the values masked are added to `found`."""
    pieces = []
    for piece in text.split("&"):
        name, equals, value = piece.partition("=")
        if equals and value and _is_secret_parameter(name):
            found.append(value)
            piece = f"{name}={PLACEHOLDER}"
        pieces.append(piece)
    return "&".join(pieces)


def _split_url(text: str) -> tuple[str, list[str]]:
    """(`text` with the credentials of the URL it is replaced by PLACEHOLDER, those credentials);
    (text, []) when it is no URL or holds none. Everything else is kept as written: scheme,
    host, path, parameter names."""
    if not _WHOLE_URL.fullmatch(text):
        return text, []
    try:
        parts = urlsplit(text)
    except ValueError:  # not a URL after all (an unbalanced IPv6 bracket)
        return text, []
    found: list[str] = []
    rest = text[len(parts.scheme) + 3 :]
    authority_end = min((rest.find(c) for c in "/?#" if c in rest), default=len(rest))
    authority, rest = rest[:authority_end], rest[authority_end:]
    userinfo, at, host = authority.rpartition("@")
    # A lone user part may be a token (`https://TOKEN@github.com`), except where it names a container.
    if at and userinfo and (":" in userinfo or parts.scheme.lower() not in CONTAINER_SCHEMES):
        found.append(userinfo)
        authority = f"{PLACEHOLDER}@{host}"
    path, hash_sign, fragment = rest.partition("#")
    path, question, query = path.partition("?")
    masked = f"{text[: len(parts.scheme)]}://{authority}{path}{question}{_mask_parameters(query, found)}"
    masked += f"{hash_sign}{_mask_parameters(fragment, found)}"
    return (masked, found) if found else (text, [])


def url_credentials(text: str) -> list[str]:
    """The credentials a URL carries (its user part, secret query values); [] for any other text."""
    return _split_url(text)[1]


def without_url_credentials(text: str) -> str:
    """`text` (an error message, a log line) with the credentials of every URL in it masked."""
    return _URL_IN_TEXT.sub(lambda match: _split_url(match.group())[0], text)


def split_secrets(container: Any) -> tuple[Any, list[tuple[Path, Any]]]:
    """(a copy of `container` with every secret replaced by PLACEHOLDER, and the credentials of
    every URL in it, [(path, value)] of the secrets). None and empty values are left as they are:
    there is nothing to hide."""
    found: list[tuple[Path, Any]] = []

    def walk(node: Any, path: Path, secret: bool) -> Any:
        if isinstance(node, dict):
            items = node.items()
            return {name: walk(value, (*path, name), secret or _is_secret_key((*path, name))) for name, value in items}
        if secret and node not in (None, "", [], {}):
            found.append((path, node))
            return PLACEHOLDER
        if isinstance(node, list):
            return [walk(value, (*path, index), secret) for index, value in enumerate(node)]
        if isinstance(node, str):
            masked, credentials = _split_url(node)
            if credentials:
                found.append((path, node))
                return masked
        return node

    return walk(container, (), False), found


def without_secrets(container: Any) -> Any:
    """A copy safe to write, send or log: run.json, Prefect parameters, W&B, reports."""
    return split_secrets(container)[0]


def with_secrets(container: Any, secrets: list[tuple[Path, Any]]) -> Any:
    """A copy of a masked `container` with the secrets put back where it holds the masked value
    (a path the config does not mask is left alone: the secrets belong to another run)."""
    container = copy.deepcopy(container)
    for path, value in secrets:
        masked_forms = {PLACEHOLDER, _split_url(value)[0]} if isinstance(value, str) else {PLACEHOLDER}
        node = container
        try:
            for step in path[:-1]:
                node = node[step]
            if isinstance(node[path[-1]], str) and node[path[-1]] in masked_forms:
                node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue
    return container


def masked_paths(container: Any) -> list[str]:
    """Where `container` still holds the placeholder: secrets this process was not given."""
    return [
        ".".join(map(str, path))
        for path, value in split_secrets(container)[1]
        if value == PLACEHOLDER or (isinstance(value, str) and PLACEHOLDER in _split_url(value)[1])
    ]


def keep_in_environment(secrets: list[tuple[Path, Any]]) -> None:
    """Hold the config's secrets in this process's environment, where Ray's runtime env picks
    them up for the run's workers (and nothing else writes them)."""
    if secrets:
        os.environ[SECRETS_ENV] = json.dumps([[list(path), value] for path, value in secrets])
    else:
        os.environ.pop(SECRETS_ENV, None)


def from_environment() -> list[tuple[Path, Any]]:
    text = os.environ.get(SECRETS_ENV)
    return [(tuple(path), value) for path, value in json.loads(text)] if text else []


def overrides_without_secrets(overrides: list[str]) -> list[str]:
    """Hydra overrides safe to store (the flow run's `overrides` parameter, the command line W&B
    records). Each is read with Hydra's grammar and the rule above applied to its value at any
    depth (mappings, lists, URLs) under its full key. One that holds a secret is written again
    with the masked values quoted in their place: still an override Hydra reads, and one that
    config loading refuses (config/loading.py), so it never runs with the placeholder as the
    secret. One that holds none is kept as it was typed."""
    # Imported here: Hydra's grammar is a heavy import that only a run needs.
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    return [_override_without_secrets(parser, override) for override in overrides]


def unreadable_override_holds_secret(override: str) -> bool:
    """Whether an override Hydra's grammar cannot read may hold a secret, by the rule above: its
    key names one (at any step of its dotted path, an `env_vars` mapping included), a key written
    in its value does (`storage.options={secret: ...`), or a URL in it carries credentials. Its
    value is then shown nowhere, not even in the parse error."""
    key, _, value = override.lstrip("~+").partition("=")
    path = tuple(key.partition("@")[0].split("."))
    if any(_is_secret_key(path[:depth]) for depth in range(1, len(path) + 1)):
        return True
    if any(is_secret_name(name) for name in re.findall(r"([A-Za-z_][\w-]*)\s*:", value)):
        return True
    return without_url_credentials(value) != value


def _override_without_secrets(parser: Any, override: str) -> str:
    from hydra.core.override_parser.types import ChoiceSweep, ValueType
    from hydra.errors import HydraException

    typed_key, equals, _ = override.partition("=")
    if not equals:
        return override  # `~key`: no value
    try:
        parsed = parser.parse_override(override)
    except HydraException:
        # Config loading refuses it, so it never ran; its value could be anything.
        return f"{typed_key}={PLACEHOLDER}"
    value = parsed.value()
    if parsed.value_type != ValueType.ELEMENT:
        # A sweep (`a,b`) is refused by config loading; masked whole if any choice is a secret.
        value = value.list if isinstance(value, ChoiceSweep) else []
    nested: Any = value
    for name in reversed(parsed.key_or_group.split(".")):
        nested = {name: nested}
    masked, found = split_secrets(nested)
    if not found:
        return override
    if parsed.value_type != ValueType.ELEMENT:
        return f"{typed_key}={_as_override_value(PLACEHOLDER)}"
    for name in parsed.key_or_group.split("."):
        masked = masked[name]
    return f"{typed_key}={_as_override_value(masked)}"


def _as_override_value(value: Any) -> str:
    """A parsed override value written back in Hydra's grammar; every string quoted, so
    `<redacted>` and a masked URL read back as the strings they are."""
    from hydra.core.override_parser.types import Quote, QuotedString

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return QuotedString(text=value, quote=Quote.single).with_quotes()
    if isinstance(value, list):
        return "[" + ",".join(_as_override_value(item) for item in value) + "]"
    if isinstance(value, dict):
        # A key is written as Hydra read it, its special characters escaped again.
        items = (_HYDRA_SPECIAL.sub(r"\\\1", str(key)) + ":" + _as_override_value(item) for key, item in value.items())
        return "{" + ",".join(items) + "}"
    raise TypeError(f"not an override value: {type(value).__name__}")
