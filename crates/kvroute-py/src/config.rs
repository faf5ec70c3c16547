//! Configurations read from Python whole: a dict (or any mapping and list structure) read
//! by serde into the native type, with a mistake named by the setting it is in, so that the
//! CLI can name its flag (`kvroute.router.server.ConfigError`).

use kvroute_serve::ConfigError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde::de::DeserializeOwned;

/// A `ConfigError` as Python's `ValueError`: with a field, its arguments are `(field,
/// message)` (`kvroute.router.server` names the setting, the CLI its flag); else the message.
pub fn config_error(e: ConfigError) -> PyErr {
    match e.field {
        Some(field) => PyValueError::new_err((field, e.message)),
        None => PyValueError::new_err(e.message),
    }
}

/// What a setting's reader said, in a user's words: Python's own errors for a negative (or
/// huge) number given to a count or a size, and for none given to a number, are said of the
/// setting.
pub fn user_words(error: &impl std::fmt::Display) -> String {
    let message = error.to_string();
    let python = [
        (
            "OverflowError",
            "must be a whole number >= 0 (and in range)",
        ),
        (
            "TypeError: must be real number, not NoneType",
            "must be a number, got none",
        ),
    ];
    for (words, said) in python {
        if let Some(at) = message.find(words) {
            return format!("{}{said}", &message[..at]);
        }
    }
    message
}

/// `value` read as a `T` by serde; a mistake names the field it is in (the path's first
/// part: `workers[2].url` is the `workers` setting's).
pub fn read_config<T: DeserializeOwned>(value: &Bound<'_, PyAny>) -> PyResult<T> {
    let mut de = pythonize::Depythonizer::from_object(value);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let message = user_words(e.inner());
        let field = path.split(['.', '[']).next().unwrap_or_default();
        if field.is_empty() || field == "?" {
            PyValueError::new_err(message)
        } else if field == path {
            config_error(ConfigError::field(field, message))
        } else {
            config_error(ConfigError::field(field, format!("({path}): {message}")))
        }
    })
}
