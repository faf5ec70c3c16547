//! Health and outlier ejection: which workers may take a request (see the module docs of
//! `crate::fleet`).

use kvroute_io::consumer::lock_index;

use super::member::Member;
use super::state::Fleet;

/// Longest ejection, whatever the number of ejections in a row.
pub const MAX_EJECTION_S: f64 = 300.0;

impl Fleet {
    fn member(&mut self, name: &str) -> Option<&mut Member> {
        self.members.iter_mut().find(|m| m.name == name)
    }

    /// A request to worker `name` succeeded: its failure and ejection counts start again.
    pub fn succeeded(&mut self, name: &str) {
        if let Some(m) = self.member(name) {
            m.consecutive_failures = 0;
            m.ejections = 0;
        }
    }

    /// A request to worker `name` failed at `now`; true when that ejected it.
    pub fn failed(&mut self, name: &str, now: f64) -> bool {
        let (after, base) = (self.eject_after_failures, self.eject_base_s);
        let Some(m) = self.member(name) else {
            return false;
        };
        m.consecutive_failures += 1;
        if after == 0 || m.consecutive_failures < after {
            return false;
        }
        m.consecutive_failures = 0;
        m.ejections += 1;
        m.ejected_total += 1;
        m.ejected_until = now + (base * f64::from(m.ejections)).min(MAX_EJECTION_S);
        // Out until a health check passes after the ejection, whatever it answered before.
        m.healthy = false;
        true
    }

    /// Worker `name` refused a connection: out of the available set, its index entries
    /// dropped.
    pub fn refused(&mut self, name: &str) {
        if let Some(m) = self.member(name) {
            m.healthy = false;
        }
        lock_index(&self.index).reset_worker(name);
    }

    /// A health check of worker `name` at `now` passed or failed.
    pub fn checked(&mut self, name: &str, passed: bool, now: f64) {
        let mut reset = false;
        if let Some(m) = self.member(name) {
            if passed {
                if now >= m.ejected_until {
                    m.healthy = true;
                }
            } else {
                m.health_failures += 1;
                reset = m.healthy;
                m.healthy = false;
            }
        }
        if reset {
            lock_index(&self.index).reset_worker(name);
        }
    }
}
