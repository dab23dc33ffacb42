"""The secrets rule (generation_core/secrets.py): which keys and which parts of a URL are
secrets, masking a config and Hydra overrides at any depth, and the masked values that config
loading refuses. What a whole run writes: tests/test_security.py."""

from __future__ import annotations

import pytest

from generation_core.config.loading import load_config

pytestmark = pytest.mark.timeout(120)


def test_the_config_secrets_rule():
    from generation_core.secrets import (
        PLACEHOLDER,
        is_secret_name,
        overrides_without_secrets,
        split_secrets,
        with_secrets,
    )

    secret = [
        "key",
        "secret",
        "token",
        "api_key",
        "aws_secret_access_key",
        "aws_access_key_id",
        "awsSessionToken",
        "hf_token",
        "password",
        "Authorization",
        "credentials",
    ]
    not_secret = [
        "prompt_key",
        "image_key",
        "endpoint_url",
        "profile",
        "anon",
        "tokenizer",
        "max_token_len_per_gpu",
        "num_key_value_heads",
        "profile_token_start",
    ]
    assert [name for name in secret if not is_secret_name(name)] == []
    assert [name for name in not_secret if is_secret_name(name)] == []
    config = {
        "a": {"api_key": "K", "url": "u", "n": None},
        "ray": {"env_vars": {"ANY_NAME": "E"}},
        "data": {"prompt_key": "prompt"},
    }
    masked, secrets = split_secrets(config)
    assert masked == {
        "a": {"api_key": PLACEHOLDER, "url": "u", "n": None},
        "ray": {"env_vars": {"ANY_NAME": PLACEHOLDER}},
        "data": {"prompt_key": "prompt"},
    }
    assert with_secrets(masked, secrets) == config
    assert overrides_without_secrets(["x.api_key=K", "+ray.env_vars.A=E", "data.storage_options={key: K}", "n=2"]) == [
        f"x.api_key='{PLACEHOLDER}'",
        f"+ray.env_vars.A='{PLACEHOLDER}'",
        f"data.storage_options={{key:'{PLACEHOLDER}'}}",
        "n=2",
    ]


def test_a_secret_at_any_depth_of_an_override_is_masked_and_the_override_still_reads():
    """Issue 43 item 6 / audit #3: a secret inside a list-valued override
    (`data.train_tasks=[{loading_params: {token: ...}}]`) reached the flow run's `overrides`
    parameter (Prefect's database) and W&B's command line in clear. Each override is read with
    Hydra's grammar and the secrets rule applied at every depth under its full key; what is
    masked is written back as an override Hydra reads, one that config loading refuses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from generation_core.errors import GenrunError
    from generation_core.secrets import PLACEHOLDER, overrides_without_secrets

    tasks = (
        "data.train_tasks=[{loading_params: {path: json, data_files: /d/t.jsonl, token: hf_AUDITSECRET123}, "
        'prompt_format: {type: template, prompt_template: "Q: {question}"}, data_source: sec}]'
    )
    given = [
        tasks,
        "+ray_kwargs.ray_init.runtime_env=[{env_vars: {ANY: ray-secret}}]",
        "~actor_rollout_ref.rollout.engine_kwargs.remote.api_key=deleted-if-equal",
        "data.storage_options={client_kwargs: {aws_secret_access_key: nested}, anon: false, n: null, f: 1.5}",
        "actor_rollout_ref.rollout.engine_kwargs.remote.base_urls=['http://u:pw-in-url@h:1', http://h:2]",
        "reward.custom_reward_function.reward_kwargs.api_key=a,b",
        "data.train_files=[/d/a.parquet,'/d/b c.parquet']",
        "+storage.options.token=",
        "~data.val_files",
    ]
    masked = overrides_without_secrets(given)
    assert masked == [
        "data.train_tasks=[{loading_params:{path:'json',data_files:'/d/t.jsonl',token:'<redacted>'},"
        "prompt_format:{type:'template',prompt_template:'Q: {question}'},data_source:'sec'}]",
        "+ray_kwargs.ray_init.runtime_env=[{env_vars:{ANY:'<redacted>'}}]",
        "~actor_rollout_ref.rollout.engine_kwargs.remote.api_key='<redacted>'",
        "data.storage_options={client_kwargs:{aws_secret_access_key:'<redacted>'},anon:false,n:null,f:1.5}",
        "actor_rollout_ref.rollout.engine_kwargs.remote.base_urls=['http://<redacted>@h:1','http://h:2']",
        "reward.custom_reward_function.reward_kwargs.api_key='<redacted>'",
        # What holds no secret stays as it was typed; so does an empty value (nothing to hide).
        "data.train_files=[/d/a.parquet,'/d/b c.parquet']",
        "+storage.options.token=",
        "~data.val_files",
    ]
    parser = OverridesParser.create()
    assert parser.parse_override(masked[0]).value()[0] == {
        "loading_params": {"path": "json", "data_files": "/d/t.jsonl", "token": PLACEHOLDER},
        "prompt_format": {"type": "template", "prompt_template": "Q: {question}"},
        "data_source": "sec",
    }, "the masked override reads back as the same value, the secret replaced"
    assert all(parser.parse_override(text) for text in masked)
    mask = r": <redacted> is the mask genrun stores in place of a secret"
    with pytest.raises(GenrunError, match=r"^data.storage_options.client_kwargs.aws_secret_access_key" + mask):
        load_config([masked[3]])  # never sent to the bucket as the secret
    with pytest.raises(GenrunError, match=r"^actor_rollout_ref.rollout.engine_kwargs.remote.base_urls.0" + mask):
        load_config(["actor_rollout_ref.rollout.name=remote", masked[4]])


def test_credentials_inside_urls_are_masked_and_the_url_stays_readable():
    """Issue 43 item 6 / audit #13: the user part of a URL and its signed or tokened query
    parameters passed `without_secrets` unchanged (run.json, the zip, the card, Prefect). Only
    those parts are masked, whatever the key; the worker gets the URL back."""
    from generation_core.secrets import (
        PLACEHOLDER,
        masked_paths,
        split_secrets,
        with_secrets,
        without_secrets,
        without_url_credentials,
    )

    presigned = (
        "https://bucket.s3.amazonaws.com/p.parquet?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=AKIAEXAMPLE%2F20261127"
        "&X-Amz-Date=20261127T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Security-Token=FwoGZX"
        "&X-Amz-Signature=d1e2f3"
    )
    config = {
        "remote": {"base_urls": ["https://user:pass@host.example:8443/v1", "http://127.0.0.1:8000"]},
        "data": {"train_files": [presigned, "s3://bucket/plain.parquet?versionId=7"]},
        "links": {
            "sas": "https://acct.blob.core.windows.net/c/f.json?sv=2022-11-02&sp=r&sig=AZSIG",
            "oauth": "https://app.example/cb?code=OAUTHCODE&state=s1#access_token=FRAG&token_type=bearer",
            "params": "https://api.example/x?token=T1&access_token=T2&key=K1&api_key=K2&page=3",
            "git": "https://ghp_TOKEN@github.com/org/repo.git",
            "azure": "abfs://container@account.dfs.core.windows.net/data",
            "db": "postgresql://app:dbpass@db.internal:5432/genrun",
        },
    }
    masked, secrets = split_secrets(config)
    assert masked == {
        "remote": {"base_urls": [f"https://{PLACEHOLDER}@host.example:8443/v1", "http://127.0.0.1:8000"]},
        "data": {
            "train_files": [
                f"https://bucket.s3.amazonaws.com/p.parquet?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={PLACEHOLDER}"
                f"&X-Amz-Date=20261127T000000Z&X-Amz-Expires=3600&X-Amz-SignedHeaders=host"
                f"&X-Amz-Security-Token={PLACEHOLDER}"
                f"&X-Amz-Signature={PLACEHOLDER}",
                "s3://bucket/plain.parquet?versionId=7",
            ]
        },
        "links": {
            "sas": f"https://acct.blob.core.windows.net/c/f.json?sv=2022-11-02&sp=r&sig={PLACEHOLDER}",
            "oauth": f"https://app.example/cb?code={PLACEHOLDER}&state=s1#access_token={PLACEHOLDER}&token_type=bearer",
            "params": f"https://api.example/x?token={PLACEHOLDER}&access_token={PLACEHOLDER}&key={PLACEHOLDER}"
            f"&api_key={PLACEHOLDER}&page=3",
            "git": f"https://{PLACEHOLDER}@github.com/org/repo.git",
            # The user part names a container here, not a user.
            "azure": "abfs://container@account.dfs.core.windows.net/data",
            "db": f"postgresql://{PLACEHOLDER}@db.internal:5432/genrun",
        },
    }
    assert with_secrets(masked, secrets) == config, "the workers get the URLs back"
    assert masked_paths(config) == []
    assert masked_paths(masked) == [
        "remote.base_urls.0",
        "data.train_files.0",
        "links.sas",
        "links.oauth",
        "links.params",
        "links.git",
        "links.db",
    ]
    assert without_secrets(masked) == masked, "masking a masked copy changes nothing"
    # A URL under a secret's name is masked whole, and comes back whole.
    named = {"webhook_url": "https://user:pass@hooks.example/x"}
    assert without_secrets(named) == {"webhook_url": PLACEHOLDER} and with_secrets(*split_secrets(named)) == named
    message = "http://u:pw@10.0.0.5:8000: ConnectError: refused (see 'https://h/x?sig=S&a=1')"
    assert without_url_credentials(message) == (
        f"http://{PLACEHOLDER}@10.0.0.5:8000: ConnectError: refused (see 'https://h/x?sig={PLACEHOLDER}&a=1')"
    )


def test_secret_names_beyond_key_token_and_password():
    """Issue 43 item 6 / audit #13: `connection_string` (Azure's holds AccountKey=), `dsn`,
    `auth`, `auth_header`, `webhook_url`, `passkey` and `private_key_pem` were not secret names."""
    from generation_core.secrets import is_secret_name

    secret = [
        "connection_string",
        "connectionString",
        "AZURE_STORAGE_CONNECTION_STRING",
        "conn_str",
        "dsn",
        "sentry_dsn",
        "auth",
        "basic_auth",
        "auth_header",
        "webhook_url",
        "slack_webhook",
        "passkey",
        "private_key",
        "private_key_pem",
        "private_key_path",
        "client_secret",
        "refresh_token",
        "sas_token",
        "account_key",
    ]
    not_secret = ["author", "prefill_seconds_per_token", "authority_url", "keyword", "tokens_per_second", "teacher_key"]
    assert [name for name in secret if not is_secret_name(name)] == []
    assert [name for name in not_secret if is_secret_name(name)] == []


def test_remote_server_messages_and_replica_names_hold_no_url_credentials():
    """Issue 43 item 6 / audit #13: RemoteServer put its base URL, credentials included, into
    every error (the shard's failure log, the report) and used it as the replica's name (the
    routing log, every trajectory's turns, the ledger in manifest.json). The server is still
    asked with them: the user part reaches it as Basic auth."""
    import asyncio
    import base64
    import socket

    from generation_core.engines.remote import (
        CompletionsServers,
        RemoteRequestRejected,
        RemoteServerUnavailable,
        check_servers,
    )
    from generation_core.errors import GenrunError
    from generation_core.serving.routing import RoutingClient
    from tests.scripted_server import ScriptedServer

    server = ScriptedServer()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    live = f"http://judge:pw-9a8b7c@127.0.0.1:{server.port}"
    shown = f"http://<redacted>@127.0.0.1:{server.port}"
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}

    def cfg(*urls):
        return load_config(
            [
                "actor_rollout_ref.rollout.name=remote",
                "actor_rollout_ref.rollout.engine_kwargs.remote.health_interval=0.2",
                f"actor_rollout_ref.rollout.engine_kwargs.remote.base_urls=[{','.join(repr(url) for url in urls)}]",
            ]
        )

    async def scenario():
        client = RoutingClient(cfg(live), CompletionsServers(cfg(live)))
        errors = []
        try:
            await client.generate("r0", prompt_ids=[5], sampling_params=sampling)
            replica = client.server_of("r0")
            for status, failure in ((400, RemoteRequestRejected), (503, RemoteServerUnavailable)):
                server.fail_next = [status]
                with pytest.raises(failure) as caught:
                    await client.generate(f"r{status}", prompt_ids=[6], sampling_params=sampling)
                errors.append(str(caught.value))
        finally:
            await client.aclose()
        return replica, errors

    try:
        replica, errors = asyncio.run(scenario())
        assert replica == shown
        assert errors[0].startswith(f"{shown} refused request r400 (400)"), errors
        assert errors[1].startswith(f"{shown} answered 503"), errors
        assert asyncio.run(check_servers(cfg(live))) == {shown: "scripted-model"}
        with pytest.raises(GenrunError) as down:
            asyncio.run(check_servers(cfg(f"http://judge:pw-9a8b7c@127.0.0.1:{dead_port}")))
        assert f"http://<redacted>@127.0.0.1:{dead_port}: ConnectError" in str(down.value)
        assert "pw-9a8b7c" not in " ".join([*errors, str(down.value)])
        sent = {headers.get("authorization") for _, _, headers in server.received}
        basic = "Basic " + base64.b64encode(b"judge:pw-9a8b7c").decode()
        assert sent == {basic}, "the server still gets the credentials"
    finally:
        server.stop()


def test_no_default_key_of_verl_or_genrun_is_a_secret_but_the_remote_api_key():
    """Issue 43 item 6: the wider rule must not mask verl's own settings. Every key of verl's
    generated ppo_trainer config and genrun's defaults, each given a value: only the remote
    server's api_key is masked (before: the simulated engine's `prefill_seconds_per_token`, a rate,
    when that engine was in genrun's defaults, and verl's distillation `teacher_models.*.key`, a
    dataset name, were)."""
    from omegaconf import OmegaConf

    from generation_core.config.loading import default_config
    from generation_core.secrets import split_secrets

    def filled(node):
        if isinstance(node, dict):
            return {name: filled(value) for name, value in node.items()}
        if isinstance(node, list):
            return [filled(value) for value in node] or ["value"]
        return "value"

    defaults = OmegaConf.to_container(default_config())
    masked = [".".join(map(str, path)) for path, _ in split_secrets(filled(defaults))[1]]
    assert masked == ["actor_rollout_ref.rollout.engine_kwargs.remote.api_key"]


def test_a_refusal_that_quotes_a_url_masks_its_credentials(tmp_path, capsys):
    """Issue 43 item 6 (audit #13, error messages): genrun's one-line refusal names the data file
    the user gave, with the URL's credentials masked; nothing is written."""
    from flows.cli import main

    for url in (
        "https://alice:s3cr3tpw@127.0.0.1:9/prompts.parquet",
        "https://127.0.0.1:9/prompts.parquet?X-Amz-Signature=s3cr3tpw",
    ):
        code = main([f"data.train_files='{url}'", f"trainer.default_local_dir={tmp_path / 'run'}"])
        error = capsys.readouterr().err
        # Refused before anything stores the URL (run.json, the plan Prefect keeps), naming it masked.
        assert code == 2 and "s3cr3tpw" not in error and "data.train_files holds a URL with credentials" in error, error
        assert "<redacted>" in error and not (tmp_path / "run").exists()


def test_an_unreadable_override_is_judged_by_the_one_secrets_rule():
    """Audit 2026-11-28 #10: an override Hydra cannot read is shown in its refusal only when
    nothing in it may be a secret (config/loading.py names it by its key otherwise)."""
    from generation_core.secrets import unreadable_override_holds_secret

    for override in (
        "actor_rollout_ref.rollout.engine_kwargs.remote.api_key=[sk-1",
        "+ray_kwargs.ray_init.runtime_env.env_vars.OPENAI_API_BASE=[x",
        "storage.options.credentials.x=[y",
        "storage.options={aws_secret_access_key: y",
        "data.train_files=[https://u:p@host/a.parquet",
    ):
        assert unreadable_override_holds_secret(override), override
    for override in ("data.prompt_key=[x", "data.train_files=[a.parquet", "generation.num_shards=[2"):
        assert not unreadable_override_holds_secret(override), override
