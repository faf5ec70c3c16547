//! Whose prefix each refresh keeps: the `model` and `cache_salt` a refresh's body names, so
//! that it warms the blocks that tenant's requests hit (vLLM keys them by adapter and salt).

use std::collections::HashMap;

use kvroute_core::retention::Refresh;

/// What a refresh's body names besides its prompt: the `model` and `cache_salt` of the
/// requests whose prefix it keeps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RefreshTenant {
    pub model: Option<String>,
    pub cache_salt: Option<String>,
}

impl RefreshTenant {
    /// The tenant a peer replica's decision names (its `model` and `cache_salt`; empty: none).
    pub fn named(model: &str, cache_salt: &str) -> Self {
        let given = |v: &str| (!v.is_empty()).then(|| v.to_owned());
        Self {
            model: given(model),
            cache_salt: given(cache_salt),
        }
    }
}

/// Most prefixes whose tenant the fleet remembers for refreshes; past it the memory starts
/// over (a refresh of a forgotten prefix names no model and no salt).
const MAX_REFRESH_TENANTS: usize = 1 << 16;

/// The tenant of each prefix retention saw routed, by its first block's hash (which the
/// adapter and the salt key already).
#[derive(Clone, Debug, Default)]
pub struct RefreshTenants {
    by_first_block: HashMap<u64, RefreshTenant>,
}

impl RefreshTenants {
    /// Remember that the prefix starting with block `first_block` is `tenant`'s (bounded by
    /// [`MAX_REFRESH_TENANTS`]).
    pub fn remember(&mut self, first_block: u64, tenant: RefreshTenant) {
        if self.by_first_block.len() >= MAX_REFRESH_TENANTS {
            self.by_first_block.clear();
        }
        self.by_first_block.insert(first_block, tenant);
    }

    /// The tenant of each refresh's prefix (a forgotten one's: none).
    pub fn of(&self, refreshes: &[Refresh]) -> Vec<RefreshTenant> {
        refreshes
            .iter()
            .map(|r| {
                r.block_hashes
                    .first()
                    .and_then(|h| self.by_first_block.get(h))
                    .cloned()
                    .unwrap_or_default()
            })
            .collect()
    }
}
