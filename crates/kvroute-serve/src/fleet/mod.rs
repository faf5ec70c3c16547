//! The router's workers and its one routing operation (pure: fed outcomes and times, no I/O).
//!
//! Membership ([`membership`]) comes from the worker list (`--worker`, or the Python face's
//! discovery through [`Fleet::set_workers`]). A worker is available while it is healthy and
//! not ejected ([`health`]):
//!
//! - **health**: a failed `GET /health` (anything but 2xx: redirects are never followed) or a
//!   refused connection takes it out and drops its index entries (the router would otherwise
//!   keep steering prefixes to a dead worker); a passing check brings it back;
//! - **outlier ejection** (Envoy's, simplified): `eject_after_failures` consecutive failed
//!   requests (first-byte or idle timeouts, deaths mid-answer, 5xx answers: a worker alive but
//!   not serving) take it out for `eject_base` times its number of ejections in a row (at most
//!   [`MAX_EJECTION_S`]); it returns at the first passing health check after that, so a worker
//!   whose `/health` answers while its generations hang does not flap back. A success resets
//!   both counts.
//!
//! Routing ([`routing`]) is `kvroute_core::routing::Router` (the simulator's too): index
//! look-up, policy, retention, prediction and load accounting, among the available workers
//! that serve the request's model: each worker's models and LoRA adapters come from its
//! `GET /v1/models` ([`Fleet::set_models`], [`crate::models`]); a worker whose list is not
//! known yet may take any model, and a model no worker lists while every list is known is
//! refused ([`Fleet::unknown_model`]). Refreshes name the tenant of the prefix they keep
//! ([`tenants`]); the admission guard and retention count each worker's cache by the
//! capacity its engine reports ([`capacity`]); a peer replica's decisions and refreshes are
//! applied as this replica's own ([`peers`]). The index is shared with the KV-event
//! consumer's thread (`kvroute_io`), which applies every batch to it; the fleet only says
//! which workers joined and left ([`Membership`]), and the server follows or stops following
//! their streams.

pub mod capacity;
pub mod health;
pub mod member;
pub mod membership;
pub mod peers;
pub mod routing;
pub mod state;
pub mod tenants;

#[cfg(test)]
mod tests;

pub use health::MAX_EJECTION_S;
pub use member::{Member, Membership};
pub use routing::{Dispatch, IdleRefreshes, WorkerAdmission};
pub use state::Fleet;
pub use tenants::RefreshTenant;
