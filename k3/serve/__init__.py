"""Serving: continuous-batching engine with the K3 hybrid prefix cache, and an OpenAI-compatible server.

The HTTP parts (`k3.serve.server`, `k3.serve.async_engine`) need fastapi and uvicorn; the engine
needs only torch.
"""

from k3.serve.engine import Engine, EngineConfig, FinalOutput, RequestOutput
from k3.serve.sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "FinalOutput", "RequestOutput", "SamplingParams"]
