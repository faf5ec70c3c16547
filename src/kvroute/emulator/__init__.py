"""A vLLM-compatible emulator: the engine model on the wall clock behind vLLM's interfaces.

Any OpenAI client, Prometheus scraper or KV-event subscriber can run against it unchanged,
while its cache behaviour is exactly the engine model's (``kvroute.engine``).

In-process use (the experiment runner, router tests)::

    workers = await start_workers(EmulatorConfig(timing="instant"), n=3)
    urls = [w.url for w in workers]
    ...
    for w in workers:
        await w.close()
"""

from kvroute.emulator.config import MODEL_PRESETS, EmulatorConfig, ModelPreset
from kvroute.emulator.server import EmulatorApp, RunningWorker, serve_worker, start_workers
from kvroute.emulator.textgen import OutputTokenGenerator
from kvroute.emulator.worker import EmulatedWorker, RequestStream

__all__ = [
    "MODEL_PRESETS",
    "EmulatedWorker",
    "EmulatorApp",
    "EmulatorConfig",
    "ModelPreset",
    "OutputTokenGenerator",
    "RequestStream",
    "RunningWorker",
    "serve_worker",
    "start_workers",
]
