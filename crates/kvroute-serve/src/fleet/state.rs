//! The fleet itself: its workers, the routing operation and the index they share, built from
//! the serve configuration.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use kvroute_core::policies::Choose;
use kvroute_core::retention::{Retention, RetentionConfig};
use kvroute_core::routing::{Router, RoutingStep};
use kvroute_io::consumer::SharedIndex;

use super::member::{Member, Membership};
use super::tenants::RefreshTenants;
use crate::config::{ConfigError, ServeConfig};
use crate::contention::LockStats;
use crate::models::AdapterNames;

/// The workers, the index, and the routing operation (step, policy, retention) around them.
pub struct Fleet {
    pub(super) members: Vec<Member>,
    pub(super) router: Router,
    pub(super) index: SharedIndex,
    pub(super) eject_after_failures: u32,
    pub(super) eject_base_s: f64,
    pub(super) candidates: Vec<usize>,
    /// The configured KV capacity of every worker (None: each reports its own).
    pub(super) kv_capacity_blocks: Option<usize>,
    /// The adapters the workers serve, shared with the prompt parser.
    pub(super) adapters: AdapterNames,
    /// The tenant of each prefix retention saw routed.
    pub(super) tenants: RefreshTenants,
    /// The worker URLs whose refreshes this replica sends (None: all; the replica mesh
    /// names one owner per worker, see `super::peers`).
    pub(super) retention_owned: Option<HashSet<String>>,
    /// How the index's lock is contended when the routing step takes it (the KV-event
    /// consumer's thread holds it while it applies a batch).
    pub(super) index_lock: LockStats,
}

impl Fleet {
    /// A fleet of `config.workers` (all healthy until a check says otherwise), and the streams
    /// to follow for them.
    pub fn new(config: &ServeConfig) -> Result<(Self, Membership), ConfigError> {
        let index = config.index()?;
        let policy = config.policy.build(config.block_size)?;
        let mut step = RoutingStep::new(config.block_size);
        if policy.needs_admission() {
            step.track_admission(config.kv_capacity_blocks);
        }
        step.track_adapters(config.max_loras);
        let retention = config.retention().map(|(mode, capacity)| {
            Retention::new(RetentionConfig::new(mode, config.block_size, capacity))
        });
        let mut fleet = Self {
            members: Vec::new(),
            router: Router::new(step, policy, retention),
            index: Arc::new(Mutex::new(index)),
            eject_after_failures: config.eject_after_failures,
            eject_base_s: config.eject_base.as_secs_f64(),
            candidates: Vec::new(),
            kv_capacity_blocks: config.kv_capacity_blocks,
            adapters: AdapterNames::default(),
            tenants: RefreshTenants::default(),
            retention_owned: None,
            index_lock: LockStats::default(),
        };
        let membership = fleet.set_workers(&config.workers)?;
        Ok((fleet, membership))
    }

    /// The index, shared with the KV-event consumer.
    pub fn index(&self) -> &SharedIndex {
        &self.index
    }

    /// How the routing step waits for the index's lock.
    pub fn index_lock(&self) -> &LockStats {
        &self.index_lock
    }
}
