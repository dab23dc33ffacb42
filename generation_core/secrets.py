"""Secrets in a run's config: one rule that finds them, masks them wherever the config is
written or sent, and hands them to the processes that need them through the environment.

A value is a secret when its key's name says so (`secret`, `password`, `credential`,
`authorization`, ... anywhere in the name; `key` or `token` as its last word, as in `api_key`,
`aws_secret_access_key`, `aws_session_token`, `key`; `key_id`) or when it lies under an
`env_vars` mapping (Ray's runtime env: names like OPENAI_API_KEY say nothing reliable). verl's
dataset column names (`prompt_key`, ...) are not secrets. The rule is by name, so it covers the
free-form sections (storage and data options, `engine_kwargs.*`, reward kwargs, Ray's init) too.

Masked copies (`without_secrets`) are what run.json, Prefect parameters, W&B, the report and
logs get. The values themselves stay in the memory of the process that loaded the config and
travel to shard workers in one environment variable, SECRETS_ENV, which Ray's runtime env
carries (ray_setup.RAY_WORKER_ENV); a worker puts them back (`with_secrets`) where its copy of
the plan holds the placeholder. A deployment run loads its config from its parameters on the
worker: its secrets come from that worker's environment (`${oc.env:NAME}` in an override, or
the AWS_* variables s3fs reads), never from the parameters.
"""

from __future__ import annotations

import copy
import json
import os
import re
from typing import Any

PLACEHOLDER = "<redacted>"
SECRETS_ENV = "GENRUN_CONFIG_SECRETS"
"""JSON list of [path, value] pairs: the config's secrets, for the run's own workers."""

# Words that make any name a secret, wherever they stand.
SECRET_WORDS = frozenset({"secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials", "apikey", "authorization", "cookie", "bearer"})
# Words that make a name a secret as its last word (`api_key`, `aws_session_token`), not
# elsewhere (`max_token_len_per_gpu`, `num_key_value_heads`).
SECRET_LAST_WORDS = frozenset({"key", "token", "pwd"})
# verl's names of dataset columns: keys that hold a column name, not a secret.
COLUMN_NAMES = frozenset({"prompt_key", "reward_fn_key", "image_key", "video_key", "audio_key", "teacher_key", "tools_key", "messages_key", "response_key", "answer_key", "question_key"})
# Everything under a mapping of this name is a secret (environment variables of Ray workers).
SECRET_MAPPINGS = frozenset({"env_vars"})

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
    return bool(SECRET_WORDS & set(words)) or words[-1] in SECRET_LAST_WORDS or words[-2:] == ["key", "id"]


def split_secrets(container: Any) -> tuple[Any, list[tuple[Path, Any]]]:
    """(a copy of `container` with every secret replaced by PLACEHOLDER, [(path, value)] of the
    secrets). None and empty values are left as they are: there is nothing to hide."""
    found: list[tuple[Path, Any]] = []

    def walk(node: Any, path: Path, secret: bool) -> Any:
        if isinstance(node, dict):
            return {name: walk(value, (*path, name), secret or is_secret_name(name) or name in SECRET_MAPPINGS) for name, value in node.items()}
        if secret and node not in (None, "", [], {}):
            found.append((path, node))
            return PLACEHOLDER
        if isinstance(node, list):
            return [walk(value, (*path, index), secret) for index, value in enumerate(node)]
        return node

    return walk(container, (), False), found


def without_secrets(container: Any) -> Any:
    """A copy safe to write, send or log: run.json, Prefect parameters, W&B, reports."""
    return split_secrets(container)[0]


def with_secrets(container: Any, secrets: list[tuple[Path, Any]]) -> Any:
    """A copy of a masked `container` with the secrets put back where it holds the placeholder
    (a path the config does not mask is left alone: the secrets belong to another run)."""
    container = copy.deepcopy(container)
    for path, value in secrets:
        node = container
        try:
            for step in path[:-1]:
                node = node[step]
            if node[path[-1]] == PLACEHOLDER:
                node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue
    return container


def masked_paths(container: Any) -> list[str]:
    """Where `container` still holds the placeholder: secrets this process was not given."""
    return [".".join(map(str, path)) for path, value in split_secrets(container)[1] if value == PLACEHOLDER]


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
    """Hydra overrides safe to store (the flow run's `overrides` parameter): the value of one
    that sets a secret, or of a `{...}` mapping that names one, is masked."""
    masked = []
    for override in overrides:
        key, sep, value = override.partition("=")
        names = key.lstrip("+~").split(".")
        named = any(is_secret_name(name) or name in SECRET_MAPPINGS for name in names)
        if sep and value and (named or (value.lstrip().startswith("{") and any(is_secret_name(n) or n in SECRET_MAPPINGS for n in re.findall(r"([\w-]+)\s*:", value)))):
            override = f"{key}={PLACEHOLDER}"
        masked.append(override)
    return masked
