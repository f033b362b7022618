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
        let env = [("EDGEWAY_JWT_SECRET", "an-example-secret-of-32-bytes!!!"), ("OPENAI_API_KEY", "sk-test")];
        parse(&text, &env).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        n += 1;
    }
    assert!(n >= 1, "no example configs found in {}", dir.display());
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
fn memory_margin_is_a_positive_percentage() {
    for bad in ["-100", "-1", "nan", "inf"] {
        let e = parse(&format!("{MINIMAL}memory_margin_percent = {bad}\n"), &[]).unwrap_err();
        assert_eq!(e.0[0].path, "models.general-chat.memory_margin_percent", "{bad}: {e}");
    }
    assert!(parse(&format!("{MINIMAL}memory_margin_percent = 0\n"), &[]).is_ok());
}
