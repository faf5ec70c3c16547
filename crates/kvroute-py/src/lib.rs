//! `kvroute._native`: the Python face of `kvroute-core`.
//!
//! One file per area of the core, each with a `register` function adding its classes to the
//! module. The Python package re-exports them from the modules that always held those names
//! (`kvroute.blocks.BlockHasher`, `kvroute.engine.BlockPool`, …), so the tests written
//! against the Python API keep guarding the native code.

use pyo3::prelude::*;

#[cfg(feature = "bench")]
mod bench;
mod blocks;
mod chat;
mod config;
mod consumer;
mod engine;
mod events;
mod index;
mod kvevents;
mod policies;
mod retention;
mod routing;
mod serve;
mod sim;
mod tokens;
mod trace;
mod workers;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    blocks::register(m)?;
    chat::register(m)?;
    engine::register(m)?;
    index::register(m)?;
    workers::register(m)?;
    policies::register(m)?;
    routing::register(m)?;
    retention::register(m)?;
    serve::register(m)?;
    kvevents::register(m)?;
    consumer::register(m)?;
    sim::register(m)?;
    tokens::register(m)?;
    trace::register(m)?;
    #[cfg(feature = "bench")]
    bench::register(m)?;
    Ok(())
}
