//! Each worker's KV capacity, which the admission guard and retention count its cache by: the
//! configured one, or what its engine reports.

use kvroute_core::blocks::usable_blocks;

use super::state::Fleet;

impl Fleet {
    /// Workers whose KV capacity the admission guard or retention needs and may ask their
    /// engine for at `now`, as `(name, url)`; each is not offered again for `retry_s` unless
    /// it answers.
    pub fn kv_capacity_wanted(&mut self, now: f64, retry_s: f64) -> Vec<(String, String)> {
        if self.router.step().admission().is_none() && self.router.retention().is_none() {
            return Vec::new();
        }
        self.members
            .iter_mut()
            .filter(|m| m.kv_capacity_blocks.is_none() && m.kv_capacity_retry_at <= now)
            .map(|m| {
                m.kv_capacity_retry_at = now + retry_s;
                (m.name.clone(), m.url.clone())
            })
            .collect()
    }

    /// Worker `name`'s engine reported `num_gpu_blocks` KV blocks (the null block included):
    /// the admission guard and retention count that worker's cache by it.
    pub fn set_kv_capacity(&mut self, name: &str, num_gpu_blocks: usize) {
        if let Some(m) = self.members.iter_mut().find(|m| m.name == name) {
            let usable = usable_blocks(num_gpu_blocks);
            m.kv_capacity_blocks = Some(usable);
            self.router.set_kv_capacity(m.slot, usable);
        }
    }
}
