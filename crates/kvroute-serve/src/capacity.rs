//! A worker's KV capacity, as its engine reports it on `/metrics`.
//!
//! vLLM exports its cache configuration as an info gauge whose labels are the `CacheConfig`
//! fields, `vllm:cache_config_info{...,num_gpu_blocks="585",...} 1.0` (the null block
//! included). kv-aware's admission guard needs each worker's blocks to tell whether a request
//! would wait there for KV memory; reading them from the engine spares the operator a flag
//! that would be wrong for every fleet but the one it was written for.

/// The metric family carrying the cache configuration.
const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";

/// `num_gpu_blocks` from a Prometheus text exposition, if a `vllm:cache_config_info` sample
/// carries a positive one (a data-parallel engine exports one sample per engine: the first
/// is taken, as every engine of a worker gets the same cache).
pub fn num_gpu_blocks(metrics_text: &str) -> Option<usize> {
    metrics_text
        .lines()
        .filter_map(|line| line.strip_prefix(CACHE_CONFIG_INFO)?.strip_prefix('{'))
        .find_map(|labels| {
            let (labels, _) = labels.split_once('}')?;
            label(labels, "num_gpu_blocks")?
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
        })
}

/// The value of label `name` in a sample's label set `a="1",b="x"` (values here hold no
/// escaped quotes: they are numbers and Python reprs).
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let mut rest = labels;
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"")?;
        let (value, after) = after.split_once('"')?;
        if key.trim_start_matches(',').trim() == name {
            return Some(value);
        }
        rest = after;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_num_gpu_blocks_from_the_info_gauge() {
        let text = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
             # TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",engine=\"0\",\
             num_cpu_blocks=\"None\",num_gpu_blocks=\"585\",num_gpu_blocks_override=\"None\"} 1.0\n\
             vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 0.0\n";
        assert_eq!(num_gpu_blocks(text), Some(585));
    }

    #[test]
    fn anything_else_is_no_capacity() {
        assert_eq!(num_gpu_blocks(""), None);
        assert_eq!(num_gpu_blocks("vllm:num_gpu_blocks 5\n"), None);
        // The override label is not the count, and "None" is no number.
        assert_eq!(
            num_gpu_blocks("vllm:cache_config_info{num_gpu_blocks_override=\"9\"} 1.0\n"),
            None
        );
        assert_eq!(
            num_gpu_blocks("vllm:cache_config_info{num_gpu_blocks=\"None\"} 1.0\n"),
            None
        );
        assert_eq!(
            num_gpu_blocks("vllm:cache_config_info{num_gpu_blocks=\"0\"} 1.0\n"),
            None
        );
        assert_eq!(
            num_gpu_blocks("vllm:cache_config_info{num_gpu_blocks=\"12"),
            None
        );
    }
}
