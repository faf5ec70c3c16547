//! Routing: the one step every front runs ([`step`]: index look-up, policy, prediction and
//! load accounting) and the one routing operation around it ([`router`]: the step with its
//! policy and retention, and a peer replica's decisions applied to them), shared by the live
//! router (`kvroute-serve`'s fleet), the simulator (`kvroute-sim`'s placements) and the
//! replica mesh.

pub mod router;
pub mod step;

pub use router::{IdlePoll, Router};
pub use step::{Decision, JournalEntry, Request, RoutingStep};
