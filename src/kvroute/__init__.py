"""kvroute: measure, predict and fix prefix-cache reuse across a fleet of vLLM workers."""

__version__ = "0.1.0"
