//! vLLM's KV-event stream: the msgpack wire codec (both event shapes vLLM has sent) and the
//! subscriber's sequence tracker (gaps, replay, restarts, duplicates) as a state machine.

pub mod codec;
pub mod sequence;
