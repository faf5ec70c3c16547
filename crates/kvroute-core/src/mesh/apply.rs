//! A peer replica's decision applied to this replica's routing state as if it had made it:
//! the one rule both the live router (`kvroute-serve`'s fleet) and the simulator's replicas
//! (`kvroute_sim::sim::replicas`) follow.
//!
//! The decision goes through [`RoutingStep::route_to`] (the same accounting as the replica's
//! own: the prediction in the index, the load, the admission ticket); the policy counts the
//! peer's choice among the candidates it would have chosen from ([`Choose::observe`]); and,
//! with retention on, the retention model learns of it (`Retention::routed` with the peer's
//! overlap), after asking, when this replica owns the worker's retention, which prefixes the
//! decision's new blocks would push out (the refreshes to send).

use crate::index::KvIndex;
use crate::policies::{Choose, WorkerState};
use crate::retention::{Refresh, Retention};
use crate::routing::RoutingStep;

use super::{DecisionHandle, OpenEntry, PeerDecision};

/// Apply `decision` (to worker slot `slot`) at `now` to `step`, `index`, `policy` and
/// `retention`; `candidates` are the slots the policy would have chosen from, `owned` whether
/// this replica owns `slot`'s retention (its refreshes are appended to `refreshes`). Returns
/// the handle that releases the decision's load at its first token and end.
#[allow(clippy::too_many_arguments)]
pub fn apply_peer_decision(
    step: &mut RoutingStep,
    mut index: Option<&mut KvIndex>,
    policy: &mut dyn Choose,
    retention: Option<&mut Retention>,
    slot: usize,
    candidates: &[usize],
    owned: bool,
    decision: &PeerDecision<'_>,
    now: f64,
    refreshes: &mut Vec<Refresh>,
) -> DecisionHandle {
    let routed = step.route_to(
        index.as_deref_mut(),
        slot,
        decision.block_hashes,
        decision.prompt_tokens,
        decision.adapter,
        now,
    );
    if let Some(chosen) = candidates.iter().position(|&s| s == slot) {
        let states: Vec<&WorkerState> = candidates.iter().map(|&s| step.state(s)).collect();
        policy.observe(&states, chosen);
    }
    if let Some(r) = retention
        && !decision.prompt.is_empty()
        && !decision.block_hashes.is_empty()
    {
        if owned {
            let incoming = (decision.prompt.len() + decision.output_tokens)
                .div_ceil(step.block_size())
                .saturating_sub(decision.overlap);
            r.poll_step(step, index, slot, incoming, now, refreshes);
        }
        r.routed(
            slot,
            decision.block_hashes,
            decision.prompt,
            decision.overlap,
            decision.output_tokens,
            now,
        );
    }
    DecisionHandle {
        slot,
        prefill_tokens: routed.prefill_tokens,
        ticket: routed.ticket,
        first_token: false,
    }
}

/// A decision in flight that an adopted snapshot lists (`super::adopt`), applied to `slot`
/// at `now`: its load and prediction as when its `Routed` is applied, with its prefill
/// released at once if its first token came; the policy's shares and the retention model
/// are left as the snapshot's shares have them. A snapshot names no adapter, so the
/// decision leaves the worker's modelled LoRA slots as they are (the next decisions for it
/// fill them).
pub fn adopt_open_decision(
    step: &mut RoutingStep,
    index: Option<&mut KvIndex>,
    slot: usize,
    entry: &OpenEntry,
    now: f64,
) -> DecisionHandle {
    let routed = step.route_to(
        index,
        slot,
        &entry.block_hashes,
        entry.prompt_tokens as usize,
        None,
        now,
    );
    let handle = DecisionHandle {
        slot,
        prefill_tokens: routed.prefill_tokens,
        ticket: routed.ticket,
        first_token: entry.first_token,
    };
    if entry.first_token {
        step.first_token(slot, routed.prefill_tokens);
    }
    handle
}

/// A peer decision applied as `handle` got its first token: its prefill leaves the load.
pub fn peer_first_token(step: &mut RoutingStep, handle: &DecisionHandle) {
    step.first_token(handle.slot, handle.prefill_tokens);
}

/// A peer decision applied as `handle` ended (or expired) at `now`: release what it charged.
pub fn peer_finished(step: &mut RoutingStep, handle: DecisionHandle, now: f64) {
    if !handle.first_token {
        step.first_token(handle.slot, handle.prefill_tokens);
    }
    step.finished(handle.slot, handle.ticket, now);
}

/// The owner of `slot`'s retention (named `worker` in the index) refreshed the prefix of these
/// block hashes there at `now`: the prediction in the index and the retention model follow,
/// as after this replica's own refresh.
pub fn apply_peer_refresh(
    index: Option<&mut KvIndex>,
    retention: Option<&mut Retention>,
    slot: usize,
    worker: &str,
    block_hashes: &[u64],
    now: f64,
) {
    if let Some(index) = index {
        let id = index.ensure_worker(worker);
        index.record_routed_to(id, block_hashes, now);
    }
    if let Some(r) = retention {
        r.refreshed_elsewhere(slot, block_hashes);
    }
}
