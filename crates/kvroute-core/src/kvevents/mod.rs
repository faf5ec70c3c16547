//! vLLM's KV-event stream: the event types (as vLLM keeps them in `distributed/kv_events.py`,
//! apart from the engine that emits them), the msgpack wire codec (both event shapes vLLM has
//! sent) and the subscriber's sequence tracker (gaps, replay, restarts, duplicates) as a state
//! machine. A leaf: the engine model, the index and the codec import it, it imports none of them.

pub mod codec;
pub mod events;
pub mod sequence;
