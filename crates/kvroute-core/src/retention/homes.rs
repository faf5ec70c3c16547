//! Where each prefix family lives: the home counts retention's placement balances.

use std::collections::HashMap;

/// Where each prefix family went last: a family is the prompts sharing their first
/// `min_prefix_blocks` blocks (their chained hash names it), its home the slot the last of
/// them was routed to. A slot's count is how many families it is the home of, what
/// [`Retention::room_for`](super::Retention::room_for) balances. A family's first prompt counts too: a sequential
/// warmup (one request per prefix on an idle fleet) is then dealt out evenly, where the
/// policy's ties would pile several prefixes on one worker for good.
#[derive(Clone, Debug, Default)]
pub(super) struct Homes {
    /// Family → (its home slot, the routing serial of its last request).
    pub(super) families: HashMap<u64, (usize, u64)>,
    /// Families homed per slot.
    pub(super) counts: Vec<usize>,
    /// Requests routed so far.
    pub(super) serial: u64,
}

/// Families remembered; beyond it the least recently routed half is forgotten (a workload
/// of unique prompts makes a family per request).
pub(super) const MAX_FAMILIES: usize = 8192;

impl Homes {
    pub(super) fn count(&self, slot: usize) -> usize {
        self.counts.get(slot).copied().unwrap_or(0)
    }

    /// Whether more than `limit` families were routed to within the last `window` requests
    /// (it stops counting there: a workload of unique prompts fills the table).
    pub(super) fn recent_exceed(&self, window: u64, limit: usize) -> bool {
        let since = self.serial.saturating_sub(window);
        self.families
            .values()
            .filter(|e| e.1 > since)
            .nth(limit)
            .is_some()
    }

    pub(super) fn home(&self, family: u64) -> Option<usize> {
        self.families.get(&family).map(|&(slot, _)| slot)
    }

    pub(super) fn routed(&mut self, family: u64, slot: usize) {
        self.serial += 1;
        if self.counts.len() <= slot {
            self.counts.resize(slot + 1, 0);
        }
        if let Some((old, _)) = self.families.insert(family, (slot, self.serial)) {
            self.counts[old] -= 1;
        }
        self.counts[slot] += 1;
        if self.families.len() > MAX_FAMILIES {
            let mut serials: Vec<u64> = self.families.values().map(|e| e.1).collect();
            let (_, &mut median, _) = serials.select_nth_unstable(MAX_FAMILIES / 2);
            let counts = &mut self.counts;
            self.families.retain(|_, &mut (home, serial)| {
                if serial < median {
                    counts[home] -= 1;
                }
                serial >= median
            });
        }
    }

    pub(super) fn forget_slot(&mut self, slot: usize) {
        self.families.retain(|_, e| e.0 != slot);
        if let Some(c) = self.counts.get_mut(slot) {
            *c = 0;
        }
    }
}
