//! The Endpoint Picker's own counters, written beside serve's through serve's one writer of
//! the Prometheus text format (`kvroute_serve::metrics::exposition`).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use kvroute_serve::metrics::exposition::{Exposition, Kind};

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

    /// A whole `/metrics` text: serve's (`serve_text`), then the EPP's own.
    pub fn scrape(&self, serve_text: String) -> String {
        let mut out = Exposition::new();
        self.render(&mut out);
        serve_text + &out.finish()
    }

    /// The counters.
    fn render(&self, out: &mut Exposition) {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64;
        out.labelled(
            "kvroute_epp_picks",
            Kind::Counter,
            "Endpoints named to the gateway, by how they were chosen (prompt: the routing step; no_prompt: rotation).",
            &["how"],
            [
                (vec!["prompt"], load(&self.picks_prompt)),
                (vec!["no_prompt"], load(&self.picks_no_prompt)),
            ],
        );
        let immediate = self.immediate.lock().unwrap_or_else(|p| p.into_inner());
        let codes: Vec<String> = immediate.keys().map(u16::to_string).collect();
        out.labelled(
            "kvroute_epp_immediate_responses",
            Kind::Counter,
            "Requests the EPP answered itself through the gateway, by HTTP status.",
            &["code"],
            codes
                .iter()
                .zip(immediate.values())
                .map(|(code, &n)| (vec![code.as_str()], n as f64)),
        );
        drop(immediate);
        out.scalar(
            "kvroute_epp_stream_errors",
            Kind::Counter,
            "ext_proc streams that ended in an error (reset by the gateway, or out of protocol).",
            load(&self.stream_errors),
        );
        out.scalar(
            "kvroute_epp_streams_open",
            Kind::Gauge,
            "ext_proc streams open (requests at the gateway the EPP follows).",
            self.streams_open.load(Ordering::Relaxed) as f64,
        );
        out.scalar(
            "kvroute_epp_response_chunks",
            Kind::Counter,
            "Response body chunks the gateway passed through the EPP (none with response_body_mode NONE).",
            load(&self.response_chunks),
        );
    }
}

/// One open ext_proc stream ([`Counters::open`]).
pub struct StreamOpen(std::sync::Arc<Counters>);

impl Drop for StreamOpen {
    fn drop(&mut self) {
        self.0.streams_open.fetch_sub(1, Ordering::Relaxed);
    }
}
