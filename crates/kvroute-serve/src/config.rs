//! What `kvroute serve` can be told: one [`ServeConfig`], validated once, with the same
//! defaults as the Python face's `RouterConfig` (which fills it from the command line).

use std::path::PathBuf;
use std::time::Duration;

use kvroute_core::blocks::{BlockHasher, usable_blocks};
use kvroute_core::index::{KvIndex, MemoryBound};
use kvroute_core::policies::{KvAwareConfig, Policy, PrefixHashConfig};
use kvroute_core::pyrandom::PyRandom;
use kvroute_core::retention::RetentionMode;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A configuration the router cannot run with: the setting at fault (by its name in the
/// configuration, which the CLI turns into its flag) and why, or a start-up failure that is
/// no one setting's (an address it cannot bind, a tokenizer it cannot read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The [`ServeConfig`] field at fault (its configuration name, e.g. `max_attempts`).
    pub field: Option<String>,
    /// What is wrong (with a field: said of the field, e.g. "must be at least 1, got 0").
    pub message: String,
}

impl ConfigError {
    /// A failure that is no one setting's.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            field: None,
            message: message.into(),
        }
    }

    /// Setting `field` is wrong: `message` says how.
    pub fn field(field: &str, message: impl Into<String>) -> Self {
        Self {
            field: Some(field.to_owned()),
            message: message.into(),
        }
    }
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.field {
            Some(field) => write!(f, "{field} {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

/// A balancing policy by name and options, as `kvroute serve --policy/--policy-option` give it.
/// In a configuration: `{"name": ..., "seed": ..., "options": {...}}`, the options by the
/// policy's own names ([`KvAwareConfig`], [`PrefixHashConfig`]), absent ones at their defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySpec {
    /// `random`, `round-robin`, `least-loaded`, `prefix-hash` or `kv-aware`.
    pub name: String,
    /// kv-aware's options (its block size is the router's).
    pub kv_aware: KvAwareConfig,
    /// prefix-hash's options.
    pub prefix_hash: PrefixHashConfig,
    /// Seeds the policy's random choices (None: from the clock).
    pub seed: Option<u64>,
}

/// The options of a policy that takes none.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NoOptions {}

impl PolicySpec {
    /// The named policy with its defaults.
    pub fn named(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            kv_aware: KvAwareConfig::default(),
            prefix_hash: PrefixHashConfig::default(),
            seed: None,
        }
    }

    /// Policy `name` with `options` read from a map of its option names (absent ones at
    /// their defaults): the one reader of policy options, for serve and the simulator's
    /// Python policies alike. An unknown option or a value of the wrong type is an error.
    pub fn with_options<'de, D: Deserializer<'de>>(
        name: &str,
        options: D,
    ) -> Result<Self, D::Error> {
        use serde::de::Error;
        // The option at fault is named: serde's own message says only what was wrong with its
        // value (an unknown option's message names it already).
        let named = |e: serde_path_to_error::Error<D::Error>| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path == "?" || path == "." || inner.to_string().starts_with("unknown field") {
                D::Error::custom(inner)
            } else {
                D::Error::custom(format!("option {path}: {inner}"))
            }
        };
        let mut spec = Self::named(name);
        match name {
            "kv-aware" => {
                spec.kv_aware = serde_path_to_error::deserialize(options).map_err(named)?
            }
            "prefix-hash" => {
                spec.prefix_hash = serde_path_to_error::deserialize(options).map_err(named)?
            }
            _ => {
                serde_path_to_error::deserialize::<_, NoOptions>(options).map_err(named)?;
            }
        }
        Ok(spec)
    }

    /// The policy object, for engines with `block_size`-token blocks.
    pub fn build(&self, block_size: usize) -> Result<Policy, ConfigError> {
        let seed = self.seed.map_or_else(
            || {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()) as i128
            },
            i128::from,
        );
        self.build_with(block_size, PyRandom::from_seed(seed))
    }

    /// The policy object drawing from `rng` (its seed ignored).
    pub fn build_with(&self, block_size: usize, rng: PyRandom) -> Result<Policy, ConfigError> {
        let kv_aware = KvAwareConfig {
            block_size,
            ..self.kv_aware
        };
        Policy::from_name(&self.name, rng, kv_aware, self.prefix_hash)
            .map_err(|e| ConfigError::field("policy", e.0))
    }
}

/// `PolicySpec` as a configuration holds it.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyEntry {
    name: String,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    options: serde_json::Map<String, serde_json::Value>,
}

impl Serialize for PolicySpec {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::Error;
        let options = match self.name.as_str() {
            "kv-aware" => serde_json::to_value(self.kv_aware),
            "prefix-hash" => serde_json::to_value(self.prefix_hash),
            _ => Ok(serde_json::Value::Object(serde_json::Map::new())),
        }
        .map_err(S::Error::custom)?;
        let serde_json::Value::Object(options) = options else {
            return Err(S::Error::custom("policy options are a map"));
        };
        PolicyEntry {
            name: self.name.clone(),
            seed: self.seed,
            options,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for PolicySpec {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let entry = PolicyEntry::deserialize(deserializer)?;
        let options = serde_json::Value::Object(entry.options);
        let mut spec = Self::with_options(&entry.name, options)
            .map_err(|e| D::Error::custom(format!("{}: {e}", entry.name)))?;
        spec.seed = entry.seed;
        Ok(spec)
    }
}

/// Durations as seconds (a float) in a configuration.
mod seconds {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let value = f64::deserialize(d)?;
        Duration::try_from_secs_f64(value).map_err(|_| {
            serde::de::Error::custom(format!("must be a number of seconds >= 0, got {value}"))
        })
    }
}

/// Optional durations as seconds (a float, or null: no limit) in a configuration.
mod optional_seconds {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&d.as_secs_f64()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Option::<f64>::deserialize(d)?
            .map(|value| {
                Duration::try_from_secs_f64(value).map_err(|_| {
                    serde::de::Error::custom(format!(
                        "must be a number of seconds >= 0 (or none), got {value}"
                    ))
                })
            })
            .transpose()
    }
}

/// Where one worker publishes its KV events (vLLM's `--kv-events-config`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventSource {
    /// Its PUB socket, `tcp://HOST:PORT` or `ipc://PATH`.
    pub endpoint: String,
    /// Its replay ROUTER socket (None: gaps cannot be repaired).
    pub replay_endpoint: Option<String>,
}

/// One worker: its base URL, its KV events if it publishes them, and whether it takes new
/// requests. In a configuration `url` alone is required (no events, ready).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSpec {
    pub url: String,
    /// Its stable name (a pod's; empty: the URL).
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub events: Option<EventSource>,
    /// False while it terminates (a Kubernetes endpoint no longer ready): no new requests,
    /// in-flight ones finish, and its cache (and index entries) are still there.
    #[serde(default = "ready")]
    pub ready: bool,
}

/// A worker is ready unless it says otherwise.
fn ready() -> bool {
    true
}

impl WorkerSpec {
    /// A ready worker without events (the router predicts its cache from its decisions).
    pub fn url(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            name: String::new(),
            events: None,
            ready: true,
        }
    }
}

/// Everything the native router runs with. Durations of `None` mean "no limit".
///
/// It crosses from Python whole (`kvroute.router.server.native_config`): serde reads it by the
/// field names below (durations as seconds, `*_s`), absent fields as in `Default`, which is
/// the one owner of the defaults (`kvroute._native.serve_defaults()` reports it). Whatever
/// serde cannot rule out is checked once, by [`ServeConfig::validate`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeConfig {
    /// Where to listen (port 0: an ephemeral one, see [`crate::server::Server::local_addr`]).
    pub host: String,
    pub port: u16,
    /// Runtime worker threads (at least 1).
    pub threads: usize,
    /// The workers: base URLs `http://host:port` (a trailing `/v1` is dropped), and where
    /// each publishes its KV events.
    pub workers: Vec<WorkerSpec>,
    /// The KV events' subscription topic prefix (empty: all).
    pub events_topic: String,
    pub policy: PolicySpec,
    /// The engines' KV block size and the root of the router's own hash chain.
    pub block_size: usize,
    pub hash_seed: u64,
    /// The engines' tokenizer directory (`tokenizer.json`); None: text prompts are routed by
    /// load alone (token-id prompts are always exact).
    pub tokenizer: Option<PathBuf>,
    /// Bytes of the text-piece caches of the tokenizer.
    pub prompt_cache_bytes: usize,
    /// Predicted entries' lifetime and per-worker bound (see `kvroute_core::index`).
    pub predicted_ttl_s: Option<f64>,
    pub predicted_capacity_blocks: Option<usize>,
    /// The index's memory bound over event-backed entries, in bytes (the least recently
    /// touched are dropped beyond it); None: unbounded.
    pub index_max_bytes: Option<usize>,
    /// Request bodies larger than this get 413 (before they are read when they say so).
    /// None: derived from the tokenizer ([`crate::edge::BodyLimit`]).
    pub max_body_bytes: Option<usize>,
    /// Request body bytes held in memory at once across all requests ([`crate::edge::
    /// BodyBudget`]); a body that would exceed it gets 503. At least the body limit.
    pub max_buffered_body_bytes: usize,
    /// Deeper JSON bodies get 400.
    pub max_json_depth: usize,
    /// Larger bodies are parsed and tokenized on a blocking thread, so that a huge prompt
    /// never holds a runtime thread other connections are served on.
    pub offload_bytes: usize,
    /// Seconds for a request head to arrive.
    #[serde(rename = "header_timeout_s", with = "seconds")]
    pub header_timeout: Duration,
    /// Seconds an idle kept-alive client connection stays open.
    #[serde(rename = "keepalive_timeout_s", with = "seconds")]
    pub keepalive_timeout: Duration,
    /// How long a client may take no byte of its answer while the router has more to write
    /// before its connection is closed (None: without limit).
    #[serde(rename = "send_timeout_s", with = "optional_seconds")]
    pub send_timeout: Option<Duration>,
    /// Seconds for a whole request body to arrive once its head has.
    #[serde(rename = "body_timeout_s", with = "seconds")]
    pub body_timeout: Duration,
    /// Client connections open at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// A worker that does not accept a connection this fast is skipped.
    #[serde(rename = "connect_timeout_s", with = "seconds")]
    pub connect_timeout: Duration,
    /// How long a worker may take to send its response head.
    #[serde(rename = "first_byte_timeout_s", with = "optional_seconds")]
    pub first_byte_timeout: Option<Duration>,
    /// Longest silence between two chunks of an answer.
    #[serde(rename = "stream_idle_timeout_s", with = "optional_seconds")]
    pub stream_idle_timeout: Option<Duration>,
    /// Workers tried per request (retries happen only before the first response byte).
    pub max_attempts: usize,
    /// Period of `GET /health` checks (None: no checks) and their limit.
    #[serde(rename = "health_interval_s", with = "optional_seconds")]
    pub health_interval: Option<Duration>,
    #[serde(rename = "health_timeout_s", with = "seconds")]
    pub health_timeout: Duration,
    /// Consecutive failures that eject a worker (0: never), and a first ejection's length.
    pub eject_after_failures: u32,
    #[serde(rename = "eject_base_s", with = "seconds")]
    pub eject_base: Duration,
    /// `Authorization: Bearer <key>` required on every route but `/health` (and `/metrics`
    /// when `metrics_public`).
    pub api_key: Option<String>,
    pub metrics_public: bool,
    /// Sent to the workers as `Authorization: Bearer <key>` (vLLM started with `--api-key`).
    pub worker_api_key: Option<String>,
    /// Pass the client's `Authorization` on to the workers (without `worker_api_key`).
    pub forward_authorization: bool,
    /// Retention (`kvroute_core::retention`): its mode, and each worker's usable KV blocks
    /// for its model (see [`ServeConfig::retention`]).
    #[serde(rename = "retention")]
    pub retention_mode: RetentionMode,
    pub retention_capacity_blocks: usize,
    /// Each worker's usable KV blocks for kv-aware's admission guard (`kvroute_core::
    /// admission`) and retention; None: each worker's own, read from its engine's `/metrics`
    /// (`vllm:cache_config_info`'s `num_gpu_blocks` less the null block): until it is known
    /// the guard leaves that worker alone and retention assumes `retention`'s blocks.
    pub kv_capacity_blocks: Option<usize>,
    /// The workers' LoRA slots (vLLM's `--max-loras`): the routing step models the adapters
    /// in each worker's slots as the last this many distinct adapters sent there, for
    /// kv-aware's adapter term; None: not modelled (the term is off).
    pub max_loras: Option<usize>,
    /// The replica mesh (`crate::mesh`): where this replica publishes its decisions and whom
    /// it hears theirs from; None: a lone router.
    pub mesh: Option<crate::mesh::MeshSettings>,
}

/// The reference worker's KV blocks (Qwen3-0.6B bf16, 1 GiB, block 16): the defaults of the
/// predicted entries' per-worker bound and of retention's capacity, for fleets that state
/// neither.
pub const REFERENCE_KV_BLOCKS: usize = 585;

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 0,
            threads: 1,
            workers: Vec::new(),
            events_topic: String::new(),
            policy: PolicySpec::named("kv-aware"),
            block_size: 16,
            hash_seed: 0,
            tokenizer: None,
            prompt_cache_bytes: 64 << 20,
            predicted_ttl_s: None,
            predicted_capacity_blocks: Some(REFERENCE_KV_BLOCKS),
            index_max_bytes: Some(256 << 20),
            max_body_bytes: None,
            max_buffered_body_bytes: 1 << 30,
            max_json_depth: 64,
            offload_bytes: 256 * 1024,
            header_timeout: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(75),
            send_timeout: Some(Duration::from_secs(60)),
            body_timeout: Duration::from_secs(60),
            max_connections: 4096,
            connect_timeout: Duration::from_secs(2),
            first_byte_timeout: Some(Duration::from_secs(600)),
            stream_idle_timeout: Some(Duration::from_secs(300)),
            max_attempts: 3,
            health_interval: Some(Duration::from_secs(2)),
            health_timeout: Duration::from_secs(1),
            eject_after_failures: 3,
            eject_base: Duration::from_secs(5),
            api_key: None,
            metrics_public: false,
            worker_api_key: None,
            forward_authorization: false,
            retention_mode: RetentionMode::Off,
            retention_capacity_blocks: usable_blocks(REFERENCE_KV_BLOCKS),
            kv_capacity_blocks: None,
            max_loras: None,
            mesh: None,
        }
    }
}

/// `url` as a worker base URL (`http://host:port`, no trailing `/v1` or slash), or why not.
pub fn worker_base_url(url: &str) -> Result<String, ConfigError> {
    let trimmed = url.trim_end_matches('/');
    let trimmed = trimmed.strip_suffix("/v1").unwrap_or(trimmed);
    let uri: hyper::Uri = trimmed
        .parse()
        .map_err(|_| ConfigError::new(format!("worker URL {url:?} is not a URL")))?;
    if uri.scheme_str() != Some("http") {
        return Err(ConfigError::new(format!(
            "worker URL {url:?}: only http:// is supported"
        )));
    }
    if uri.host().is_none() || uri.path().len() > 1 || uri.query().is_some() {
        return Err(ConfigError::new(format!(
            "worker URL {url:?} must be http://host:port, optionally ending in /v1"
        )));
    }
    Ok(trimmed.to_owned())
}

impl ServeConfig {
    /// Retention's mode and each worker's usable KV blocks for its model; None: off.
    pub fn retention(&self) -> Option<(RetentionMode, usize)> {
        (self.retention_mode != RetentionMode::Off)
            .then_some((self.retention_mode, self.retention_capacity_blocks))
    }

    /// The configuration, or the first setting wrong with it (the one place settings are
    /// checked: serde has ruled out wrong types and negative durations).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let at_least = |field: &str, value: usize, least: usize| {
            if value < least {
                Err(ConfigError::field(
                    field,
                    format!("must be >= {least}, got {value}"),
                ))
            } else {
                Ok(())
            }
        };
        at_least("threads", self.threads, 1)?;
        at_least("block_size", self.block_size, 1)?;
        at_least("max_attempts", self.max_attempts, 1)?;
        at_least("max_connections", self.max_connections, 1)?;
        at_least("max_json_depth", self.max_json_depth, 2)?;
        at_least(
            "retention_capacity_blocks",
            self.retention_capacity_blocks,
            1,
        )?;
        for (field, value) in [
            ("max_body_bytes", self.max_body_bytes),
            ("kv_capacity_blocks", self.kv_capacity_blocks),
            ("max_loras", self.max_loras),
        ] {
            if let Some(value) = value {
                at_least(field, value, 1)?;
            }
        }
        for (field, value) in [
            ("header_timeout_s", Some(self.header_timeout)),
            ("keepalive_timeout_s", Some(self.keepalive_timeout)),
            ("body_timeout_s", Some(self.body_timeout)),
            ("connect_timeout_s", Some(self.connect_timeout)),
            ("health_timeout_s", Some(self.health_timeout)),
            ("send_timeout_s", self.send_timeout),
            ("first_byte_timeout_s", self.first_byte_timeout),
            ("stream_idle_timeout_s", self.stream_idle_timeout),
        ] {
            if value == Some(Duration::ZERO) {
                return Err(ConfigError::field(field, "must be positive, got 0"));
            }
        }
        if matches!(&self.api_key, Some(k) if k.trim().is_empty()) {
            return Err(ConfigError::field("api_key", "must not be empty"));
        }
        if let Some(mesh) = &self.mesh
            && (mesh.config.liveness_s.is_nan() || mesh.config.liveness_s <= 0.0)
        {
            return Err(ConfigError::field(
                "mesh",
                format!("liveness must be positive, got {}", mesh.config.liveness_s),
            ));
        }
        for worker in &self.workers {
            worker_base_url(&worker.url).map_err(|e| ConfigError::field("workers", e.message))?;
        }
        self.policy.build(self.block_size)?;
        self.index()?;
        Ok(())
    }

    /// The router's empty index for this configuration (the index checks its own settings:
    /// the predicted entries' TTL and capacity, the memory bound).
    pub fn index(&self) -> Result<KvIndex, ConfigError> {
        let hasher = BlockHasher::new(self.block_size, self.hash_seed)
            .map_err(|e| ConfigError::field("block_size", e.to_string()))?;
        KvIndex::new(
            hasher,
            self.predicted_ttl_s,
            self.predicted_capacity_blocks,
            self.index_max_bytes.map(MemoryBound::Bytes),
        )
        .map_err(|e| ConfigError::new(e.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_urls_lose_their_v1_and_must_be_plain_http() {
        assert_eq!(
            worker_base_url("http://127.0.0.1:8000/v1/").unwrap(),
            "http://127.0.0.1:8000"
        );
        assert_eq!(worker_base_url("http://w:1").unwrap(), "http://w:1");
        assert!(worker_base_url("https://w:1").is_err());
        assert!(worker_base_url("http://w:1/other").is_err());
        assert!(worker_base_url("not a url").is_err());
    }

    #[test]
    fn a_bad_configuration_says_what_is_wrong() {
        let mut c = ServeConfig::default();
        assert!(c.validate().is_ok());
        c.policy = PolicySpec::named("fastest");
        assert_eq!(
            c.validate().unwrap_err(),
            ConfigError::field("policy", "unknown policy \"fastest\"")
        );
        let c = ServeConfig {
            max_attempts: 0,
            ..ServeConfig::default()
        };
        assert_eq!(
            c.validate().unwrap_err().to_string(),
            "max_attempts must be >= 1, got 0"
        );
    }

    #[test]
    fn a_configuration_is_read_by_its_field_names_with_the_defaults_for_the_rest() {
        let c: ServeConfig = serde_json::from_value(serde_json::json!({
            "port": 8080,
            "workers": [{"url": "http://w:1"}],
            "policy": {"name": "kv-aware", "seed": 3, "options": {"load_factor": null}},
            "header_timeout_s": 2.5,
            "send_timeout_s": null,
            "retention": "auto",
        }))
        .unwrap();
        assert_eq!(c.port, 8080);
        assert_eq!(c.workers, vec![WorkerSpec::url("http://w:1")]);
        assert_eq!(c.policy.kv_aware.load_factor, None);
        assert_eq!(c.policy.seed, Some(3));
        assert_eq!(c.header_timeout, Duration::from_millis(2500));
        assert_eq!(c.send_timeout, None);
        assert_eq!(c.retention(), Some((RetentionMode::Auto, 584)));
        assert_eq!(c.max_attempts, ServeConfig::default().max_attempts);
        // The defaults go out as they come back.
        let round: ServeConfig =
            serde_json::from_value(serde_json::to_value(ServeConfig::default()).unwrap()).unwrap();
        assert_eq!(round.header_timeout, ServeConfig::default().header_timeout);
        assert_eq!(round.policy, ServeConfig::default().policy);
        for bad in [
            serde_json::json!({"max_attempt": 3}),
            serde_json::json!({"header_timeout_s": -1.0}),
            serde_json::json!({"policy": {"name": "kv-aware", "options": {"speed": 1}}}),
            serde_json::json!({"policy": {"name": "random", "options": {"load_factor": 1}}}),
        ] {
            assert!(
                serde_json::from_value::<ServeConfig>(bad.clone()).is_err(),
                "{bad}"
            );
        }
    }
}
