//! Token ids from Python: a `uint32` buffer (numpy, `array.array("I")`) is copied in one
//! `memcpy`; anything else (a list, another dtype) is converted element by element, and an id
//! that does not fit in `u32` is an error.

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;

/// `obj` as token ids.
pub fn extract_tokens(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if let Ok(buffer) = PyBuffer::<u32>::get(obj)
        && buffer.dimensions() <= 1
    {
        return buffer.to_vec(py);
    }
    obj.extract::<Vec<u32>>()
}
