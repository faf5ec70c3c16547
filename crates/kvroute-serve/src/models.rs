//! Which models and LoRA adapters each worker serves (pure: parses `GET /v1/models` answers).
//!
//! vLLM lists every name a request's `model` may take in `GET /v1/models`: its served model
//! names (cards whose `parent` is null) and, with `--enable-lora`, each `--lora-modules` entry
//! (a card whose `parent` is the base model). A request naming an adapter runs under it, and
//! vLLM mixes the adapter's name into every block hash of that request
//! (`kvroute_core::blocks::BlockKeys`): the router must know which names are adapters to hash
//! a prompt as the engine will, and which workers serve a name to route it only among them.

use std::collections::HashSet;
use std::sync::{Arc, RwLock};

use serde_json::Value;

/// The names one worker answers to, from its `GET /v1/models`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServedModels {
    /// Every name a request's `model` may take there (base models and adapters).
    pub names: HashSet<String>,
    /// Those that are LoRA adapters (a card with a `parent`).
    pub adapters: HashSet<String>,
}

impl ServedModels {
    /// A `GET /v1/models` answer's names, or None when it is not an OpenAI model list.
    pub fn parse(body: &[u8]) -> Option<Self> {
        let value: Value = serde_json::from_slice(body).ok()?;
        let mut served = Self::default();
        for card in value.get("data")?.as_array()? {
            let id = card.get("id")?.as_str()?;
            if card.get("parent").is_some_and(Value::is_string) {
                served.adapters.insert(id.to_owned());
            }
            served.names.insert(id.to_owned());
        }
        Some(served)
    }

    /// Whether a request for `model` may go there.
    pub fn serves(&self, model: &str) -> bool {
        self.names.contains(model)
    }
}

/// The names of the LoRA adapters any worker serves, shared between the fleet (which learns
/// them) and the prompt parser (which hashes a request for one under its name).
#[derive(Clone, Debug, Default)]
pub struct AdapterNames(Arc<RwLock<HashSet<String>>>);

impl AdapterNames {
    /// Whether `model` names a LoRA adapter some worker serves.
    pub fn contains(&self, model: &str) -> bool {
        let names = self.0.read().unwrap_or_else(|p| p.into_inner());
        !names.is_empty() && names.contains(model)
    }

    /// Replace the set (the union over the workers' lists).
    pub fn set(&self, names: HashSet<String>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = names;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_vllms_model_list_with_lora_modules() {
        let body = br#"{"object":"list","data":[
            {"id":"base","object":"model","root":"/m","parent":null,"max_model_len":4096},
            {"id":"sql","object":"model","root":"/a/sql","parent":"base"},
            {"id":"alias","object":"model","root":"/m","parent":null}]}"#;
        let served = ServedModels::parse(body).unwrap();
        assert!(served.serves("base") && served.serves("sql") && served.serves("alias"));
        assert!(!served.serves("other"));
        assert_eq!(served.adapters, HashSet::from(["sql".to_owned()]));
        assert_eq!(ServedModels::parse(b"{}"), None);
        assert_eq!(
            ServedModels::parse(br#"{"data":[{"object":"model"}]}"#),
            None
        );
        assert_eq!(ServedModels::parse(b"not json"), None);
    }

    #[test]
    fn adapter_names_are_shared() {
        let a = AdapterNames::default();
        let b = a.clone();
        assert!(!b.contains("sql"));
        a.set(HashSet::from(["sql".to_owned()]));
        assert!(b.contains("sql") && !b.contains("base"));
    }
}
