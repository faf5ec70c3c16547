//! The balancing policies for Python: `Policy` (the base of `kvroute.routing.policies`' thin
//! classes), a Python-written policy inside the native step, and `NativeRandom` (CPython's
//! generator, which seeds them).

use kvroute_core::policies::{self, Choose};
use kvroute_core::pyrandom::PyRandom;
use kvroute_serve::PolicySpec;
use pyo3::exceptions::{PyIndexError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::config::user_words;
use crate::workers::{RequestView, WorkerState, states_of};

/// Policy `kind` with `options` (its option names to values; absent ones at their defaults,
/// None turns a guard off): `PolicySpec::with_options`, the one reader of policy options.
fn policy_spec(kind: &str, options: Option<&Bound<'_, PyDict>>) -> PyResult<PolicySpec> {
    let spec = match options {
        Some(options) => {
            let mut de = pythonize::Depythonizer::from_object(options.as_any());
            PolicySpec::with_options(kind, &mut de)
                .map_err(|e| PyValueError::new_err(user_words(&e)))?
        }
        None => PolicySpec::named(kind),
    };
    Ok(spec)
}

/// The options policy ``kind`` takes, with their defaults (empty for a policy that takes
/// none): ``kvroute.routing.policies`` reads them from here, their one owner.
#[pyfunction]
pub fn policy_defaults<'py>(py: Python<'py>, kind: &str) -> PyResult<Bound<'py, PyAny>> {
    let spec = PolicySpec::named(kind);
    let options = match kind {
        "kv-aware" => pythonize::pythonize(py, &spec.kv_aware),
        "prefix-hash" => pythonize::pythonize(py, &spec.prefix_hash),
        _ => Ok(PyDict::new(py).into_any()),
    };
    options.map_err(|e| PyValueError::new_err(e.to_string()))
}

/// `random.Random`'s generator state copied into a native one (a fresh unseeded
/// `random.Random()` when None): the policy then draws what that object would have drawn.
fn rng_of(py: Python<'_>, rng: Option<&Bound<'_, PyAny>>) -> PyResult<PyRandom> {
    let fresh;
    let rng = match rng {
        Some(r) if !r.is_none() => r,
        _ => {
            fresh = py.import("random")?.getattr("Random")?.call0()?;
            &fresh
        }
    };
    let state = rng.call_method0("getstate")?;
    let internal = state.get_item(1)?;
    let words: Vec<u64> = internal.extract()?;
    if words.len() != 625 {
        return Err(PyValueError::new_err("rng: not a random.Random state"));
    }
    let mt: Vec<u32> = words[..624].iter().map(|&w| w as u32).collect();
    PyRandom::from_state(&mt, words[624] as usize).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// A native balancing policy; ``kvroute.routing.policies``' classes (one per name) derive
/// from it and say ``name`` and ``needs_overlap``.
///
/// Args:
///     kind: the policy's name.
///     rng: a ``random.Random`` whose state seeds the policy's draws (None: unseeded).
///     the rest: the options of that policy (see ``kvroute.routing.policies``).
#[pyclass(module = "kvroute._native", name = "Policy", subclass)]
pub struct PyPolicy {
    pub inner: policies::Policy,
}

#[pymethods]
impl PyPolicy {
    #[new]
    #[pyo3(signature = (kind, rng = None, **options))]
    fn new(
        py: Python<'_>,
        kind: &str,
        rng: Option<&Bound<'_, PyAny>>,
        options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let rng = rng_of(py, rng)?;
        let spec = policy_spec(kind, options)?;
        let inner = spec
            .build_with(spec.kv_aware.block_size, rng)
            .map_err(|e| PyValueError::new_err(e.message))?;
        Ok(Self { inner })
    }

    /// Index into ``workers`` of the worker to send ``request`` to.
    fn choose(
        &mut self,
        request: PyRef<'_, RequestView>,
        workers: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let states = states_of(workers)?;
        check_aligned(&request, states.len())?;
        let refs: Vec<&policies::WorkerState> = states.iter().map(|s| &s.inner).collect();
        Ok(self.inner.choose(&request.view(), &refs))
    }

    /// kv-aware: each worker's cost, aligned with ``workers``.
    fn costs(
        &self,
        request: PyRef<'_, RequestView>,
        workers: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<f64>> {
        let states = states_of(workers)?;
        check_aligned(&request, states.len())?;
        let refs: Vec<&policies::WorkerState> = states.iter().map(|s| &s.inner).collect();
        Ok(self.kv_aware()?.costs(&request.view(), &refs))
    }

    /// kv-aware: each worker's share of the recent decisions, aligned with ``workers``.
    fn shares(&self, workers: &Bound<'_, PyAny>) -> PyResult<Vec<f64>> {
        let states = states_of(workers)?;
        let refs: Vec<&policies::WorkerState> = states.iter().map(|s| &s.inner).collect();
        Ok(self.kv_aware()?.shares(&refs))
    }

    /// kv-aware: workers the guards let take one more request.
    fn eligible(&self, workers: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
        let states = states_of(workers)?;
        let refs: Vec<&policies::WorkerState> = states.iter().map(|s| &s.inner).collect();
        Ok(self.kv_aware()?.eligible(&refs))
    }

    /// kv-aware: replace the recent shares by worker name (a replica taking over another's
    /// state).
    fn restore_shares(&mut self, shares: Vec<(String, f64)>) -> PyResult<()> {
        match &mut self.inner {
            policies::Policy::KvAware(p) => {
                p.restore_shares(shares, None);
                Ok(())
            }
            _ => Err(PyTypeError::new_err("only kv-aware keeps shares")),
        }
    }

    /// prefix-hash: workers in this request's rendezvous order (owner first).
    fn ranking(
        &mut self,
        request: PyRef<'_, RequestView>,
        workers: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<usize>> {
        let states = states_of(workers)?;
        let refs: Vec<&policies::WorkerState> = states.iter().map(|s| &s.inner).collect();
        match &mut self.inner {
            policies::Policy::PrefixHash(p) => Ok(p.ranking(&request.view(), &refs)),
            _ => Err(PyTypeError::new_err("only prefix-hash ranks workers")),
        }
    }

    #[getter]
    fn block_size(&self) -> PyResult<usize> {
        Ok(self.kv_aware()?.config().block_size)
    }
    #[getter]
    fn overlap_weight(&self) -> PyResult<f64> {
        Ok(self.kv_aware()?.config().overlap_weight)
    }
    #[getter]
    fn request_weight(&self) -> PyResult<f64> {
        Ok(self.kv_aware()?.config().request_weight)
    }
    #[getter]
    fn share_factor(&self) -> PyResult<Option<f64>> {
        Ok(self.kv_aware()?.config().share_factor)
    }
    #[getter]
    fn share_window(&self) -> PyResult<f64> {
        Ok(self.kv_aware()?.config().share_window)
    }
    #[getter]
    fn share_weight(&self) -> PyResult<f64> {
        Ok(self.kv_aware()?.config().share_weight)
    }
    #[getter]
    fn adapter_weight(&self) -> PyResult<f64> {
        Ok(self.kv_aware()?.config().adapter_weight)
    }
    #[getter]
    fn admission_wait(&self) -> PyResult<Option<f64>> {
        Ok(self.kv_aware()?.config().admission_wait)
    }
    /// kv-aware: decisions its admission guard moved off a worker where the request would
    /// have waited for KV blocks (cumulative).
    #[getter]
    fn admission_diversions(&self) -> PyResult<u64> {
        Ok(self.kv_aware()?.admission_diversions())
    }
    /// Whether it reads the step's KV-admission model (``RoutingStep(kv_capacity_blocks=)``).
    #[getter]
    fn needs_admission(&self) -> bool {
        self.inner.needs_admission()
    }
    #[getter]
    fn load_factor(&self) -> PyResult<Option<f64>> {
        match &self.inner {
            policies::Policy::KvAware(p) => Ok(p.config().load_factor),
            policies::Policy::PrefixHash(p) => Ok(p.config.load_factor),
            _ => Err(PyTypeError::new_err("this policy has no load factor")),
        }
    }
    #[getter]
    fn key_blocks(&self) -> PyResult<usize> {
        match &self.inner {
            policies::Policy::PrefixHash(p) => Ok(p.config.key_blocks),
            _ => Err(PyTypeError::new_err("only prefix-hash has key blocks")),
        }
    }
}

impl PyPolicy {
    fn kv_aware(&self) -> PyResult<&policies::KvAware> {
        match &self.inner {
            policies::Policy::KvAware(p) => Ok(p),
            _ => Err(PyTypeError::new_err("a kv-aware policy only")),
        }
    }
}

fn check_aligned(request: &RequestView, workers: usize) -> PyResult<()> {
    match &request.overlap_blocks {
        Some(o) if !o.is_empty() && o.len() != workers => Err(PyValueError::new_err(
            "overlap_blocks is not aligned with workers",
        )),
        _ => Ok(()),
    }
}

/// A policy written in Python (a test's oracle): called with ``RequestView`` and
/// ``WorkerState`` objects; its first error is kept and raised after the step.
pub(crate) struct ForeignPolicy<'a, 'py> {
    pub(crate) policy: &'a Bound<'py, PyAny>,
    pub(crate) needs_overlap: bool,
    /// The first error the Python policy raised (its choice then reads 0).
    pub(crate) error: Option<PyErr>,
}

impl Choose for ForeignPolicy<'_, '_> {
    fn name(&self) -> &str {
        "foreign"
    }
    fn needs_overlap(&self) -> bool {
        self.needs_overlap
    }
    fn choose(
        &mut self,
        request: &policies::RequestView<'_>,
        workers: &[&policies::WorkerState],
    ) -> usize {
        let py = self.policy.py();
        let result = (|| -> PyResult<usize> {
            let view = RequestView {
                block_hashes: request.block_hashes.to_vec(),
                prompt_tokens: request.prompt_tokens,
                overlap_blocks: request.overlap_blocks.map(<[usize]>::to_vec),
            };
            let states = PyList::empty(py);
            for w in workers {
                states.append(WorkerState {
                    inner: (*w).clone(),
                })?;
            }
            let i: usize = self
                .policy
                .call_method1("choose", (view, states))?
                .extract()?;
            if i >= workers.len() {
                return Err(PyIndexError::new_err("the policy chose no candidate"));
            }
            Ok(i)
        })();
        result.unwrap_or_else(|e| {
            self.error.get_or_insert(e);
            0
        })
    }
}

/// ``kvroute_core::pyrandom``: CPython's ``random.Random`` reimplemented, exposed so tests
/// can check its draws against Python's own.
///
/// Args:
///     seed: an int of any size (its absolute value is used, as CPython does).
#[pyclass(module = "kvroute._native", name = "NativeRandom")]
pub struct NativeRandom {
    inner: PyRandom,
}

#[pymethods]
impl NativeRandom {
    #[new]
    fn new(seed: &Bound<'_, PyAny>) -> PyResult<Self> {
        let n = seed.call_method0("__abs__")?;
        let bits: usize = n.call_method0("bit_length")?.extract()?;
        let bytes: Vec<u8> = n
            .call_method1("to_bytes", (bits.div_ceil(32).max(1) * 4, "little"))?
            .extract()?;
        let key: Vec<u32> = bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Ok(Self {
            inner: PyRandom::from_key(&key),
        })
    }

    /// A generator in the state of ``rng`` (a ``random.Random``).
    #[staticmethod]
    fn from_random(py: Python<'_>, rng: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(Self {
            inner: rng_of(py, Some(rng))?,
        })
    }

    fn random(&mut self) -> f64 {
        self.inner.random()
    }

    fn getrandbits(&mut self, k: u32) -> PyResult<u64> {
        if k > 64 {
            return Err(PyValueError::new_err("at most 64 bits"));
        }
        Ok(self.inner.getrandbits(k))
    }

    fn randrange(&mut self, n: usize) -> PyResult<usize> {
        if n == 0 {
            return Err(PyValueError::new_err("empty range for randrange()"));
        }
        Ok(self.inner.randrange(n))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPolicy>()?;
    m.add_class::<NativeRandom>()?;
    m.add_function(wrap_pyfunction!(policy_defaults, m)?)?;
    m.add("POLICY_NAMES", policies::POLICY_NAMES.to_vec())?;
    Ok(())
}
