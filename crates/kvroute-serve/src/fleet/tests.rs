//! The fleet's membership, ejection and routing glue against hand-made workers.

use super::*;
use crate::config::{EventSource, PolicySpec, ServeConfig, WorkerSpec};
use crate::models::ServedModels;
use crate::prompt::Prompts;
use kvroute_core::blocks::{BlockHasher, BlockKeys};
use kvroute_core::kvevents::codec::encode_text_extra_keys;
use kvroute_core::kvevents::events::{BlockStored, KvCacheEvent};
use kvroute_io::consumer::lock_index;

fn fleet(policy: &str, workers: &[&str]) -> Fleet {
    let mut spec = PolicySpec::named(policy);
    spec.seed = Some(1);
    let config = ServeConfig {
        workers: workers.iter().map(|w| WorkerSpec::url(*w)).collect(),
        policy: spec,
        block_size: 4,
        ..ServeConfig::default()
    };
    Fleet::new(&config).unwrap().0
}

#[test]
fn kv_aware_sends_a_repeated_prompt_where_it_went_and_counts_the_load() {
    let mut f = fleet("kv-aware", &["http://a:1", "http://b:1/v1"]);
    let hashes = vec![11, 12, 13];
    let first = f.route(&hashes, 12, &[], 0.0, None, None).unwrap();
    assert_eq!(first.decision.overlap, 0);
    f.first_token(first.decision.worker, first.decision.prefill_tokens);
    f.finished(first.decision.worker, first.decision.ticket, 0.05);
    let again = f.route(&hashes, 12, &[], 0.1, None, None).unwrap();
    assert_eq!(again.name, first.name);
    assert_eq!(again.url, first.url);
    assert_eq!(again.decision.overlap, 3);
    assert_eq!(f.load(again.decision.worker), (1, 1));
}

#[test]
fn a_retry_never_goes_back_to_a_worker_it_tried() {
    let mut f = fleet("round-robin", &["http://a:1", "http://b:1"]);
    let first = f.route(&[], 0, &[], 0.0, None, None).unwrap();
    let second = f
        .route(&[], 0, std::slice::from_ref(&first.name), 0.0, None, None)
        .unwrap();
    assert_ne!(first.name, second.name);
    assert!(
        f.route(&[], 0, &[first.name, second.name], 0.0, None, None)
            .is_none()
    );
}

#[test]
fn ejection_lasts_longer_each_time_and_needs_a_passing_check_after_it() {
    let mut f = fleet("round-robin", &["http://a:1", "http://b:1"]);
    let a = "http://a:1";
    assert!(!f.failed(a, 0.0));
    assert!(!f.failed(a, 0.0));
    assert!(f.failed(a, 0.0)); // third in a row: out for 5 s
    assert_eq!(f.available_count(1.0), 1);
    f.checked(a, true, 4.0); // before the end of the ejection: still out
    assert_eq!(f.available_count(4.0), 1);
    assert_eq!(f.available_count(6.0), 1); // over, but no check has passed since
    f.checked(a, true, 6.0);
    assert_eq!(f.available_count(6.0), 2);
    for _ in 0..3 {
        f.failed(a, 10.0);
    }
    assert_eq!(f.members()[0].ejected_until, 20.0); // the second: 2 x 5 s
    f.succeeded(a);
    assert_eq!(f.members()[0].ejections, 0);
}

#[test]
fn membership_changes_keep_the_others_state() {
    let mut f = fleet("round-robin", &["http://a:1", "http://b:1"]);
    f.checked("http://b:1", false, 0.0);
    let events = |port: u16| EventSource {
        endpoint: format!("tcp://c:{port}"),
        replay_endpoint: None,
    };
    let c = WorkerSpec {
        url: "http://c:1".into(),
        name: "pod-c".into(),
        events: Some(events(5557)),
        ready: true,
    };
    let m = f
        .set_workers(&[WorkerSpec::url("http://b:1"), c.clone()])
        .unwrap();
    assert_eq!(m.follow, [("pod-c".to_owned(), events(5557))]);
    assert!(m.unfollow.is_empty());
    let names: Vec<_> = f.members().iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["http://b:1", "pod-c"]);
    assert!(!f.members()[0].healthy);
    // The same list again changes nothing; c leaving stops its stream.
    assert_eq!(
        f.set_workers(&[WorkerSpec::url("http://b:1"), c]).unwrap(),
        Membership::default()
    );
    let m = f.set_workers(&[WorkerSpec::url("http://b:1")]).unwrap();
    assert_eq!(m.unfollow, ["pod-c"]);
    assert!(f.set_workers(&[WorkerSpec::url("ftp://x")]).is_err());
}
/// The `BlockStored` vLLM sends for `tokens` (whole 4-token blocks) computed under `keys`:
/// its own hashes (another seed), the adapter's name and id, one key tuple per block.
fn stored(tokens: &[u32], keys: &BlockKeys) -> KvCacheEvent {
    let engine = BlockHasher::new(4, 99).unwrap();
    let extra = (0..tokens.len() / 4)
        .map(|i| {
            let k = keys.for_block(i);
            (!k.is_empty()).then(|| encode_text_extra_keys(&k))
        })
        .collect();
    KvCacheEvent::Stored(BlockStored {
        lora_id: keys.lora_name.as_ref().map(|_| 1),
        lora_name: keys.lora_name.clone(),
        extra_keys: Some(extra),
        ..BlockStored::plain(
            engine.hash_blocks_keyed(tokens, None, 0, None, keys),
            None,
            tokens.iter().map(|&t| i64::from(t)).collect(),
            4,
        )
    })
}

/// A kv-aware fleet of `n` workers whose prompts are parsed by the returned [`Prompts`].
fn multi_tenant(n: usize) -> (Fleet, Prompts, Vec<String>) {
    let urls: Vec<String> = (0..n).map(|i| format!("http://w{i}:1")).collect();
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    let mut f = fleet("kv-aware", &refs);
    let prompts = Prompts::new(BlockHasher::new(4, 0).unwrap(), None, 1 << 20, 8, false).unwrap();
    f.set_adapter_names(prompts.adapter_names());
    let names = f.members().iter().map(|m| m.name.clone()).collect();
    (f, prompts, names)
}

fn parse(prompts: &Prompts, body: &str) -> crate::prompt::Prompt {
    prompts
        .parse(crate::prompt::Route::Completions, body.as_bytes())
        .unwrap()
}

const PROMPT: &str = "[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]";

#[test]
fn a_salted_request_is_never_routed_on_a_hit_it_cannot_get() {
    let (mut f, prompts, names) = multi_tenant(2);
    let tokens: Vec<u32> = (1..=16).collect();
    lock_index(f.index()).apply(&names[0], &[stored(&tokens, &BlockKeys::default())]);
    let plain = parse(&prompts, &format!(r#"{{"prompt": {PROMPT}}}"#));
    let salted = parse(
        &prompts,
        &format!(r#"{{"prompt": {PROMPT}, "cache_salt": "t"}}"#),
    );
    let workers: Vec<&str> = names.iter().map(String::as_str).collect();
    let mut index = lock_index(f.index());
    assert_eq!(
        index.overlaps(&plain.block_hashes, &workers, 0.0),
        vec![4, 0]
    );
    // The unsalted copy on w0 is no hit for a salted request: vLLM would compute it all.
    assert_eq!(
        index.overlaps(&salted.block_hashes, &workers, 0.0),
        vec![0, 0]
    );
    drop(index);
    let choice = f
        .route(&salted.block_hashes, 16, &[], 0.0, None, None)
        .unwrap();
    assert_eq!(choice.decision.overlap, 0);
}

#[test]
fn tenants_with_the_same_prompt_find_only_their_own_cache() {
    let (mut f, prompts, names) = multi_tenant(3);
    let tokens: Vec<u32> = (1..=16).collect();
    for (worker, salt) in [(0, "tenant-1"), (1, "tenant-2")] {
        let keys = BlockKeys::new(None, Some(salt));
        lock_index(f.index()).apply(&names[worker], &[stored(&tokens, &keys)]);
    }
    let workers: Vec<&str> = names.iter().map(String::as_str).collect();
    for (worker, salt) in [(0, "tenant-1"), (1, "tenant-2")] {
        let body = format!(r#"{{"prompt": {PROMPT}, "cache_salt": "{salt}"}}"#);
        let p = parse(&prompts, &body);
        let mut want = vec![0; 3];
        want[worker] = 4;
        let got = lock_index(f.index()).overlaps(&p.block_hashes, &workers, 0.0);
        assert_eq!(got, want);
        let choice = f.route(&p.block_hashes, 16, &[], 0.0, None, None).unwrap();
        assert_eq!(
            (choice.name.as_str(), choice.decision.overlap),
            (workers[worker], 4)
        );
    }
    assert_eq!(lock_index(f.index()).stats().skipped_blocks, 0);
}

#[test]
fn one_adapters_cache_never_counts_for_another() {
    let (mut f, prompts, names) = multi_tenant(2);
    let served = ServedModels::parse(
        br#"{"data":[{"id":"base","parent":null},{"id":"A","parent":"base"},{"id":"B","parent":"base"}]}"#,
    )
    .unwrap();
    for name in &names {
        f.set_models(name, served.clone());
    }
    let tokens: Vec<u32> = (1..=16).collect();
    let a = BlockKeys::new(Some("A"), Some("s"));
    lock_index(f.index()).apply(&names[0], &[stored(&tokens, &a)]);
    let workers: Vec<&str> = names.iter().map(String::as_str).collect();
    let overlaps = |f: &Fleet, model: &str, salt: &str| {
        let body = format!(r#"{{"prompt": {PROMPT}, "model": "{model}", "cache_salt": "{salt}"}}"#);
        let p = parse(&prompts, &body);
        lock_index(f.index()).overlaps(&p.block_hashes, &workers, 0.0)
    };
    assert_eq!(overlaps(&f, "A", "s"), vec![4, 0]);
    assert_eq!(overlaps(&f, "B", "s"), vec![0, 0]);
    assert_eq!(overlaps(&f, "A", "other"), vec![0, 0]);
    assert_eq!(overlaps(&f, "base", "s"), vec![0, 0]);
}

#[test]
fn a_tenant_stays_where_its_adapter_is_loaded_and_a_peers_decision_counts() {
    let mut spec = PolicySpec::named("kv-aware");
    spec.seed = Some(1);
    let config = ServeConfig {
        workers: vec![
            WorkerSpec::url("http://w0:1"),
            WorkerSpec::url("http://w1:1"),
        ],
        policy: spec,
        block_size: 4,
        max_loras: Some(1),
        ..ServeConfig::default()
    };
    let mut f = Fleet::new(&config).unwrap().0;
    let prompts = Prompts::new(BlockHasher::new(4, 0).unwrap(), None, 1 << 20, 8, false).unwrap();
    f.set_adapter_names(prompts.adapter_names());
    let served = ServedModels::parse(
        br#"{"data":[{"id":"base","parent":null},{"id":"A","parent":"base"},{"id":"B","parent":"base"}]}"#,
    )
    .unwrap();
    let names: Vec<String> = f.members().iter().map(|m| m.name.clone()).collect();
    for name in &names {
        f.set_models(name, served.clone());
    }
    // A peer replica sent a request for adapter B to w1, which has ended: w1's one slot
    // holds B.
    let peer = kvroute_core::mesh::PeerDecision {
        block_hashes: &[50, 51],
        prompt: &[],
        prompt_tokens: 8,
        output_tokens: 4,
        overlap: 0,
        adapter: None,
    };
    let tenant = RefreshTenant::named("B", "");
    let (handle, _) = f.apply_peer_routed(&names[1], &peer, tenant, 0.0);
    f.peer_finished(handle.expect("w1 is known"), 0.01);
    // Requests for A go to w0, the second although w0 is busy and w1 idle: on w1, A would
    // displace B.
    for (i, hashes) in [[1, 2], [3, 4]].iter().enumerate() {
        let a = f.route(hashes, 8, &[], 0.02, None, Some("A")).unwrap();
        assert_eq!(a.name, names[0], "request {i} for A");
    }
    // A base-model request takes no slot: it goes to the idle w1.
    let base = f.route(&[5, 6], 8, &[], 0.03, None, Some("base")).unwrap();
    assert_eq!(base.name, names[1]);
}

#[test]
fn a_model_is_routed_only_among_the_workers_that_serve_it() {
    let (mut f, _, names) = multi_tenant(6);
    let base = ServedModels::parse(br#"{"data":[{"id":"base","parent":null}]}"#).unwrap();
    let b = ServedModels::parse(br#"{"data":[{"id":"B","parent":null}]}"#).unwrap();
    assert!(
        !f.unknown_model("C"),
        "lists not known yet: any model may be served"
    );
    for (i, name) in names.iter().enumerate() {
        f.set_models(name, if i >= 4 { b.clone() } else { base.clone() });
    }
    let mut seen = std::collections::HashSet::new();
    for r in 0..60u64 {
        let hashes = [r, r + 1000];
        let choice = f.route(&hashes, 8, &[], 0.0, None, Some("B")).unwrap();
        assert!(
            names[4..].contains(&choice.name),
            "{} serves no B",
            choice.name
        );
        seen.insert(choice.name.clone());
        let other = f.route(&hashes, 8, &[], 0.0, None, Some("base")).unwrap();
        assert!(names[..4].contains(&other.name));
    }
    assert_eq!(seen.len(), 2, "both B workers take B's load");
    // Both B workers tried: nowhere else to go.
    assert!(
        f.route(&[1], 4, &names[4..], 0.0, None, Some("B"))
            .is_none()
    );
    assert!(f.unknown_model("C") && !f.unknown_model("B") && !f.unknown_model("base"));
}
