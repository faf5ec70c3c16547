//! The pure engine model of a vLLM v1 worker: `BlockPool`, scheduler, cost model (the KV
//! events it publishes are `kvroute_core::kvevents::events`).
//!
//! Pure by design: no clock, no I/O. A driver (the simulator on virtual time, the emulator
//! on the wall clock) hands it requests and the current time, asks it to run a step and
//! reads back what happened and how long the step took.

pub mod cost;
pub mod pool;
pub mod scheduler;
