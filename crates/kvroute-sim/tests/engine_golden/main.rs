//! The engine model reproduces, exactly, its golden traces (`tests/data/golden/engine_*.json`):
//! every request's cached tokens, first-token and finish time and preemptions, every step's
//! prefill tokens, decoding sequences and KV events, and the final counters.
//!
//! The scenarios are `tests/data/golden/engine_scenarios.json`; this driver is the one in
//! `engine_scenarios.py` (which recorded the traces), step for step: the same workloads from
//! the same seeds ([`workload`] over [`numpy_random`]), the same seeded output lengths, output
//! tokens and aborts (CPython's `random`, `kvroute_core::pyrandom`), the same event digests
//! ([`sha1`]). `tests/unit/test_engine_golden.py` replays the same traces through the Python
//! bindings.

mod numpy_random;
mod sha1;
mod workload;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use kvroute_core::blocks::{BlockHasher, BlockKeys, DEFAULT_HASH_SEED};
use kvroute_core::kvevents::events::KvCacheEvent;
use kvroute_core::pyrandom::PyRandom;
use kvroute_sim::engine::cost::CostModel;
use kvroute_sim::engine::scheduler::{Engine, NewRequest, RequestKey};
use serde_json::{Map, Value, json};

use workload::{LengthDist, RequestSpec, VOCAB_LEN, Workload, WorkloadSpec};

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/golden")
}

fn read_json(name: &str) -> Value {
    let path = golden_dir().join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One entry of `engine_scenarios.json`, its `defaults` filled in.
struct Scenario(Map<String, Value>);

impl Scenario {
    fn all() -> Vec<Self> {
        let table = read_json("engine_scenarios.json");
        let defaults = table["defaults"].as_object().expect("defaults");
        table["scenarios"]
            .as_array()
            .expect("scenarios")
            .iter()
            .map(|entry| {
                let mut fields = defaults.clone();
                fields.extend(entry.as_object().expect("a scenario").clone());
                Self(fields)
            })
            .collect()
    }

    fn get(&self, key: &str) -> &Value {
        self.0
            .get(key)
            .unwrap_or_else(|| panic!("scenario field {key:?}"))
    }

    fn text(&self, key: &str) -> &str {
        self.get(key).as_str().expect("a string")
    }

    fn count(&self, key: &str) -> usize {
        self.get(key).as_u64().expect("a count") as usize
    }

    fn float(&self, key: &str) -> f64 {
        self.get(key).as_f64().expect("a number")
    }

    fn flag(&self, key: &str) -> bool {
        self.get(key).as_bool().expect("a flag")
    }
}

/// The first 16 hex digits of the SHA-1 of `values` as little-endian `u64`s.
fn digest(values: impl IntoIterator<Item = u64>) -> String {
    let mut h = sha1::Sha1::new();
    for v in values {
        h.update(&v.to_le_bytes());
    }
    h.hexdigest()[..16].to_string()
}

/// (blocks stored, blocks removed, digest of every event's type, hashes, parent, tokens).
fn event_digest(events: &[KvCacheEvent]) -> (usize, usize, String) {
    let mut h = sha1::Sha1::new();
    let (mut stored, mut removed) = (0, 0);
    for event in events {
        let line = match event {
            KvCacheEvent::Stored(e) => {
                stored += e.block_hashes.len();
                let parent = e
                    .parent_block_hash
                    .map_or_else(|| "-1".to_string(), |p| p.to_string());
                format!(
                    "S{}:{parent}:{}:{}:{};",
                    digest(e.block_hashes.iter().copied()),
                    e.token_ids.len(),
                    digest(e.token_ids.iter().map(|&t| t as u64)),
                    e.block_size
                )
            }
            KvCacheEvent::Removed(e) => {
                removed += e.block_hashes.len();
                format!("R{};", digest(e.block_hashes.iter().copied()))
            }
            KvCacheEvent::AllCleared => "C;".to_string(),
        };
        h.update(line.as_bytes());
    }
    let text = if events.is_empty() {
        String::new()
    } else {
        h.hexdigest()[..16].to_string()
    };
    (stored, removed, text)
}

/// A request in the engine, as the driver knows it.
struct Live {
    id: String,
    prompt: Vec<u32>,
    output: Arc<[u32]>,
}

/// One engine driven through scenario `s` by closed-loop clients; its trace, as recorded.
struct Driver<'a> {
    s: &'a Scenario,
    work: &'a Workload,
    rng: PyRandom,
    engine: Engine,
    now: f64,
    steps: Vec<Value>,
    records: Map<String, Value>,
    resets: Vec<Value>,
    /// By engine key.
    live: HashMap<RequestKey, Live>,
    /// Measured requests in flight, by number: their engine key and client.
    in_flight: BTreeMap<usize, (RequestKey, usize)>,
    /// Each client's last prompt and output, for multi-turn sessions.
    history: HashMap<usize, Vec<u32>>,
    /// Measured requests not yet sent, the next last.
    pending: Vec<usize>,
}

impl<'a> Driver<'a> {
    fn new(s: &'a Scenario, work: &'a Workload) -> Self {
        let mut cost = CostModel::new(
            "golden",
            s.float("step_base_s"),
            s.float("prefill_token_s"),
            s.float("decode_seq_s"),
            0.0,
        );
        cost.max_num_batched_tokens = s.count("max_num_batched_tokens");
        cost.max_num_seqs = s.count("max_num_seqs");
        let hasher = BlockHasher::new(s.count("block_size"), DEFAULT_HASH_SEED).expect("a hasher");
        let pending = (0..work.requests.len()).rev().collect();
        Self {
            s,
            work,
            rng: PyRandom::from_seed(s.count("seed") as i128),
            engine: Engine::new(
                s.count("num_blocks"),
                cost,
                hasher,
                s.flag("enable_caching"),
                true,
            ),
            now: 0.0,
            steps: vec![],
            records: Map::new(),
            resets: vec![],
            live: HashMap::new(),
            in_flight: BTreeMap::new(),
            history: HashMap::new(),
            pending,
        }
    }

    /// Add request `id` of `spec` for `client` (None: a warmup request); its engine key.
    fn add(&mut self, id: String, spec: &RequestSpec, client: Option<usize>) -> RequestKey {
        let output_tokens = self.s.count("output_tokens");
        let n_out = if self.s.flag("vary_output") {
            1 + self.rng.randrange(output_tokens)
        } else {
            output_tokens
        };
        let first = 1000 + self.rng.randrange(VOCAB_LEN as usize - n_out) as u32;
        let output: Arc<[u32]> = (first..first + n_out as u32).collect();
        let mut prompt = self.work.prompt(spec);
        if let Some(last) = client.and_then(|c| self.history.get(&c)) {
            let session = [&last[..], &spec.suffix[..]].concat();
            let room = (self.s.count("num_blocks") - 1) * self.s.count("block_size");
            if self.s.flag("multi_turn") && session.len() + n_out <= room {
                prompt = session;
            }
        }
        let key = self
            .engine
            .add_request(NewRequest {
                prompt_head: Arc::default(),
                prompt: prompt.clone(),
                output: output.clone(),
                max_tokens: n_out,
                arrival_time: self.now,
                block_hashes: vec![],
                keys: BlockKeys::default(),
                lora_id: None,
            })
            .expect("a valid request");
        self.live.insert(key, Live { id, prompt, output });
        key
    }

    /// Run one step; the requests that finished in it (their key, and what they held).
    fn step(&mut self) -> Vec<(Live, usize)> {
        let result = self.engine.step(self.now);
        let events = result.events.as_ref().map_or(&[][..], |b| {
            assert_eq!(b.ts, result.end);
            &b.events[..]
        });
        let (stored, removed, text) = event_digest(events);
        self.steps.push(json!([
            result.prefill_tokens,
            result.decode_seqs,
            stored,
            removed,
            text
        ]));
        self.now = result.end;
        let mut done = vec![];
        for o in result.outputs.iter().filter(|o| o.finished) {
            let live = self.live.remove(&o.key).expect("a live request");
            let r = &o.summary;
            self.records.insert(
                live.id.clone(),
                json!([
                    r.num_cached_tokens,
                    r.first_token_time.expect("a first token"),
                    r.finish_time.expect("finished"),
                    r.num_preemptions,
                    r.num_output,
                    live.prompt.len()
                ]),
            );
            done.push((live, r.num_output));
        }
        done
    }

    fn send(&mut self, client: usize) {
        let Some(i) = self.pending.pop() else {
            return;
        };
        let work = self.work;
        let key = self.add(i.to_string(), &work.requests[i], Some(client));
        self.in_flight.insert(i, (key, client));
    }

    fn reset(&mut self) {
        let ok = self.engine.reset_prefix_cache();
        self.resets.push(json!([self.steps.len(), ok]));
    }

    fn run(mut self) -> Value {
        if self.s.flag("warmup") {
            let work = self.work;
            for (k, spec) in work.warmup.iter().enumerate() {
                self.add(format!("w{k}"), spec, None);
                while self.engine.has_work() {
                    self.step();
                }
            }
        }
        if self.s.flag("reset_after_warmup") {
            self.reset();
        }
        for c in 0..self.s.count("concurrency") {
            self.send(c);
        }
        let (abort_every, reset_every) = (self.s.count("abort_every"), self.s.count("reset_every"));
        let mut guard = 0;
        while self.engine.has_work() {
            guard += 1;
            assert!(guard < 200_000, "stalled");
            for (live, num_output) in self.step() {
                let number = live.id.parse().expect("a measured request");
                let (_, client) = self.in_flight.remove(&number).expect("in flight");
                if self.s.flag("multi_turn") {
                    let turn = [&live.prompt[..], &live.output[..num_output]].concat();
                    self.history.insert(client, turn);
                }
                self.send(client);
            }
            if abort_every > 0 && self.steps.len() % abort_every == 0 && !self.in_flight.is_empty()
            {
                let numbers: Vec<usize> = self.in_flight.keys().copied().collect();
                let number = self.rng.choice(&numbers);
                let (key, client) = self.in_flight.remove(&number).expect("in flight");
                let r = self.engine.abort_request(key).expect("a live request");
                let live = self.live.remove(&key).expect("a live request");
                self.records.insert(
                    live.id,
                    json!([
                        "aborted",
                        r.num_cached_tokens,
                        r.num_preemptions,
                        r.num_output
                    ]),
                );
                self.send(client);
            }
            if reset_every > 0 && self.steps.len() % reset_every == 0 {
                self.reset();
            }
        }
        let st = self.engine.stats();
        json!({
            "records": self.records,
            "steps": self.steps,
            "resets": self.resets,
            "stats": [st.requests, st.queries, st.hits, st.preempted_requests,
                      st.preempted_queries, st.preempted_hits],
            "totals": [self.engine.num_preemptions(), self.engine.prompt_tokens_total(),
                       self.engine.generation_tokens_total()],
            "free_blocks": self.engine.pool().num_free_blocks(),
        })
    }
}

/// Where `got` first departs from `want` in `s`'s trace, if it does.
fn first_difference(name: &str, got: &Value, want: &Value) -> Option<String> {
    let steps = |trace: &'_ Value| trace["steps"].as_array().expect("steps").clone();
    let (got_steps, want_steps) = (steps(got), steps(want));
    if let Some(i) =
        (0..got_steps.len().min(want_steps.len())).find(|&i| got_steps[i] != want_steps[i])
    {
        return Some(format!(
            "{name}: step {i} differs: {} != {}",
            got_steps[i], want_steps[i]
        ));
    }
    if got_steps.len() != want_steps.len() {
        return Some(format!(
            "{name}: {} steps, the golden has {}",
            got_steps.len(),
            want_steps.len()
        ));
    }
    ["records", "resets", "stats", "totals", "free_blocks"]
        .into_iter()
        .find(|key| got[key] != want[key])
        .map(|key| format!("{name}: {key} differs: {} != {}", got[key], want[key]))
}

#[test]
fn the_engine_reproduces_every_golden_trace() {
    let scenarios = Scenario::all();
    let failures: Vec<String> = scenarios
        .iter()
        .filter_map(|s| {
            let name = s.text("name");
            let golden = read_json(&format!("engine_{name}.json"));
            assert_eq!(golden["scenario"], name);
            let spec = WorkloadSpec {
                prefixes: s.count("prefixes"),
                prefix_tokens: LengthDist::parse(s.text("prefix_tokens")),
                suffix_tokens: LengthDist::parse(s.text("suffix_tokens")),
                requests: s.count("requests"),
                zipf_alpha: s.float("zipf_alpha"),
                seed: s.count("seed") as u32,
            };
            let work = workload::generate(&spec);
            first_difference(name, &Driver::new(s, &work).run(), &golden)
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_golden_trace_has_its_scenario() {
    let names: Vec<String> = Scenario::all()
        .iter()
        .map(|s| format!("engine_{}.json", s.text("name")))
        .collect();
    let mut files: Vec<String> = std::fs::read_dir(golden_dir())
        .expect("the golden folder")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|f| {
            f.starts_with("engine_") && f.ends_with(".json") && f != "engine_scenarios.json"
        })
        .collect();
    files.sort();
    let mut expected = names.clone();
    expected.sort();
    assert_eq!(files, expected);
}
