use super::*;

const MINIMAL: &str = r#"
[applications.demo]
tenant = "demo"
api_key_sha256 = ["a1f9b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f80"]

[engines.llama]
type = "openai"
base_url = "http://127.0.0.1:8081"
model = "gemma"

[models.general-chat]
instances = ["llama"]
"#;

fn parse(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigErrors> {
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
    Config::from_toml_str(text, env, Path::new("."))
}

#[test]
fn minimal_config_gets_defaults() {
    let c = parse(MINIMAL, &[]).unwrap();
    assert_eq!(c.http.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(c.store.data_dir, PathBuf::from("data"));
    assert_eq!(c.models["general-chat"].queue_capacity, 256);
    assert_eq!(c.applications["demo"].max_priority, Priority::P1);
    assert_eq!(c.kv_cache_high_water, 0.95);
}

#[test]
fn an_applications_context_policy_is_auto_or_disabled() {
    assert_eq!(parse(MINIMAL, &[]).unwrap().applications["demo"].context_policy, ContextPolicy::Auto);
    let with = |v: &str| MINIMAL.replace("[engines.llama]", &format!("context_policy = \"{v}\"\n\n[engines.llama]"));
    assert_eq!(parse(&with("disabled"), &[]).unwrap().applications["demo"].context_policy, ContextPolicy::Disabled);
    let e = parse(&with("truncate"), &[]).unwrap_err();
    assert_eq!(e.0[0].path, "applications.demo.context_policy", "{e}");
}

#[test]
fn store_retention_buffer_and_drain_have_defaults_and_bounds() {
    let c = parse(MINIMAL, &[]).unwrap();
    assert_eq!(c.store.max_buffered_writes, 100_000);
    assert_eq!(c.store.retention_tasks, Some(std::time::Duration::from_secs(720 * 3600)));
    assert_eq!(c.store.retention_rejected, Some(std::time::Duration::from_secs(168 * 3600)));
    assert_eq!(c.server.drain_timeout, std::time::Duration::from_secs(30));
    let keep = parse(&format!("{MINIMAL}\n[store]\nretention_tasks_hours = 0\nretention_rejected_hours = 0\n"), &[]);
    let keep = keep.unwrap();
    assert_eq!((keep.store.retention_tasks, keep.store.retention_rejected), (None, None));
    let e = parse(&format!("{MINIMAL}\n[store]\nmax_buffered_writes = 10\n[server]\ndrain_timeout_s = 7200\n"), &[])
        .unwrap_err();
    let paths: Vec<&str> = e.0.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["store.max_buffered_writes", "server.drain_timeout_s"], "{e}");
}

#[test]
fn store_reserve_defaults_to_8_mib_and_is_bounded() {
    assert_eq!(parse(MINIMAL, &[]).unwrap().store.reserve_bytes, 8 << 20);
    let none = parse(&format!("{MINIMAL}\n[store]\nreserve_bytes = 0\n"), &[]).unwrap();
    assert_eq!(none.store.reserve_bytes, 0);
    for bad in ["1000", "2000000000"] {
        let e = parse(&format!("{MINIMAL}\n[store]\nreserve_bytes = {bad}\n"), &[]).unwrap_err();
        assert_eq!(e.0[0].path, "store.reserve_bytes", "{bad}: {e}");
    }
}

#[test]
fn kv_cache_high_water_is_a_fraction() {
    for bad in ["0", "-0.5", "1.5", "nan"] {
        let e = parse(&format!("{MINIMAL}\n[resources]\nkv_cache_high_water = {bad}\n"), &[]).unwrap_err();
        assert_eq!(e.0[0].path, "resources.kv_cache_high_water", "{bad}: {e}");
    }
    let c = parse(&format!("{MINIMAL}\n[resources]\nkv_cache_high_water = 1\n"), &[]).unwrap();
    assert_eq!(c.kv_cache_high_water, 1.0);
}

#[test]
fn env_overrides_reach_nested_keys_with_dashes() {
    let c = parse(
        MINIMAL,
        &[
            ("EDGEWAY__HTTP__LISTEN", "0.0.0.0:9000"),
            ("EDGEWAY__ENGINES__LLAMA__MAX_CONCURRENCY", "4"),
            ("EDGEWAY__MODELS__GENERAL_CHAT__CONTEXT_TOKENS", "8192"),
            ("OTHER__HTTP__LISTEN", "ignored"),
        ],
    )
    .unwrap();
    assert_eq!(c.http.listen.to_string(), "0.0.0.0:9000");
    assert_eq!(c.engines["llama"].max_concurrency, 4);
    assert_eq!(c.models["general-chat"].context_tokens, 8192);
}

#[test]
fn unknown_keys_are_refused_with_their_path() {
    let e = parse(&format!("{MINIMAL}\n[http]\nlisten_addr = \"x\"\n"), &[]).unwrap_err();
    assert_eq!(e.0.len(), 1);
    assert_eq!(e.0[0].path, "http.listen_addr");
    assert!(e.0[0].message.contains("listen_addr"), "{}", e.0[0].message);
}

#[test]
fn all_semantic_errors_are_reported_by_key_path() {
    let text = r#"
[http]
listen = "nowhere"
[applications.demo]
tenant = "demo"
api_key_sha256 = ["not-hex"]
max_priority = "P9"
[engines.llama]
type = "tgi"
base_url = "ftp://x"
model = "m"
max_concurrency = 0
[models.chat]
instances = ["missing"]
"#;
    let e = parse(text, &[]).unwrap_err();
    let paths: Vec<&str> = e.0.iter().map(|e| e.path.as_str()).collect();
    for want in [
        "http.listen",
        "applications.demo.api_key_sha256[0]",
        "applications.demo.max_priority",
        "engines.llama.type",
        "engines.llama.base_url",
        "engines.llama.max_concurrency",
        "models.chat.instances[0]",
    ] {
        assert!(paths.contains(&want), "missing {want} in {paths:?}");
    }
}

#[test]
fn api_keys_for_cloud_engines_come_from_the_environment() {
    let text = MINIMAL.replace("model = \"gemma\"", "model = \"gemma\"\napi_key_env = \"CLOUD_KEY\"");
    let e = parse(&text, &[]).unwrap_err();
    assert_eq!(e.0[0].path, "engines.llama.api_key_env");
    let c = parse(&text, &[("CLOUD_KEY", "sk-secret")]).unwrap();
    assert_eq!(c.engines["llama"].api_key.as_deref(), Some("sk-secret"));
}

#[test]
fn example_configs_validate() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("toml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        // HOME: edgeway.toml finds its engines under ${HOME}/.cache/edgeway.
        let env = [
            ("EDGEWAY_JWT_SECRET", "an-example-secret-of-32-bytes!!!"),
            ("OPENAI_API_KEY", "sk-test"),
            ("HOME", "/home/edge"),
            // external-broker.toml: edgeway's password on the broker.
            ("EDGEWAY_MQTT_BROKER_PASSWORD", "broker-secret"),
            // two-node-pool.toml: the pool's shared key.
            ("EDGEWAY_POOL_KEY", "an-example-pool-key-of-32-bytes!!"),
        ];
        parse(&text, &env).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        n += 1;
    }
    assert!(n >= 1, "no example configs found in {}", dir.display());
}

/// The example config runs both llama-servers itself, from
/// `${EDGEWAY_CACHE}` (default `~/.cache/edgeway`), with the chat template
/// the demo model lacks; `enabled = false` keeps the section but edgeway
/// then does not run the engine.
#[test]
fn example_config_runs_its_engines_from_the_cache() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/edgeway.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let load = |env: &[(&str, &str)]| {
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string()));
        Config::from_toml_str(&text, env, path.parent().unwrap()).unwrap()
    };
    let c = load(&[("HOME", "/home/edge")]);
    let p = c.engines["llama-local"].process.clone().expect("llama-local is run by edgeway");
    assert_eq!(p.command, "/home/edge/.cache/edgeway/bin/llama-server");
    assert!(p.args.contains(&"/home/edge/.cache/edgeway/models/gemma-3-270m-q4_k_m.gguf".to_string()));
    let t = p.args.iter().position(|a| a == "--chat-template-file").expect("a chat template");
    let template = p.cwd.clone().expect("cwd").join(&p.args[t + 1]);
    assert!(template.is_file(), "{}", template.display());
    assert!(c.engines["llama-embed"].process.as_ref().unwrap().args.contains(&"--embeddings".to_string()));
    let c = load(&[("EDGEWAY_CACHE", "/opt/ew"), ("EDGEWAY__ENGINES__LLAMA_EMBED__PROCESS__ENABLED", "false")]);
    assert_eq!(c.engines["llama-local"].process.as_ref().unwrap().command, "/opt/ew/bin/llama-server");
    assert!(c.engines["llama-embed"].process.is_none());
    // Review L3: with neither HOME nor EDGEWAY_CACHE set, the example
    // failed to load even with both engines disabled; a disabled section
    // is not expanded.
    let off = [
        ("EDGEWAY__ENGINES__LLAMA_LOCAL__PROCESS__ENABLED", "false"),
        ("EDGEWAY__ENGINES__LLAMA_EMBED__PROCESS__ENABLED", "false"),
    ];
    let c = load(&off);
    assert!(c.engines["llama-local"].process.is_none() && c.engines["llama-embed"].process.is_none());
    let env = off[..1].iter().map(|(k, v)| (k.to_string(), v.to_string()));
    let err = Config::from_toml_str(&text, env, path.parent().unwrap()).unwrap_err().to_string();
    assert!(err.contains("llama-embed.process") && err.contains("HOME is not set"), "{err}");
}

#[test]
fn kv_bytes_per_token_comes_from_the_architecture() {
    let arch = "architecture = { layers = 18, kv_heads = 1, head_dim = 256 }\n";
    let c = parse(&format!("{MINIMAL}{arch}"), &[]).unwrap();
    assert_eq!(c.models["general-chat"].kv_bytes_per_token, 18432, "Gemma 3 270M at f16");
    let q8 = "architecture = { layers = 32, kv_heads = 8, head_dim = 128, bytes_per_value = 1 }\n";
    assert_eq!(parse(&format!("{MINIMAL}{q8}"), &[]).unwrap().models["general-chat"].kv_bytes_per_token, 65536);
    let both = format!("{MINIMAL}kv_bytes_per_token = 1\n{arch}");
    assert_eq!(parse(&both, &[]).unwrap_err().0[0].path, "models.general-chat.architecture");
    let zero = format!("{MINIMAL}architecture = {{ layers = 0, kv_heads = 1, head_dim = 1 }}\n");
    assert_eq!(parse(&zero, &[]).unwrap_err().0[0].path, "models.general-chat.architecture");
    assert_eq!(parse(MINIMAL, &[]).unwrap().models["general-chat"].kv_bytes_per_token, 0, "no memory admission");
}

#[test]
fn context_budget_keys_are_checked() {
    for (key, bad) in [
        ("context_margin_percent", "4"),
        ("context_margin_percent", "11"),
        ("knowledge_budget_percent", "101"),
        ("tool_results_budget_percent", "101"),
    ] {
        let e = parse(&format!("{MINIMAL}{key} = {bad}\n"), &[]).unwrap_err();
        assert_eq!(e.0[0].path, format!("models.general-chat.{key}"), "{bad}: {e}");
    }
    let m = &parse(&format!("{MINIMAL}context_margin_percent = 10\n"), &[]).unwrap().models["general-chat"];
    assert_eq!(m.context_budget.margin, 0.1);
    assert_eq!(parse(MINIMAL, &[]).unwrap().models["general-chat"].context_budget.margin, 0.05);
    let e = parse(&format!("{MINIMAL}[context]\nsecret_patterns = ['(']\n"), &[]).unwrap_err();
    assert_eq!(e.0[0].path, "context.secret_patterns[0]");
}

#[test]
fn memory_margin_is_a_positive_percentage() {
    for bad in ["-100", "-1", "nan", "inf"] {
        let e = parse(&format!("{MINIMAL}memory_margin_percent = {bad}\n"), &[]).unwrap_err();
        assert_eq!(e.0[0].path, "models.general-chat.memory_margin_percent", "{bad}: {e}");
    }
    assert!(parse(&format!("{MINIMAL}memory_margin_percent = 0\n"), &[]).is_ok());
}

#[test]
fn problems_in_different_sections_are_reported_together() {
    // A typed value serde refuses, a rule broken, a required key missing:
    // one load names them all, each by its own key path.
    let text = format!(
        "{MINIMAL}\n[http]\nlisten = \"nonsense\"\n[log]\nformat = \"yaml\"\n\
         [engines.vllm]\ntype = \"openai\"\nmodel = \"m\"\nmax_concurrency = 0\n\
         [applications.other]\nmax_priority = \"P1\"\n"
    );
    let e = parse(&text, &[]).unwrap_err();
    let paths: Vec<&str> = e.0.iter().map(|e| e.path.as_str()).collect();
    for want in [
        "http.listen",
        "log.format",
        "engines.vllm.base_url",
        "engines.vllm.max_concurrency",
        "applications.other.tenant",
    ] {
        assert!(paths.contains(&want), "missing {want} in {paths:?}");
    }
    assert_eq!(paths.len(), 5, "{e}");
    assert!(e.to_string().starts_with("5 configuration error(s):"), "{e}");
}

#[test]
fn a_bad_typed_value_names_its_key_and_the_value() {
    let cases = [
        ("[http]\nlisten = \"nonsense\"\n", "http.listen", "nonsense"),
        ("[http]\nadmin_listen = \"127.0.0.1\"\n", "http.admin_listen", "127.0.0.1"),
        ("[http]\nlisten = 8080\n", "http.listen", "8080"),
        ("[log]\nformat = \"yaml\"\n", "log.format", "yaml"),
        ("[resources]\ncancel_from_priority = \"P9\"\n", "resources.cancel_from_priority", "P9"),
    ];
    for (section, path, value) in cases {
        let e = parse(&format!("{MINIMAL}\n{section}"), &[]).unwrap_err();
        assert_eq!(e.0.len(), 1, "{section}: {e}");
        assert_eq!(e.0[0].path, path, "{section}: {e}");
        assert!(e.0[0].message.contains(value), "{section}: {e}");
    }
    let e = parse(&MINIMAL.replace("type = \"openai\"", "type = \"tgi\""), &[]).unwrap_err();
    assert_eq!(e.0[0].path, "engines.llama.type");
    assert!(e.0[0].message.contains("tgi") && e.0[0].message.contains("ollama"), "{e}");
    let e = parse(&MINIMAL.replace("tenant = \"demo\"", "tenant = \"demo\"\ndefault_priority = \"high\""), &[])
        .unwrap_err();
    assert_eq!(e.0[0].path, "applications.demo.default_priority");
    assert!(e.0[0].message.contains("P0..P4") && e.0[0].message.contains("high"), "{e}");
}

#[test]
fn typed_values_are_spelt_as_before() {
    let text = format!(
        "{MINIMAL}\n[http]\nadmin_listen = \"[::1]:9090\"\n[log]\nformat = \"json\"\n\
         [resources]\ncancel_from_priority = \" p1 \"\n"
    );
    let text = text.replace("tenant = \"demo\"", "tenant = \"demo\"\nmax_priority = \"p0\"");
    let c = parse(&text, &[]).unwrap();
    assert_eq!(c.http.admin_listen, Some("[::1]:9090".parse().unwrap()));
    assert_eq!(c.log.format, LogFormat::Json);
    assert_eq!(c.resources.cancel_from_priority, Priority::P1);
    assert_eq!(c.applications["demo"].max_priority, Priority::P0);
    let c = parse(&MINIMAL.replace("type = \"openai\"", "type = \"ollama\""), &[]).unwrap();
    assert_eq!(c.engines["llama"].kind, EngineKind::Ollama);
    assert_eq!(c.engines["llama"].health_path, "/api/tags");
}

#[test]
fn a_bad_cancel_from_priority_is_an_error_not_p3() {
    for bad in ["\"P5\"", "\"\"", "\"urgent\"", "3"] {
        let e = parse(&format!("{MINIMAL}\n[resources]\ncancel_from_priority = {bad}\n"), &[]).unwrap_err();
        assert_eq!(e.0.len(), 1, "{bad}: {e}");
        assert_eq!(e.0[0].path, "resources.cancel_from_priority", "{bad}: {e}");
    }
    let c = parse(&format!("{MINIMAL}\n[resources]\ncancel_from_priority = \"P4\"\n"), &[]).unwrap();
    assert_eq!(c.resources.cancel_from_priority, Priority::P4);
    assert_eq!(parse(MINIMAL, &[]).unwrap().resources.cancel_from_priority, Priority::P3, "the default");
}

#[test]
fn a_too_short_resource_poll_is_an_error_not_raised_silently() {
    let e = parse(&format!("{MINIMAL}\n[resources]\npoll_interval_ms = 10\n"), &[]).unwrap_err();
    assert_eq!(e.0[0].path, "resources.poll_interval_ms", "{e}");
    let c = parse(&format!("{MINIMAL}\n[resources]\npoll_interval_ms = 100\n"), &[]).unwrap();
    assert_eq!(c.resources.poll_interval, Duration::from_millis(100));
}

#[test]
fn values_too_large_for_their_unit_are_errors_not_panics() {
    let e = parse(&format!("{MINIMAL}\n[scheduler]\npriority_aging_seconds = 1e300\n"), &[]).unwrap_err();
    assert_eq!(e.0[0].path, "scheduler.priority_aging_seconds");
    let e = parse(&format!("{MINIMAL}weights_mb = 9223372036854775807\n"), &[]).unwrap_err();
    assert_eq!(e.0[0].path, "models.general-chat.weights_mb");
    let huge = "architecture = { layers = 4294967296, kv_heads = 4294967296, head_dim = 2 }\n";
    let e = parse(&format!("{MINIMAL}{huge}"), &[]).unwrap_err();
    assert_eq!(e.0[0].path, "models.general-chat.architecture");
    let e =
        parse(&MINIMAL.replace("model = \"gemma\"", "model = \"gemma\"\nmemory_budget_mb = 9223372036854775807"), &[])
            .unwrap_err();
    assert_eq!(e.0[0].path, "engines.llama.memory_budget_mb");
}

#[test]
fn required_keys_are_reported_by_path_with_the_rest() {
    let text = r#"
[applications.demo]
api_key_sha256 = ["a1f9b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f80"]
[engines.llama]
base_url = "http://127.0.0.1:8081"
[models.general-chat]
context_tokens = 8
architecture = { layers = 1 }
"#;
    let e = parse(text, &[]).unwrap_err();
    let paths: Vec<&str> = e.0.iter().map(|e| e.path.as_str()).collect();
    for want in [
        "applications.demo.tenant",
        "engines.llama.type",
        "engines.llama.model",
        "models.general-chat.instances",
        "models.general-chat.context_tokens",
        "models.general-chat.architecture.kv_heads",
        "models.general-chat.architecture.head_dim",
    ] {
        assert!(paths.contains(&want), "missing {want} in {paths:?}");
    }
}

#[test]
fn defaults_are_the_documented_ones() {
    let c = parse(MINIMAL, &[]).unwrap();
    assert_eq!(c.node_id, "edge-1");
    assert_eq!((c.http.admin_listen, c.http.max_body_bytes), (None, 4 * 1024 * 1024));
    assert!(!c.store.store_prompts);
    assert_eq!((c.log.format, c.log.level.as_str()), (LogFormat::Text, "info"));
    let t = &c.timeouts;
    assert_eq!(
        [t.queue, t.first_token, t.inference, t.idle, t.total].map(|d| d.as_millis()),
        [30_000, 60_000, 300_000, 30_000, 600_000]
    );
    let s = &c.scheduler;
    assert_eq!((s.queue_capacity, s.busy_retry_after_ms), (256, 1000));
    assert_eq!(s.queue_updates, Some(Duration::from_millis(1000)));
    assert_eq!((s.replay_retention, s.replay_max_bytes), (Duration::from_secs(300), 64 * 1024 * 1024));
    assert_eq!((s.max_queued, s.max_running), (None, None));
    assert_eq!(s.priority_aging, Some(Duration::from_secs(30)));
    assert_eq!((s.overload_max_output_tokens, s.idempotency_ttl), (128, Duration::from_secs(86_400)));
    let r = &c.resources;
    assert!(r.gpu);
    assert_eq!((r.poll_interval, r.danger_gpu_temperature_c), (Duration::from_secs(1), 90));
    assert_eq!((r.danger_gpu_memory_percent, r.cancel_from_priority), (98.0, Priority::P3));
    assert_eq!((c.cancel_grace, c.kv_cache_high_water), (Duration::from_secs(3), 0.95));
    let a = &c.applications["demo"];
    assert_eq!((a.max_priority, a.default_priority, a.admin), (Priority::P1, Priority::P2, false));
    assert_eq!((a.limits.weight, a.limits.max_running, a.limits.user_tokens_per_minute), (1.0, None, None));
    let e = &c.engines["llama"];
    assert_eq!((e.kind, e.max_concurrency, e.health_path.as_str()), (EngineKind::OpenAi, 1, "/v1/models"));
    assert_eq!((e.health_interval, e.connect_timeout), (Duration::from_secs(2), Duration::from_secs(2)));
    assert!(e.stream && e.is_local() && e.exclusive);
    assert_eq!((e.reserved_realtime_slots, e.memory_budget_bytes, e.api_key.as_deref()), (0, None, None));
    let m = &c.models["general-chat"];
    assert_eq!((m.context_tokens, m.max_output_tokens, m.weights_bytes), (4096, 1024, 0));
    assert_eq!(m.memory_margin, 0.1);
    assert!(c.auth.jwt.is_none() && c.nats.is_none() && c.mqtt.is_none() && c.devices.is_empty());

    let c =
        parse(&format!("{MINIMAL}\n[mqtt]\n[nats]\nurl = \"nats://127.0.0.1:4222\"\n[nats.jetstream]\n"), &[]).unwrap();
    let m = c.mqtt.unwrap();
    assert_eq!((m.listen.to_string(), m.topic_prefix.as_str()), ("127.0.0.1:1883".into(), "ai/v1"));
    assert!(m.tls.is_none() && m.ws_listen.is_none());
    assert_eq!((m.max_packet_bytes, m.max_request_bytes), (1024 * 1024, 512 * 1024));
    assert_eq!((m.max_connections, m.max_inflight, m.max_chunk_bytes), (20_000, 100, 512));
    assert_eq!(
        [m.connect_timeout, m.coalesce, m.disconnect_grace, m.replay_retention].map(|d| d.as_millis()),
        [10_000, 100, 60_000, 300_000]
    );
    assert_eq!(
        (m.replay_max_bytes, m.stream_replay_max_bytes, m.filter_log_bytes),
        (64 * 1024 * 1024, 1024 * 1024, 256 * 1024)
    );
    let n = c.nats.unwrap();
    assert_eq!((n.prefix.as_str(), n.queue_group.as_str(), n.name.as_str()), ("ai.v1", "edgeway", "edgeway-edge-1"));
    assert!(n.events);
    assert_eq!(n.events_queue_capacity, 8192);
    assert_eq!(
        [n.keepalive, n.caller_timeout, n.connect_timeout, n.reconnect_max_delay].map(|d| d.as_millis()),
        [2_000, 10_000, 2_000, 5_000]
    );
    let j = n.jetstream.unwrap();
    assert_eq!((j.stream.as_str(), j.max_age, j.max_bytes), ("EDGEWAY_EVENTS", Duration::from_secs(86_400), 1 << 30));
    assert_eq!(j.storage, JetStreamStorage::File);

    let jwt = parse(
        &format!("{MINIMAL}\n[auth.jwt]\nhs256_secret_env = \"S\"\n"),
        &[("S", "thirty-two-bytes-at-the-very-least")],
    )
    .unwrap()
    .auth
    .jwt
    .unwrap();
    assert_eq!((jwt.tenant_claim.as_str(), jwt.application_claim.as_str(), jwt.leeway_s), ("tenant", "app", 30));
}

#[test]
fn device_problems_are_reported_with_the_rest() {
    let text = format!(
        "{MINIMAL}\n[devices.cam-1]\ntenant = \"other\"\napplication = \"demo\"\nmax_priority = \"P0\"\n\
         password_sha256 = \"zz\"\n[devices.cam-2]\ntenant = \"demo\"\napplication = \"nope\"\n\
         [devices.cam-3]\ntenant = \"demo\"\napplication = \"demo\"\ndefault_priority = \"P7\"\n"
    );
    let e = parse(&text, &[]).unwrap_err();
    let paths: Vec<&str> = e.0.iter().map(|e| e.path.as_str()).collect();
    for want in [
        "devices.cam-1.tenant",
        "devices.cam-1.max_priority",
        "devices.cam-1.password_sha256",
        "devices.cam-2.application",
        "devices.cam-3.default_priority",
    ] {
        assert!(paths.contains(&want), "missing {want} in {paths:?}");
    }
    let ok = format!("{MINIMAL}\n[devices.cam-1]\ntenant = \"demo\"\napplication = \"demo\"\nmax_priority = \"P2\"\n");
    let d = &parse(&ok, &[]).unwrap().devices["cam-1"];
    assert_eq!((d.max_priority, d.default_priority, d.password_sha256), (Priority::P2, Priority::P2, None));
}

#[test]
fn a_device_may_set_its_stream_form_and_coalescing_within_the_request_bounds() {
    let text = format!(
        "{MINIMAL}\n[devices.cam-1]\ntenant = \"demo\"\napplication = \"demo\"\ncoalesce_ms = 60001\n\
         max_chunk_bytes = 0\n"
    );
    let e = parse(&text, &[]).unwrap_err();
    let paths: Vec<&str> = e.0.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["devices.cam-1.coalesce_ms", "devices.cam-1.max_chunk_bytes"]);
    let ok = format!(
        "{MINIMAL}\n[devices.cam-1]\ntenant = \"demo\"\napplication = \"demo\"\ncompact = true\ncoalesce_ms = 500\n\
         [devices.cam-2]\ntenant = \"demo\"\napplication = \"demo\"\n"
    );
    let c = parse(&ok, &[]).unwrap();
    let (d, plain) = (&c.devices["cam-1"], &c.devices["cam-2"]);
    assert_eq!((d.compact, d.coalesce, d.max_chunk_bytes), (true, Some(Duration::from_millis(500)), None));
    assert_eq!((plain.compact, plain.coalesce), (false, None));
}

#[test]
fn http_connection_limits_have_defaults_and_bounds() {
    let c = parse(MINIMAL, &[]).unwrap();
    assert_eq!((c.http.max_connections, c.http.admin_max_connections), (1024, 64));
    assert_eq!((c.http.header_read_timeout, c.http.idle_timeout), (Duration::from_secs(10), Duration::from_secs(60)));
    assert_eq!(c.http.max_connection_age, Duration::from_secs(600));
    let text = format!(
        "{MINIMAL}\n[http]\nmax_connections = 0\nadmin_max_connections = 0\n\
         header_read_timeout_ms = 10\nidle_timeout_ms = 99999999\nmax_connection_age_ms = 999\n"
    );
    let e = parse(&text, &[]).unwrap_err();
    let paths: Vec<&str> = e.0.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "http.max_connections",
            "http.admin_max_connections",
            "http.header_read_timeout_ms",
            "http.idle_timeout_ms",
            "http.max_connection_age_ms"
        ]
    );
}

#[test]
fn ws_max_in_flight_has_a_default_and_bounds() {
    assert_eq!(parse(MINIMAL, &[]).unwrap().http.ws_max_in_flight, 16);
    for bad in [0, 1025] {
        let e = parse(&format!("{MINIMAL}\n[http]\nws_max_in_flight = {bad}\n"), &[]).unwrap_err();
        assert_eq!(e.0[0].path, "http.ws_max_in_flight", "{bad}");
    }
}

#[test]
fn an_hs256_secret_has_at_least_32_bytes() {
    let text = format!("{MINIMAL}\n[auth.jwt]\nhs256_secret_env = \"S\"\n");
    let e = parse(&text, &[("S", &"x".repeat(31))]).unwrap_err();
    assert_eq!(e.0[0].path, "auth.jwt.hs256_secret_env");
    assert!(e.to_string().contains("at least 32 bytes"), "{e}");
    assert!(parse(&text, &[("S", &"x".repeat(32))]).is_ok());
}

#[test]
fn device_password_hashes_must_be_argon2_phc_strings() {
    let dev = |line: &str| format!("{MINIMAL}\n[devices.cam-1]\ntenant = \"demo\"\napplication = \"demo\"\n{line}\n");
    let e = parse(&dev("password_hash = \"5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8\""), &[])
        .unwrap_err();
    assert!(e.to_string().contains("devices.cam-1.password_hash"), "{e}");
    let phc = "$argon2id$v=19$m=19456,t=2,p=1$c2FsdHNhbHRzYWx0$Q2nd7vTfEcHG/eFu9jcSbAh4+fcBJhoTY4ue/Ac0O3E";
    let d = &parse(&dev(&format!("password_hash = \"{phc}\"")), &[]).unwrap().devices["cam-1"];
    assert_eq!(d.password_hash.as_deref(), Some(phc));
    let both = format!("password_hash = \"{phc}\"\npassword_sha256 = \"{}\"", "ab".repeat(32));
    assert!(parse(&dev(&both), &[]).unwrap_err().to_string().contains("not both"));
}

#[test]
fn the_resume_budget_has_a_default_and_a_floor() {
    let m = parse(&format!("{MINIMAL}\n[mqtt]\n"), &[]).unwrap().mqtt.unwrap();
    assert_eq!(m.resume_replay_bytes_per_s, 64 * 1024);
    let e = parse(&format!("{MINIMAL}\n[mqtt]\nresume_replay_bytes_per_s = 10\n"), &[]).unwrap_err();
    assert!(e.to_string().contains("mqtt.resume_replay_bytes_per_s"), "{e}");
    // The resume budget holds at least one minimal resume (a smaller one
    // made every resume panic under the sessions' lock).
    for bytes in [0, 511] {
        let e = parse(&format!("{MINIMAL}\n[mqtt]\nstream_replay_max_bytes = {bytes}\n"), &[]).unwrap_err();
        assert!(e.to_string().contains("mqtt.stream_replay_max_bytes"), "{e}");
    }
    assert!(parse(&format!("{MINIMAL}\n[mqtt]\nstream_replay_max_bytes = 512\n"), &[]).is_ok());
}

#[test]
fn the_long_prompt_lane_is_checked() {
    let with = |keys: &str| MINIMAL.replace("model = \"gemma\"", &format!("model = \"gemma\"\n{keys}"));
    let c = parse(&with("max_prefill_tokens = 8000"), &[]).unwrap();
    assert_eq!((c.engines["llama"].max_prefill_tokens, c.engines["llama"].long_prompt_tokens), (Some(8000), 2000));
    let c = parse(&with("max_prefill_tokens = 8000\nlong_prompt_tokens = 500"), &[]).unwrap();
    assert_eq!(c.engines["llama"].long_prompt_tokens, 500);
    assert_eq!(parse(MINIMAL, &[]).unwrap().engines["llama"].max_prefill_tokens, None);
    for (keys, path) in [
        ("max_prefill_tokens = 0", "engines.llama.max_prefill_tokens"),
        ("long_prompt_tokens = 500", "engines.llama.long_prompt_tokens"),
        ("max_prefill_tokens = 100\nlong_prompt_tokens = 500", "engines.llama.long_prompt_tokens"),
    ] {
        let e = parse(&with(keys), &[]).unwrap_err();
        assert_eq!(e.0[0].path, path, "{keys}: {e}");
    }
}

#[test]
fn model_kinds_are_checked_against_fallbacks_and_options() {
    let embed = "\n[models.embed]\ninstances = [\"llama\"]\nkind = \"embedding\"\ncontext_tokens = 512\n";
    let c = parse(&format!("{MINIMAL}{embed}"), &[]).unwrap();
    assert_eq!(c.models["embed"].kind, ModelKind::Embedding);
    // Nothing is generated: no output budget to fit the window.
    assert_eq!(c.models["embed"].max_output_tokens, 1);
    assert_eq!(c.models["general-chat"].kind, ModelKind::Chat);
    let bad = format!(
        "{MINIMAL}{embed}fallback_models = [\"general-chat\"]\ncanned_answer = \"no\"\n[models.other]\ninstances = [\"llama\"]\nkind = \"vectors\"\nsupports_dimensions = true\n"
    );
    let e = parse(&bad, &[]).unwrap_err();
    let paths: Vec<&str> = e.0.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(paths, ["models.embed.fallback_models[0]", "models.embed.canned_answer", "models.other.kind"], "{e}");
    let e = parse(&format!("{MINIMAL}supports_dimensions = true\n"), &[]).unwrap_err();
    assert_eq!(e.0[0].path, "models.general-chat.supports_dimensions", "{e}");
    // `dimensions`: embedding models only, and a sane length.
    let e = parse(&format!("{MINIMAL}dimensions = 8\n"), &[]).unwrap_err();
    assert_eq!(e.0[0].path, "models.general-chat.dimensions", "{e}");
    assert_eq!(
        parse(&format!("{MINIMAL}{embed}dimensions = 640\n"), &[]).unwrap().models["embed"].dimensions,
        Some(640)
    );
    let e = parse(&format!("{MINIMAL}{embed}dimensions = 0\n"), &[]).unwrap_err();
    assert_eq!(e.0[0].path, "models.embed.dimensions", "{e}");
    // `max_batch_inputs`: embedding models only, 1 to 2048, 32 by default.
    assert_eq!(c.models["embed"].max_batch_inputs, 32);
    assert_eq!(
        parse(&format!("{MINIMAL}{embed}max_batch_inputs = 4\n"), &[]).unwrap().models["embed"].max_batch_inputs,
        4
    );
    for bad in [0, 2049] {
        let e = parse(&format!("{MINIMAL}{embed}max_batch_inputs = {bad}\n"), &[]).unwrap_err();
        assert_eq!(e.0[0].path, "models.embed.max_batch_inputs", "{e}");
    }
    let e = parse(&format!("{MINIMAL}max_batch_inputs = 8\n"), &[]).unwrap_err();
    assert_eq!(e.0[0].path, "models.general-chat.max_batch_inputs", "{e}");
}

#[test]
fn a_summary_model_must_be_a_configured_chat_model_and_its_keys_in_range() {
    let ok = parse(&format!("{MINIMAL}\n[sessions]\nsummary_model = \"general-chat\"\n"), &[]).unwrap();
    let s = ok.sessions.summary.expect("summaries on");
    assert_eq!((s.model.as_str(), s.priority, s.max_tokens), ("general-chat", Priority::P4, 256));
    assert_eq!(parse(MINIMAL, &[]).unwrap().sessions.summary, None, "off without a model");
    let text = format!(
        "{MINIMAL}\n[models.emb]\nkind = \"embedding\"\ninstances = [\"llama\"]\n[sessions]\nsummary_model = \"nope\"\n\
         summary_priority = \"P7\"\nsummary_after_messages = 1\nsummary_history_share_pct = 95\n"
    );
    let e = parse(&text, &[]).unwrap_err();
    let paths: Vec<&str> = e.0.iter().map(|e| e.path.as_str()).collect();
    for want in [
        "sessions.summary_model",
        "sessions.summary_priority",
        "sessions.summary_after_messages",
        "sessions.summary_history_share_pct",
    ] {
        assert!(paths.contains(&want), "missing {want} in {paths:?}");
    }
    let e = parse(&text.replace("\"nope\"", "\"emb\""), &[]).unwrap_err();
    assert!(e.to_string().contains("\"emb\" is not a chat model"), "{e}");
}

/// Review 14 L8 (b): a summary model whose window leaves no room for the
/// summary prompt beside `summary_max_tokens` was accepted, then every
/// turn warned that the turns do not fit. Refused at load, with its key.
#[test]
fn a_summary_model_must_leave_room_for_the_summary_prompt() {
    let with = |window: u32, max: u32| {
        format!(
            "{MINIMAL}context_tokens = {window}\nmax_output_tokens = 16\n[sessions]\nsummary_model = \"general-chat\"\n\
             summary_max_tokens = {max}\n"
        )
    };
    for (window, max) in [(256, 256), (200, 256), (256 + SUMMARY_PROMPT_MIN_TOKENS - 1, 256)] {
        let e = parse(&with(window, max), &[]).unwrap_err();
        assert_eq!(e.0.len(), 1, "{window}/{max}: {e}");
        assert_eq!(e.0[0].path, "sessions.summary_max_tokens", "{window}/{max}: {e}");
        assert!(e.to_string().contains(&format!("context_tokens = {window}")), "{e}");
    }
    let ok = parse(&with(256 + SUMMARY_PROMPT_MIN_TOKENS, 256), &[]).unwrap();
    assert_eq!(ok.sessions.summary.unwrap().max_tokens, 256);
}

#[test]
fn slot_affinity_is_for_llama_server_only() {
    let on = MINIMAL.replace("model = \"gemma\"", "model = \"gemma\"\nslot_affinity = true");
    assert!(parse(&on, &[]).unwrap().engines["llama"].slot_affinity);
    let e = parse(&on.replace("type = \"openai\"", "type = \"ollama\""), &[]).unwrap_err();
    assert_eq!(e.0[0].path, "engines.llama.slot_affinity", "{e}");
    // A llama-server edgeway runs: its `--parallel` is the slot count
    // (review 14 L1).
    let run = |args: &str| {
        on.replace("[models.general-chat]", &format!("max_concurrency = 2\n[engines.llama.process]\ncommand = \"/bin/true\"\nargs = [{args}]\n\n[models.general-chat]"))
    };
    assert!(parse(&run("\"--parallel\", \"2\""), &[]).is_ok());
    for args in ["\"--parallel\", \"4\"", "\"-m\", \"x.gguf\""] {
        let e = parse(&run(args), &[]).unwrap_err();
        assert_eq!(e.0[0].path, "engines.llama.slot_affinity", "{args}: {e}");
    }
}

#[test]
fn tokenize_is_for_llama_server_only() {
    let on = MINIMAL.replace("model = \"gemma\"", "model = \"gemma\"\ntokenize = true");
    assert!(parse(&on, &[]).unwrap().engines["llama"].tokenize);
    assert!(!parse(MINIMAL, &[]).unwrap().engines["llama"].tokenize);
    let e = parse(&on.replace("type = \"openai\"", "type = \"ollama\""), &[]).unwrap_err();
    assert_eq!(e.0[0].path, "engines.llama.tokenize", "{e}");
}

#[test]
fn a_larger_window_model_exists_is_a_chat_model_and_has_a_larger_window() {
    let with = |alt_window: u32, extra: &str| {
        format!(
            "{}larger_window_model = \"big\"\n\n[models.big]\ninstances = [\"llama\"]\ncontext_tokens = {alt_window}\n{extra}",
            MINIMAL
        )
    };
    let c = parse(&with(8192, ""), &[]).unwrap();
    assert_eq!(c.models["general-chat"].larger_window_model.as_deref(), Some("big"));
    for (text, why) in [
        (with(4096, ""), "not larger"),
        (with(8192, "kind = \"embedding\"\n"), "chat models only"),
        (
            MINIMAL.replace("instances = [\"llama\"]", "instances = [\"llama\"]\nlarger_window_model = \"nope\""),
            "no model named",
        ),
    ] {
        let e = parse(&text, &[]).unwrap_err();
        assert_eq!(e.0[0].path, "models.general-chat.larger_window_model", "{e}");
        assert!(e.to_string().contains(why), "{why}: {e}");
    }
}

#[test]
fn engine_prices_default_to_zero_and_are_validated() {
    let c = parse(MINIMAL, &[]).unwrap();
    assert_eq!(c.engines["llama"].price, Price::default(), "absent: 0");
    let priced = MINIMAL
        .replace("model = \"gemma\"", "model = \"gemma\"\nprice_input_per_mtok = 0.5\nprice_output_per_mtok = 1.5");
    let c = parse(&priced, &[]).unwrap();
    let price = c.engines["llama"].price;
    assert_eq!(price, Price { input_per_mtok: 0.5, output_per_mtok: 1.5 });
    // A million input and two million output tokens: 0.5 + 3.0.
    assert_eq!(price.cost(1_000_000, 2_000_000), 3.5);
    for bad in ["-1", "nan", "inf"] {
        let text = MINIMAL.replace("model = \"gemma\"", &format!("model = \"gemma\"\nprice_output_per_mtok = {bad}"));
        let e = parse(&text, &[]).unwrap_err();
        assert_eq!(e.0[0].path, "engines.llama.price_output_per_mtok", "{bad}: {e}");
    }
}

#[test]
fn budgets_of_tenants_and_applications_are_read_and_validated() {
    let text = format!(
        "{MINIMAL}\n[applications.demo.budget]\ndaily_tokens = 1000\nmonthly_cost = 2.5\n\
         [tenants.demo.budget]\nmonthly_tokens = 50000\ndaily_cost = 1\nwarn_percent = 90\n"
    );
    let c = parse(&text, &[]).unwrap();
    let app = c.applications["demo"].budget.unwrap();
    assert_eq!(
        (app.daily_tokens, app.monthly_tokens, app.daily_cost, app.monthly_cost),
        (Some(1000), None, None, Some(2.5))
    );
    assert_eq!(app.warn_percent, DEFAULT_BUDGET_WARN_PERCENT);
    let t = c.tenant_budgets["demo"];
    assert_eq!((t.monthly_tokens, t.daily_cost, t.warn_percent), (Some(50000), Some(1.0), 90));
    assert!(parse(MINIMAL, &[]).unwrap().tenant_budgets.is_empty());
    let bad = format!("{MINIMAL}\n[tenants.demo.budget]\ndaily_cost = -1\nwarn_percent = 0\nhourly_tokens = 5\n");
    let e = parse(&bad, &[]).unwrap_err();
    assert!(e.to_string().contains("hourly_tokens"), "unknown keys are refused: {e}");
    let bad = format!("{MINIMAL}\n[tenants.demo.budget]\ndaily_cost = -1\nwarn_percent = 101\n");
    let paths: Vec<String> = parse(&bad, &[]).unwrap_err().0.into_iter().map(|e| e.path).collect();
    assert_eq!(paths, ["tenants.demo.budget.daily_cost", "tenants.demo.budget.warn_percent"]);
}

#[test]
fn a_changed_price_or_budget_is_a_reload_not_a_restart() {
    let old = parse(MINIMAL, &[]).unwrap();
    let new = parse(
        &format!(
            "{}\n[tenants.demo.budget]\ndaily_tokens = 10\n",
            MINIMAL.replace("model = \"gemma\"", "model = \"gemma\"\nprice_input_per_mtok = 2")
        ),
        &[],
    )
    .unwrap();
    let c = reload::plan(&old, &new).unwrap();
    assert_eq!(c.engines.changed, 1, "the instance is replaced with its new price");
    assert_eq!(c.sections, ["tenants"]);
    assert_eq!(reload::engine_plan(&old, &new).replaced, ["llama"]);
}

/// `[store.retention.<class>]`: each key defaults to the `[store]` one (an
/// old config behaves as before: every class may store text, at the same
/// ages); the audit chain is purged by the strictest class's age.
#[test]
fn retention_per_data_class_defaults_to_the_store_keys_and_is_validated() {
    let h = |n: u64| Some(std::time::Duration::from_secs(n * 3600));
    let c = parse(MINIMAL, &[]).unwrap();
    for class in DataClass::ALL {
        let r = c.store.class(class);
        assert_eq!((r.store_text, r.tasks, r.audit, r.idempotency), (true, h(720), h(8760), None), "{class:?}");
        assert_eq!(r.sessions, None, "no cap: the [sessions] limits alone");
    }
    assert_eq!(c.store.retention_audit, h(8760));
    let text = format!(
        "{MINIMAL}\n[store]\nretention_tasks_hours = 48\n[store.retention.secret]\nstore_text = false\n\
         tasks_hours = 1\naudit_hours = 24\nidempotency_hours = 2\nsessions_hours = 3\n[store.retention.public]\ntasks_hours = 0\n"
    );
    let c = parse(&text, &[]).unwrap();
    let s = c.store.class(DataClass::Secret);
    assert_eq!((s.store_text, s.tasks, s.audit, s.idempotency, s.sessions), (false, h(1), h(24), h(2), h(3)));
    assert_eq!(c.store.class(DataClass::Public).sessions, None);
    assert_eq!(c.store.class(DataClass::Public).tasks, None, "0 keeps");
    assert_eq!(c.store.class(DataClass::Personal).tasks, h(48), "the [store] key");
    assert_eq!(c.store.retention_audit, h(24), "the strictest class's audit age");

    let bad = format!("{MINIMAL}\n[store.retention.topsecret]\nstore_text = false\n");
    assert!(parse(&bad, &[]).is_err(), "an unknown class");
    let bad = format!("{MINIMAL}\n[store.retention.secret]\nstore_txt = false\n");
    assert!(parse(&bad, &[]).is_err(), "an unknown key");
    let bad = format!("{MINIMAL}\n[store.retention.secret]\ntasks_hours = 99999999\n");
    let e = parse(&bad, &[]).unwrap_err().to_string();
    assert!(e.contains("store.retention.secret.tasks_hours"), "{e}");
    let bad = format!("{MINIMAL}\n[store.retention.sensitive]\nsessions_hours = 99999999\n");
    let e = parse(&bad, &[]).unwrap_err().to_string();
    assert!(e.contains("store.retention.sensitive.sessions_hours"), "{e}");
}

/// `[mqtt] mode = "external"`: the broker's section is required, its
/// password comes from the environment, and mistakes name their keys.
#[test]
fn external_mqtt_mode_needs_its_broker_and_names_its_mistakes() {
    let m = parse(&format!("{MINIMAL}\n[mqtt]\n"), &[]).unwrap().mqtt.unwrap();
    assert!(m.external.is_none(), "embedded is the default");
    let ext = "[mqtt]\nmode = \"external\"\n[mqtt.external]\nhost = \"broker.local\"\n";
    let c = parse(&format!("{MINIMAL}\n{ext}"), &[]).unwrap();
    let e = c.mqtt.unwrap().external.expect("external mode");
    assert_eq!((e.host.as_str(), e.port, e.shared_group.as_str()), ("broker.local", 1883, "edgeway"));
    assert_eq!(e.client_id, format!("edgeway-{}", c.node_id));
    assert!(e.username.is_none() && e.password.is_none());
    let with_user = format!("{MINIMAL}\n{ext}username = \"edgeway\"\npassword_env = \"BROKER_PW\"\n");
    let err = parse(&with_user, &[]).unwrap_err();
    assert_eq!(err.0[0].path, "mqtt.external.password_env", "{err}");
    let c = parse(&with_user, &[("BROKER_PW", "s3cret")]).unwrap();
    let e = c.mqtt.unwrap().external.unwrap();
    assert_eq!(e.password.as_ref().map(|p| p.expose()), Some("s3cret"));
    assert!(!format!("{e:?}").contains("s3cret"), "the password never reaches a debug print");
    for (text, path) in [
        ("[mqtt]\nmode = \"external\"\n", "mqtt.external"),
        ("[mqtt]\nmode = \"cluster\"\n", "mqtt.mode"),
        ("[mqtt]\n[mqtt.external]\nhost = \"b\"\n", "mqtt.external"),
        ("[mqtt]\nmode = \"external\"\n[mqtt.external]\n", "mqtt.external.host"),
        (
            "[mqtt]\nmode = \"external\"\n[mqtt.external]\nhost = \"b\"\nshared_group = \"a/b\"\n",
            "mqtt.external.shared_group",
        ),
        (
            "[mqtt]\nmode = \"external\"\n[mqtt.external]\nhost = \"b\"\npassword_env = \"X\"\n",
            "mqtt.external.username",
        ),
        ("[mqtt]\nmode = \"external\"\n[mqtt.external]\nhost = \"b\"\ntls = true\n", "mqtt.external.ca_file"),
        ("[mqtt]\nmode = \"external\"\n[mqtt.external]\nhost = \"b\"\nca_file = \"ca.pem\"\n", "mqtt.external.tls"),
        (
            "[mqtt]\nmode = \"external\"\n[mqtt.external]\nhost = \"b\"\ntls = true\nca_file = \"no/such/ca.pem\"\n",
            "mqtt.external.ca_file",
        ),
    ] {
        let err = parse(&format!("{MINIMAL}\n{text}"), &[]).unwrap_err();
        assert_eq!(err.0[0].path, path, "{text}: {err}");
    }
}
