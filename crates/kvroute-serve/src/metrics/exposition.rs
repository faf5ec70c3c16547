//! The Prometheus text format (0.0.4), written once for every front: serve's `/metrics`
//! and the Endpoint Picker's own counters beside it (`kvroute_epp::counters`) go through
//! one [`Exposition`], so a sample, its label escaping and its `HELP`/`TYPE` lines are
//! spelled in one place. Also the two stores the counters keep between scrapes: labelled
//! counters ([`Family`]) and fixed-bucket histograms ([`Histogram`]).
//!
//! Every value is written as a float (`1.0`), as Prometheus' own clients do.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

/// What a metric is, as its `TYPE` line says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (its name gets `_total`).
    Counter,
    /// Goes up and down.
    Gauge,
}

impl Kind {
    fn type_name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Kind::Counter => "_total",
            Kind::Gauge => "",
        }
    }
}

/// A scrape's text, metric by metric.
#[derive(Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    /// An empty scrape.
    pub fn new() -> Self {
        Self {
            out: String::with_capacity(4096),
        }
    }

    /// The text written so far.
    pub fn finish(self) -> String {
        self.out
    }

    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (key, val)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{key}=\"{}\"", escape(val));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {value:?}");
    }

    /// One unlabelled sample (a counter's name gets `_total`).
    pub fn scalar(&mut self, name: &str, kind: Kind, help: &str, value: f64) {
        let name = format!("{name}{}", kind.suffix());
        self.header(&name, kind.type_name(), help);
        self.sample(&name, &[], value);
    }

    /// A metric with one sample per row of label values (`label_names` in order).
    pub fn labelled<'a>(
        &mut self,
        name: &str,
        kind: Kind,
        help: &str,
        label_names: &[&str],
        rows: impl IntoIterator<Item = (Vec<&'a str>, f64)>,
    ) {
        let name = format!("{name}{}", kind.suffix());
        self.header(&name, kind.type_name(), help);
        for (values, value) in rows {
            let labels: Vec<(&str, &str)> = label_names.iter().copied().zip(values).collect();
            self.sample(&name, &labels, value);
        }
    }

    /// A metric with one sample per worker (`worker="..."`).
    pub fn per_worker<'a>(
        &mut self,
        name: &str,
        kind: Kind,
        help: &str,
        rows: impl IntoIterator<Item = (&'a str, f64)>,
    ) {
        let rows = rows.into_iter().map(|(w, v)| (vec![w], v));
        self.labelled(name, kind, help, &["worker"], rows);
    }

    /// A labelled counter's samples.
    pub fn family(&mut self, name: &str, help: &str, label_names: &[&str], family: &Family) {
        let map = family.0.lock().unwrap_or_else(|p| p.into_inner());
        let rows = map
            .iter()
            .map(|(values, &n)| (values.iter().map(String::as_str).collect(), n as f64));
        self.labelled(name, Kind::Counter, help, label_names, rows);
    }

    /// A histogram's cumulative buckets, count and sum.
    pub fn histogram(&mut self, name: &str, help: &str, histogram: &Histogram) {
        let s = histogram.state.lock().unwrap_or_else(|p| p.into_inner());
        self.header(name, "histogram", help);
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (bound, n) in histogram.bounds.iter().zip(&s.0) {
            cumulative += n;
            self.sample(&bucket, &[("le", &format!("{bound:?}"))], cumulative as f64);
        }
        self.sample(&bucket, &[("le", "+Inf")], s.2 as f64);
        self.sample(&format!("{name}_count"), &[], s.2 as f64);
        self.sample(&format!("{name}_sum"), &[], s.1);
    }
}

/// A label value as the text format needs it.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Labelled counters: one value per label tuple.
#[derive(Default)]
pub struct Family(Mutex<BTreeMap<Vec<String>, u64>>);

impl Family {
    /// Count one under these label values.
    pub fn inc(&self, labels: &[&str]) {
        let key: Vec<String> = labels.iter().map(|&l| l.to_owned()).collect();
        let mut map = self.0.lock().unwrap_or_else(|p| p.into_inner());
        *map.entry(key).or_insert(0) += 1;
    }
}

/// A histogram with fixed bucket bounds (Prometheus' cumulative text form).
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), then the count above the last bound, the sum and count.
    state: Mutex<(Vec<u64>, f64, u64)>,
}

impl Histogram {
    /// An empty histogram with these (increasing) bucket bounds.
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            state: Mutex::new((vec![0; bounds.len() + 1], 0.0, 0)),
        }
    }

    /// Count one value.
    pub fn observe(&self, value: f64) {
        let i = self.bounds.partition_point(|&b| b < value);
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.0[i] += 1;
        s.1 += value;
        s.2 += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_escape_their_labels_and_histograms_are_cumulative() {
        let mut x = Exposition::new();
        x.per_worker("w", Kind::Counter, "h", [("a\"b\n", 2.0)]);
        let h = Histogram::new(&[1.0, 2.0]);
        for v in [0.5, 1.5, 1.5, 9.0] {
            h.observe(v);
        }
        x.histogram("lat", "l", &h);
        x.scalar("up", Kind::Gauge, "u", 1.0);
        assert_eq!(
            x.finish(),
            "# HELP w_total h\n# TYPE w_total counter\nw_total{worker=\"a\\\"b\\n\"} 2.0\n\
             # HELP lat l\n# TYPE lat histogram\nlat_bucket{le=\"1.0\"} 1.0\n\
             lat_bucket{le=\"2.0\"} 3.0\nlat_bucket{le=\"+Inf\"} 4.0\nlat_count 4.0\n\
             lat_sum 12.5\n# HELP up u\n# TYPE up gauge\nup 1.0\n"
        );
    }
}
