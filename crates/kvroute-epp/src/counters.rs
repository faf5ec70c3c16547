//! The Endpoint Picker's own counters, beside serve's (`kvroute_serve::metrics`), in the
//! Prometheus text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// What the EPP counts of its exchanges with the gateway.
#[derive(Default)]
pub struct Counters {
    /// Endpoints named, by how: `prompt` (the routing step), `no_prompt` (rotation).
    picks_prompt: AtomicU64,
    picks_no_prompt: AtomicU64,
    /// Immediate responses by HTTP status.
    immediate: Mutex<BTreeMap<u16, u64>>,
    /// ext_proc streams that ended in an error (the gateway reset it, or broke the protocol).
    stream_errors: AtomicU64,
    /// ext_proc streams open now (one per request at the gateway).
    streams_open: AtomicI64,
    /// Response body chunks the gateway sent (none when it is configured with response_body_mode NONE).
    response_chunks: AtomicU64,
}

impl Counters {
    pub fn picked(&self, by_prompt: bool) {
        let c = if by_prompt {
            &self.picks_prompt
        } else {
            &self.picks_no_prompt
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub fn immediate(&self, status: u16) {
        *self
            .immediate
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(status)
            .or_insert(0) += 1;
    }

    pub fn stream_error(&self) {
        self.stream_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub fn response_chunk(&self) {
        self.response_chunks.fetch_add(1, Ordering::Relaxed);
    }

    /// Count a stream open until the guard drops.
    pub fn open(self: &std::sync::Arc<Self>) -> StreamOpen {
        self.streams_open.fetch_add(1, Ordering::Relaxed);
        StreamOpen(self.clone())
    }

    /// The counters as Prometheus text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP kvroute_epp_picks_total Endpoints named to the gateway, by how they were chosen (prompt: the routing step; no_prompt: rotation).\n# TYPE kvroute_epp_picks_total counter"
        );
        for (how, c) in [
            ("prompt", &self.picks_prompt),
            ("no_prompt", &self.picks_no_prompt),
        ] {
            let _ = writeln!(
                out,
                "kvroute_epp_picks_total{{how=\"{how}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP kvroute_epp_immediate_responses_total Requests the EPP answered itself through the gateway, by HTTP status.\n# TYPE kvroute_epp_immediate_responses_total counter"
        );
        for (code, n) in self
            .immediate
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "kvroute_epp_immediate_responses_total{{code=\"{code}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP kvroute_epp_stream_errors_total ext_proc streams that ended in an error (reset by the gateway, or out of protocol).\n# TYPE kvroute_epp_stream_errors_total counter\nkvroute_epp_stream_errors_total {}",
            self.stream_errors.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP kvroute_epp_streams_open ext_proc streams open (requests at the gateway the EPP follows).\n# TYPE kvroute_epp_streams_open gauge\nkvroute_epp_streams_open {}",
            self.streams_open.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP kvroute_epp_response_chunks_total Response body chunks the gateway passed through the EPP (none with response_body_mode NONE).\n# TYPE kvroute_epp_response_chunks_total counter\nkvroute_epp_response_chunks_total {}",
            self.response_chunks.load(Ordering::Relaxed)
        );
        out
    }
}

/// One open ext_proc stream ([`Counters::open`]).
pub struct StreamOpen(std::sync::Arc<Counters>);

impl Drop for StreamOpen {
    fn drop(&mut self) {
        self.0.streams_open.fetch_sub(1, Ordering::Relaxed);
    }
}
