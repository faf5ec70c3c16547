//! The simulator's native event loop (`kvroute_sim::sim`) for Python: `simulate` runs one
//! request set on the engines and routing step of a `kvroute.sim.Simulation`, all in Rust.
//!
//! The Python objects keep their state between runs: the engines, the routing step and the
//! retention model are taken out of their Python handles for the run (the step and the
//! retention into the routing operation, `kvroute_core::routing::Router`, with the policy
//! lent to it) and put back after it, and the index is borrowed, so a test can look at all of
//! them afterwards.

use kvroute_io::lock_index;
use std::sync::Arc;

use kvroute_core::blocks::BlockKeys;
use kvroute_core::policies::Choose;
use kvroute_core::retention::Retention;
use kvroute_core::routing::{self, Router};
use kvroute_sim::engine::scheduler;
use kvroute_sim::hash_events::trust_engine_hashes;
use kvroute_sim::sim::placement::{Placement, RouterPlacement};
use kvroute_sim::sim::replicas::ReplicaPlacement;
use kvroute_sim::sim::{
    RefreshStats, RequestRecord, RequestSet, SimError, Simulation, Tenant, TrialResult,
    WorkerConfig,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::engine::{Engine, PrefixCacheStats, cost_of};
use crate::policies::ForeignPolicy;
use crate::retention::PyRetention;
use crate::routing::RoutingStep;
use crate::tokens::extract_tokens;
use crate::trace::PromptTable;

/// A `uint32`/`uint64` array from Python as a `Vec<usize>` (offsets).
fn offsets(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    if let Ok(buffer) = pyo3::buffer::PyBuffer::<u64>::get(obj) {
        return Ok(buffer.to_vec(py)?.into_iter().map(|v| v as usize).collect());
    }
    obj.extract::<Vec<usize>>()
}

/// Every request's own tokens in one vector: `obj` is one token array (all of them,
/// concatenated) or a list of one array per request, copied straight into place (one copy
/// of a million suffixes instead of a concatenation in numpy and a copy of its result).
fn concat_suffixes(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let Ok(list) = obj.cast::<PyList>() else {
        return extract_tokens(py, obj);
    };
    let mut out: Vec<u32> = Vec::new();
    for item in list.iter() {
        match pyo3::buffer::PyBuffer::<u32>::get(&item) {
            Ok(buffer) if buffer.dimensions() <= 1 => {
                let at = out.len();
                out.resize(at + buffer.item_count(), 0);
                buffer.copy_to_slice(py, &mut out[at..])?;
            }
            _ => out.extend(extract_tokens(py, &item)?),
        }
    }
    Ok(out)
}

/// A prefix's tenant from Python: `(lora_name, lora_id, cache_salt)`.
type TenantTuple = (Option<String>, Option<i64>, Option<String>);

/// Run one request set through the native simulator.
///
/// Args:
///     engines: the workers' ``Engine`` objects (idle); slot ``i`` of ``routing`` is worker ``i``.
///     routing: the ``RoutingStep`` (with a native policy) that places the requests.
///     now: the simulation clock when the run starts.
///     prefixes: the shared prefixes' token arrays, by prefix id, or a ``PromptTable``
///         (its prompts shared, not copied).
///     prefix_ids, suffix_tokens, suffix_offsets, output_tokens: the requests (see
///         ``kvroute_sim::sim::RequestSet``); ``suffix_tokens`` may also be a list of one
///         token array per request.
///     output: the tokens every request generates (request ``i`` the first ``output_tokens[i]``).
///     concurrency: closed-loop clients, or None with ``send_times`` (open loop).
///     send_times: each request's send time (open loop).
///     retention: a ``Retention`` fed the routing step's decisions; its refreshes are sent to
///         the engines as requests (not recorded, counted in ``refreshes``).
///     tenants: per prefix id, ``(lora_name, lora_id, cache_salt)`` (each may be None): the
///         adapter and salt its requests' blocks hash under and the adapter that takes a LoRA
///         slot on its worker; None (or a prefix past the end): plain requests.
///     replicas: N router replicas instead of ``routing`` (``kvroute_sim::sim::replicas``):
///         one ``RoutingStep`` per replica (each its own index and native policy), behind a
///         balancer that draws a replica per request (seeded with ``balancer_seed``).
///     replica_retention: with ``replicas``, one ``Retention`` per replica (or None: off).
///     mesh_lag: with ``replicas``, the replica mesh's delivery lag in seconds (None: no mesh).
///     balancer_seed: the seed of the balancer's draws.
///     warmup: ``(prefix_ids, suffix_tokens, suffix_offsets, output_tokens)`` of requests sent
///         one at a time before the requests, unmeasured: a trial
///         (``kvroute_sim::sim::Simulation::run_trial``; closed loop only).
///
/// Returns:
///     A dict: ``now`` (the clock after the run), the run's refreshes (``refresh_requests``,
///     ``refresh_computed_tokens``, ``refresh_engine_s``) and one list per record field of the
///     requests (``worker``, ``cached_tokens``, ``prompt_tokens``, ``send_time``, ``ttft_s``,
///     ``e2e_s``, ``output_tokens``), in request order; for a trial also its measured window:
///     ``duration_s``, ``window_stats`` (each worker's ``PrefixCacheStats``),
///     ``window_refresh_requests`` and ``window_refresh_engine_s``.
#[pyfunction]
#[pyo3(signature = (engines, routing, now, prefixes, prefix_ids, suffix_tokens, suffix_offsets, output_tokens, output, concurrency = None, send_times = None, retention = None, tenants = None, replicas = None, replica_retention = None, mesh_lag = None, balancer_seed = 0, warmup = None))]
// The one entry point from `kvroute.sim` into the native event loop: its arguments are the
// run's arrays (read without copies) and its options, each a keyword on the Python side; a
// struct here would only be rebuilt from those same keywords.
#[allow(clippy::too_many_arguments)]
fn simulate<'py>(
    py: Python<'py>,
    engines: Vec<Bound<'py, Engine>>,
    routing: Bound<'py, RoutingStep>,
    now: f64,
    prefixes: &Bound<'py, PyAny>,
    prefix_ids: &Bound<'py, PyAny>,
    suffix_tokens: &Bound<'py, PyAny>,
    suffix_offsets: &Bound<'py, PyAny>,
    output_tokens: &Bound<'py, PyAny>,
    output: &Bound<'py, PyAny>,
    concurrency: Option<usize>,
    send_times: Option<Vec<f64>>,
    retention: Option<Bound<'py, PyRetention>>,
    tenants: Option<Vec<TenantTuple>>,
    replicas: Option<Vec<Bound<'py, RoutingStep>>>,
    replica_retention: Option<Vec<Bound<'py, PyRetention>>>,
    mesh_lag: Option<f64>,
    balancer_seed: u64,
    warmup: Option<RequestArrays<'py>>,
) -> PyResult<Bound<'py, PyDict>> {
    let tenants: Vec<Tenant> = tenants
        .unwrap_or_default()
        .into_iter()
        .map(|(lora_name, lora_id, salt)| Tenant {
            keys: BlockKeys::new(lora_name.as_deref(), salt.as_deref()),
            lora_id,
        })
        .collect();
    let Some(first) = engines.first() else {
        return Err(PyValueError::new_err("no engines"));
    };
    let requests = request_set(
        py,
        (prefix_ids, suffix_tokens, suffix_offsets, output_tokens),
    )?;
    let warmup = match &warmup {
        Some((a, b, c, d)) => Some(request_set(py, (a, b, c, d))?),
        None => None,
    };
    let sends = Sends {
        warmup: warmup.as_ref(),
        requests: &requests,
        clients: (concurrency, send_times.as_deref()),
    };
    let prefixes: Vec<Arc<[u32]>> = match prefixes.cast::<PromptTable>() {
        Ok(table) => table.get().prompts.clone(),
        Err(_) => prefixes
            .try_iter()?
            .map(|p| extract_tokens(py, &p?).map(Arc::from))
            .collect::<PyResult<_>>()?,
    };
    let output: Arc<[u32]> = extract_tokens(py, output)?.into();
    let config = {
        let e = first.borrow();
        WorkerConfig {
            num_blocks: e.core.pool().num_blocks(),
            cost: cost_of(e.cost_obj.bind(py))?,
            hasher: *e.core.hasher(),
            enable_caching: e.core.pool().enable_caching(),
        }
    };
    if let Some(replicas) = replicas {
        let fleet = ReplicaFleet {
            steps: &replicas,
            retention: replica_retention.as_deref(),
            mesh_lag,
            balancer_seed,
        };
        let inputs = RunInputs {
            config,
            prefixes,
            output,
            sends,
            tenants,
        };
        let (now, result, refreshes) = run_replicas(py, fleet, &engines, now, inputs)?;
        return records_dict(py, now, result, refreshes);
    }
    let mut step = routing.borrow_mut();
    if step.inner.slot_count() != engines.len() {
        return Err(PyValueError::new_err(
            "the routing step must have one slot per engine",
        ));
    }
    let native = step.native.as_ref().map(|p| p.clone_ref(py));
    let foreign_obj = step.policy.clone_ref(py);
    let foreign_bound = foreign_obj.bind(py);
    let index_obj = step.index.as_ref().map(|i| i.clone_ref(py));
    let index_ref = index_obj.as_ref().map(|i| i.borrow(py));
    // Held for the whole run: the simulator's index is fed by its own engines only.
    let mut index = index_ref.as_ref().map(|i| lock_index(&i.inner));
    let mut native_policy = native.as_ref().map(|p| p.borrow_mut(py));
    // A policy written in Python (a test's oracle) is asked through the binding's adapter.
    let mut foreign = ForeignPolicy {
        policy: foreign_bound,
        needs_overlap: native.is_none() && foreign_bound.getattr("needs_overlap")?.is_truthy()?,
        error: None,
    };
    let taken = take_engines(&engines)?;
    let mut index = index.as_deref_mut();
    if let Some(ix) = index.as_deref_mut()
        && ix.hasher() == config.hasher
    {
        // The engine model hashes blocks with the index's own hasher: its events' hashes are
        // the index's own (see kvroute_sim::hash_events::trust_engine_hashes).
        trust_engine_hashes(ix);
    }
    let mut retention = retention.as_ref().map(|r| r.borrow_mut());
    let taken_retention = retention
        .as_deref_mut()
        .map(|r| take_retention(&mut r.inner));
    let run = |policy: &mut dyn Choose,
               index,
               step: &mut routing::RoutingStep,
               retention: Option<Retention>| {
        let mut router = Router::new(take_step(step), policy, retention);
        let mut placement = RouterPlacement::new(&mut router, index);
        let mut sim =
            Simulation::with_engines(taken, now, config, &mut placement, prefixes, output);
        sim.set_tenants(tenants);
        let result = run_requests(&mut sim, sends);
        let refreshes = sim.refresh_stats();
        let engines = sim.into_engines();
        let (back, _, retention) = router.into_parts();
        *step = back;
        (engines, result, refreshes, retention)
    };
    let ((back, now), result, refreshes, retention_back) = match native_policy.as_deref_mut() {
        // All in Rust: the run lets go of the interpreter, so that trials in other threads
        // (the policies of a trace replay) run on other cores meanwhile.
        Some(p) => {
            let (policy, step) = (&mut p.inner, &mut step.inner);
            py.detach(move || run(policy, index, step, taken_retention))
        }
        None => run(&mut foreign, index, &mut step.inner, taken_retention),
    };
    if let (Some(r), Some(back)) = (retention.as_deref_mut(), retention_back) {
        r.inner = back;
    }
    for (e, core) in engines.iter().zip(back) {
        e.borrow_mut().core = core;
    }
    if let Some(e) = foreign.error.take() {
        return Err(e);
    }
    records_dict(py, now, result, refreshes)
}

/// A routing step out of its Python handle for a run (an empty one of the same block size
/// stands in).
fn take_step(step: &mut routing::RoutingStep) -> routing::RoutingStep {
    let placeholder = routing::RoutingStep::new(step.block_size());
    std::mem::replace(step, placeholder)
}

/// A retention model out of its Python handle for a run (a fresh one of the same
/// configuration stands in).
fn take_retention(retention: &mut Retention) -> Retention {
    let placeholder = Retention::new(retention.config().clone());
    std::mem::replace(retention, placeholder)
}

/// The engines out of their Python handles for a run (a placeholder stands in); they must be
/// idle.
fn take_engines(engines: &[Bound<'_, Engine>]) -> PyResult<Vec<scheduler::Engine>> {
    let mut taken = Vec::with_capacity(engines.len());
    for e in engines {
        let mut e = e.borrow_mut();
        if e.core.has_work() {
            return Err(PyValueError::new_err("the engines must be idle"));
        }
        let placeholder =
            scheduler::Engine::new(2, e.core.cost().clone(), *e.core.hasher(), true, false);
        taken.push(std::mem::replace(&mut e.core, placeholder));
    }
    Ok(taken)
}

/// A request set from Python: ``(prefix_ids, suffix_tokens, suffix_offsets, output_tokens)``.
type RequestArrays<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
);

/// A request set from its Python arrays (see `simulate`).
fn request_set(
    py: Python<'_>,
    (prefix_ids, suffix_tokens, suffix_offsets, output_tokens): (
        &Bound<'_, PyAny>,
        &Bound<'_, PyAny>,
        &Bound<'_, PyAny>,
        &Bound<'_, PyAny>,
    ),
) -> PyResult<RequestSet> {
    Ok(RequestSet {
        prefix_ids: extract_tokens(py, prefix_ids)?,
        suffix_tokens: concat_suffixes(py, suffix_tokens)?,
        suffix_offsets: offsets(py, suffix_offsets)?,
        output_tokens: extract_tokens(py, output_tokens)?,
    })
}

/// Closed-loop clients or send times.
type Clients<'a> = (Option<usize>, Option<&'a [f64]>);

/// What `simulate` sends: a trial's warmup (if any), the requests, and how they are sent.
#[derive(Clone, Copy)]
struct Sends<'a> {
    warmup: Option<&'a RequestSet>,
    requests: &'a RequestSet,
    clients: Clients<'a>,
}

/// What a run gave: the requests' records, or a trial's.
enum Ran {
    Records(Vec<RequestRecord>),
    Trial(TrialResult),
}

fn run_requests(sim: &mut Simulation<'_>, sends: Sends<'_>) -> Result<Ran, SimError> {
    let requests = sends.requests;
    match (sends.warmup, sends.clients) {
        (Some(warmup), (Some(c), None)) => sim.run_trial(warmup, requests, c).map(Ran::Trial),
        (None, (Some(c), None)) => sim.run_closed_loop(requests, c).map(Ran::Records),
        (None, (None, Some(times))) => sim.run_open_loop(requests, times).map(Ran::Records),
        (Some(_), _) => Err(SimError::BadInput(
            "a trial sends its requests from closed-loop clients".into(),
        )),
        _ => Err(SimError::BadInput(
            "give either concurrency or send_times".into(),
        )),
    }
}

/// The router replicas of a run (see `simulate`'s ``replicas``).
struct ReplicaFleet<'a, 'py> {
    /// One routing step per replica.
    steps: &'a [Bound<'py, RoutingStep>],
    /// One retention model per replica (None: off).
    retention: Option<&'a [Bound<'py, PyRetention>]>,
    /// The mesh's delivery lag (None: no mesh).
    mesh_lag: Option<f64>,
    /// Seeds the balancer's draw of a replica per request.
    balancer_seed: u64,
}

/// What a run simulates: the workers' configuration, the shared prefixes and the output
/// tokens, what is sent and how, and the prefixes' tenants.
struct RunInputs<'a> {
    config: WorkerConfig,
    prefixes: Vec<Arc<[u32]>>,
    output: Arc<[u32]>,
    sends: Sends<'a>,
    tenants: Vec<Tenant>,
}

/// One run through the replicas of `fleet` on `engines` (put back after it), from `now`:
/// the clock, the records and the refreshes.
#[allow(clippy::type_complexity)]
fn run_replicas(
    py: Python<'_>,
    fleet: ReplicaFleet<'_, '_>,
    engines: &[Bound<'_, Engine>],
    now: f64,
    inputs: RunInputs<'_>,
) -> PyResult<(f64, Result<Ran, SimError>, RefreshStats)> {
    let ReplicaFleet {
        steps: replicas,
        retention,
        mesh_lag,
        balancer_seed: seed,
    } = fleet;
    let RunInputs {
        config,
        prefixes,
        output,
        sends,
        tenants,
    } = inputs;
    let fail = |msg: &str| Err(PyValueError::new_err(msg.to_owned()));
    if replicas.is_empty() || retention.is_some_and(|r| r.len() != replicas.len()) {
        return fail("one routing step (and one retention, if any) per replica");
    }
    if mesh_lag.is_some_and(|lag| !(lag >= 0.0 && lag.is_finite())) {
        return fail("the mesh lag must be a non-negative number of seconds");
    }
    let mut steps: Vec<PyRefMut<'_, RoutingStep>> =
        replicas.iter().map(|r| r.borrow_mut()).collect();
    if steps.iter().any(|s| s.inner.slot_count() != engines.len()) {
        return fail("each routing step must have one slot per engine");
    }
    let natives: Vec<Py<crate::policies::PyPolicy>> = steps
        .iter()
        .map(|s| s.native.as_ref().map(|p| p.clone_ref(py)))
        .collect::<Option<_>>()
        .ok_or_else(|| PyValueError::new_err("router replicas need native policies"))?;
    let mut policies: Vec<PyRefMut<'_, crate::policies::PyPolicy>> =
        natives.iter().map(|p| p.borrow_mut(py)).collect();
    let index_objs: Vec<Option<Py<crate::index::PyKvIndex>>> = steps
        .iter()
        .map(|s| s.index.as_ref().map(|i| i.clone_ref(py)))
        .collect();
    let index_refs: Vec<Option<PyRef<'_, crate::index::PyKvIndex>>> = index_objs
        .iter()
        .map(|i| i.as_ref().map(|i| i.borrow(py)))
        .collect();
    let mut guards: Vec<_> = index_refs
        .iter()
        .map(|i| i.as_ref().map(|i| lock_index(&i.inner)))
        .collect();
    let mut retentions: Vec<Option<PyRefMut<'_, PyRetention>>> = match retention {
        Some(r) => r.iter().map(|r| Some(r.borrow_mut())).collect(),
        None => replicas.iter().map(|_| None).collect(),
    };
    let mut parts = Vec::with_capacity(replicas.len());
    for (((step, policy), guard), retention) in steps
        .iter_mut()
        .zip(&mut policies)
        .zip(&mut guards)
        .zip(&mut retentions)
    {
        let mut index = guard.as_deref_mut();
        if let Some(ix) = index.as_deref_mut() {
            if ix.hasher() != config.hasher {
                return fail("each replica's index must hash blocks as the workers do");
            }
            // The engine model hashes blocks with the index's own hasher (as in one router's run).
            trust_engine_hashes(ix);
        }
        parts.push((
            &mut step.inner,
            index,
            &mut policy.inner,
            retention.as_deref_mut().map(|r| &mut r.inner),
        ));
    }
    let taken = take_engines(engines)?;
    let run = move || {
        let mut routers: Vec<Router<&mut kvroute_core::policies::Policy>> = Vec::new();
        let mut homes = Vec::with_capacity(parts.len());
        let mut indexes = Vec::with_capacity(parts.len());
        for (step, index, policy, mut retention) in parts {
            let taken = retention.as_deref_mut().map(take_retention);
            routers.push(Router::new(take_step(step), policy, taken));
            homes.push((step, retention));
            indexes.push(index);
        }
        let replicas = routers
            .iter_mut()
            .zip(indexes)
            .map(|(router, index)| RouterPlacement::new(router, index))
            .collect();
        let mut placement = ReplicaPlacement::new(replicas, mesh_lag, seed);
        let mut sim =
            Simulation::with_engines(taken, now, config, &mut placement, prefixes, output);
        sim.set_tenants(tenants);
        let result = run_requests(&mut sim, sends);
        let refreshes = sim.refresh_stats();
        let (back, now) = sim.into_engines();
        placement.settle();
        drop(placement);
        for (router, (step, retention)) in routers.into_iter().zip(homes) {
            let (step_back, _, retention_back) = router.into_parts();
            *step = step_back;
            if let (Some(r), Some(b)) = (retention, retention_back) {
                *r = b;
            }
        }
        (back, now, result, refreshes)
    };
    let (back, now, result, refreshes) = py.detach(run);
    for (e, core) in engines.iter().zip(back) {
        e.borrow_mut().core = core;
    }
    Ok((now, result, refreshes))
}

/// A run's records as `simulate` returns them.
fn records_dict<'py>(
    py: Python<'py>,
    now: f64,
    result: Result<Ran, SimError>,
    refreshes: RefreshStats,
) -> PyResult<Bound<'py, PyDict>> {
    let ran = result.map_err(|e| match e {
        SimError::Unfinished(_) => PyRuntimeError::new_err(e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    })?;
    let out = PyDict::new(py);
    out.set_item("now", now)?;
    out.set_item("refresh_requests", refreshes.requests)?;
    out.set_item("refresh_computed_tokens", refreshes.computed_tokens)?;
    out.set_item("refresh_engine_s", refreshes.engine_s)?;
    let records = match ran {
        Ran::Records(records) => records,
        Ran::Trial(trial) => {
            out.set_item("duration_s", trial.duration_s)?;
            let window: Vec<PrefixCacheStats> =
                trial.window_stats.into_iter().map(Into::into).collect();
            out.set_item("window_stats", window)?;
            out.set_item("window_refresh_requests", trial.refreshes.requests)?;
            out.set_item("window_refresh_engine_s", trial.refreshes.engine_s)?;
            trial.records
        }
    };
    let column = |f: fn(&RequestRecord) -> f64| records.iter().map(f).collect::<Vec<_>>();
    out.set_item(
        "worker",
        records.iter().map(|r| r.worker).collect::<Vec<_>>(),
    )?;
    out.set_item(
        "cached_tokens",
        records.iter().map(|r| r.cached_tokens).collect::<Vec<_>>(),
    )?;
    out.set_item(
        "prompt_tokens",
        records.iter().map(|r| r.prompt_tokens).collect::<Vec<_>>(),
    )?;
    out.set_item("send_time", column(|r| r.send_time))?;
    out.set_item("ttft_s", column(|r| r.ttft_s))?;
    out.set_item("e2e_s", column(|r| r.e2e_s))?;
    out.set_item(
        "output_tokens",
        records.iter().map(|r| r.output_tokens).collect::<Vec<_>>(),
    )?;
    Ok(out)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    Ok(())
}
