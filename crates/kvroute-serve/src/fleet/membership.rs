//! Membership: the worker list (a complete one each time) and what each worker serves.

use kvroute_core::policies::adapter_id;
use kvroute_io::consumer::lock_index;

use super::member::{Member, Membership};
use super::state::Fleet;
use crate::config::{ConfigError, WorkerSpec, worker_base_url};
use crate::models::{AdapterNames, ServedModels};

impl Fleet {
    /// Make the fleet match `workers` (a complete list): new workers join healthy, removed
    /// ones are forgotten by the index; the others keep their state.
    pub fn set_workers(&mut self, workers: &[WorkerSpec]) -> Result<Membership, ConfigError> {
        let wanted: Vec<WorkerSpec> = workers
            .iter()
            .map(|w| {
                let url = worker_base_url(&w.url)?;
                let name = if w.name.is_empty() {
                    url.clone()
                } else {
                    w.name.clone()
                };
                Ok(WorkerSpec {
                    url,
                    name,
                    ..w.clone()
                })
            })
            .collect::<Result<_, ConfigError>>()?;
        let mut membership = Membership::default();
        let (kept, gone): (Vec<Member>, Vec<Member>) = std::mem::take(&mut self.members)
            .into_iter()
            .partition(|m| wanted.iter().any(|w| w.name == m.name));
        for m in gone {
            if m.events.is_some() {
                membership.unfollow.push(m.name.clone());
            }
            self.router.step_mut().remove_worker(&m.name);
            lock_index(&self.index).remove_worker(&m.name);
        }
        self.members = kept;
        for spec in wanted {
            if let Some(m) = self.members.iter_mut().find(|m| m.name == spec.name) {
                m.ready = spec.ready;
                m.url = spec.url;
                if m.events != spec.events {
                    match &spec.events {
                        Some(e) => membership.follow.push((spec.name.clone(), e.clone())),
                        None => membership.unfollow.push(spec.name.clone()),
                    }
                    m.events = spec.events;
                }
                continue;
            }
            if let Some(e) = &spec.events {
                membership.follow.push((spec.name.clone(), e.clone()));
            }
            let slot = self.router.step_mut().add_worker(&spec.name);
            self.members.push(Member {
                name: spec.name,
                url: spec.url,
                events: spec.events,
                ready: spec.ready,
                slot,
                healthy: true,
                consecutive_failures: 0,
                ejections: 0,
                ejected_until: 0.0,
                ejected_total: 0,
                health_failures: 0,
                kv_capacity_blocks: self.kv_capacity_blocks,
                kv_capacity_retry_at: 0.0,
                models: None,
            });
        }
        self.share_adapters();
        self.share_retention_owned();
        Ok(membership)
    }

    /// The adapter id of a request for `model`, when `model` names a LoRA adapter some
    /// worker serves (None: a base model, or none named).
    pub fn adapter_of(&self, model: Option<&str>) -> Option<u64> {
        model.filter(|m| self.adapters.contains(m)).map(adapter_id)
    }

    /// Keep `adapters` (the prompt parser's) equal to the adapters the workers serve.
    pub fn set_adapter_names(&mut self, adapters: AdapterNames) {
        self.adapters = adapters;
        self.share_adapters();
    }

    /// Worker `name` answered `GET /v1/models` with `models`.
    pub fn set_models(&mut self, name: &str, models: ServedModels) {
        let Some(m) = self.members.iter_mut().find(|m| m.name == name) else {
            return;
        };
        if m.models.as_ref() != Some(&models) {
            m.models = Some(models);
            self.share_adapters();
        }
    }

    fn share_adapters(&self) {
        let names = self
            .members
            .iter()
            .filter_map(|m| m.models.as_ref())
            .flat_map(|s| s.adapters.iter().cloned())
            .collect();
        self.adapters.set(names);
    }

    /// Whether a request for `model` names nothing the fleet serves: every worker's list is
    /// known and none has it (vLLM answers such a request with a 404).
    pub fn unknown_model(&self, model: &str) -> bool {
        !self.members.is_empty()
            && self
                .members
                .iter()
                .all(|m| m.models.as_ref().is_some_and(|s| !s.serves(model)))
    }

    /// Every worker, in the order they joined.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// Workers that may take a new request at `now`.
    pub fn available_count(&self, now: f64) -> usize {
        self.members.iter().filter(|m| m.available(now)).count()
    }

    /// Any available worker's `(name, url)` (for `/v1/models`), round the list from `start`.
    pub fn any_available(&self, start: usize, now: f64) -> Option<(String, String)> {
        let n = self.members.len();
        (0..n)
            .map(|i| &self.members[(start + i) % n.max(1)])
            .find(|m| m.available(now))
            .map(|m| (m.name.clone(), m.url.clone()))
    }
}
