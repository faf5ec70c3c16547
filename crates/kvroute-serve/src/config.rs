//! What `kvroute serve` can be told: one [`ServeConfig`], validated once, with the same
//! defaults as the Python face's `RouterConfig` (which fills it from the command line).

use std::path::PathBuf;
use std::time::Duration;

use kvroute_core::policies::{KvAwareConfig, Policy, PrefixHashConfig};
use kvroute_core::pyrandom::PyRandom;
use kvroute_core::retention::RetentionMode;

/// A configuration the router cannot run with (the message is what `kvroute serve` prints).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// A balancing policy by name and options, as `kvroute serve --policy/--policy-option` give it.
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
        let kv_aware = KvAwareConfig {
            block_size,
            ..self.kv_aware
        };
        Policy::from_name(
            &self.name,
            PyRandom::from_seed(seed),
            kv_aware,
            self.prefix_hash,
        )
        .map_err(|e| ConfigError(e.0))
    }
}

/// Where one worker publishes its KV events (vLLM's `--kv-events-config`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSource {
    /// Its PUB socket, `tcp://HOST:PORT` or `ipc://PATH`.
    pub endpoint: String,
    /// Its replay ROUTER socket (None: gaps cannot be repaired).
    pub replay_endpoint: Option<String>,
}

/// One worker: its base URL, its KV events if it publishes them, and whether it takes new
/// requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    pub url: String,
    /// Its stable name (a pod's; empty: the URL).
    pub name: String,
    pub events: Option<EventSource>,
    /// False while it terminates (a Kubernetes endpoint no longer ready): no new requests,
    /// in-flight ones finish, and its cache (and index entries) are still there.
    pub ready: bool,
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
#[derive(Debug, Clone)]
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
    pub header_timeout: Duration,
    /// Seconds an idle kept-alive client connection stays open.
    pub keepalive_timeout: Duration,
    /// How long a client may take no byte of its answer while the router has more to write
    /// before its connection is closed (None: without limit).
    pub send_timeout: Option<Duration>,
    /// Seconds for a whole request body to arrive once its head has.
    pub body_timeout: Duration,
    /// Client connections open at once; more are answered 503 and closed.
    pub max_connections: usize,
    /// A worker that does not accept a connection this fast is skipped.
    pub connect_timeout: Duration,
    /// How long a worker may take to send its response head.
    pub first_byte_timeout: Option<Duration>,
    /// Longest silence between two chunks of an answer.
    pub stream_idle_timeout: Option<Duration>,
    /// Workers tried per request (retries happen only before the first response byte).
    pub max_attempts: usize,
    /// Period of `GET /health` checks (None: no checks) and their limit.
    pub health_interval: Option<Duration>,
    pub health_timeout: Duration,
    /// Consecutive failures that eject a worker (0: never), and a first ejection's length.
    pub eject_after_failures: u32,
    pub eject_base: Duration,
    /// `Authorization: Bearer <key>` required on every route but `/health` (and `/metrics`
    /// when `metrics_public`).
    pub api_key: Option<String>,
    pub metrics_public: bool,
    /// Sent to the workers as `Authorization: Bearer <key>` (vLLM started with `--api-key`).
    pub worker_api_key: Option<String>,
    /// Pass the client's `Authorization` on to the workers (without `worker_api_key`).
    pub forward_authorization: bool,
    /// Retention (`kvroute_core::retention`): its mode and each worker's usable KV blocks;
    /// None: off.
    pub retention: Option<(RetentionMode, usize)>,
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
            predicted_capacity_blocks: Some(585),
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
            retention: None,
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
        .map_err(|_| ConfigError(format!("worker URL {url:?} is not a URL")))?;
    if uri.scheme_str() != Some("http") {
        return Err(ConfigError(format!(
            "worker URL {url:?}: only http:// is supported"
        )));
    }
    if uri.host().is_none() || uri.path().len() > 1 || uri.query().is_some() {
        return Err(ConfigError(format!(
            "worker URL {url:?} must be http://host:port, optionally ending in /v1"
        )));
    }
    Ok(trimmed.to_owned())
}

impl ServeConfig {
    /// The configuration, or the first thing wrong with it.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |m: String| Err(ConfigError(m));
        if self.threads < 1 {
            return err("threads must be at least 1".into());
        }
        if self.block_size < 1 {
            return err("block size must be at least 1".into());
        }
        if self.max_attempts < 1 {
            return err("max attempts must be at least 1".into());
        }
        if self.max_connections < 1 {
            return err("max connections must be at least 1".into());
        }
        if self.max_body_bytes == Some(0) {
            return err("max body bytes must be at least 1".into());
        }
        if self.max_json_depth < 2 {
            return err("max JSON depth must be at least 2".into());
        }
        if self.predicted_ttl_s.is_none() && self.predicted_capacity_blocks.is_none() {
            return err("predicted entries need a TTL or a per-worker capacity".into());
        }
        if matches!(&self.api_key, Some(k) if k.is_empty()) {
            return err("the API key must not be empty".into());
        }
        for worker in &self.workers {
            worker_base_url(&worker.url)?;
        }
        self.policy.build(self.block_size)?;
        Ok(())
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
            c.validate().unwrap_err().0,
            "unknown policy \"fastest\"".to_owned()
        );
        let c = ServeConfig {
            max_attempts: 0,
            ..ServeConfig::default()
        };
        assert!(c.validate().is_err());
    }
}
